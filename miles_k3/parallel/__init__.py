"""Scale-out over one DeviceMesh, knowing no model: data parallel (`dp`) x tensor parallel (`tp`), with expert
parallelism (`ep`) laid over the dp x tp ranks. `config` (the `parallel:` section and its checks against the world
size), `mesh` (the process groups of a run, from torchrun's environment; `ParallelContext.layout` places a rank
without groups, for planning), `comm` (the autograd-aware collectives a sharded model uses, `VocabShard`), `grads`
(gradient sums and the global norm over the groups each adapter is marked with), `lockstep` (forwards kept in step
across DP replicas), `reduce` (plain-number reductions: totals, verdicts, gathered objects). What a model shards and
how is the model's own plan (`miles_k3.model.parallelize`). Without torchrun (WORLD_SIZE unset) every group is
trivial and every collective is a no-op."""
