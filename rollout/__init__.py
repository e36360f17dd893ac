"""The embedded rollout engine (`miles_k3.rollout`): scheduler, memory pools (paged MLA latent cache, KDA
state slots), sampler, group fork and CUDA-graph decode, behind an `sglang.Engine`-shaped API."""
