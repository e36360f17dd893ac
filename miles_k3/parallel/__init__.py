"""Scale-out over one DeviceMesh: data parallel (`dp`) x tensor parallel (`tp`), with expert parallelism (`ep`)
laid over the dp x tp ranks. `config` (the `parallel:` section and its checks against a model), `mesh` (the
process groups of a run, from torchrun's environment), `comm` (the autograd-aware collectives the sharded model
uses). Without torchrun (WORLD_SIZE unset) every group is trivial and every collective is a no-op."""
