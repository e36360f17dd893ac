"""miles_k3: LoRA RL (GRPO family) on a frozen, natively MXFP4 Kimi K3 base with a colocated rollout engine.

The package root holds the model (`miles_k3.model`), and the entry points (`python -m miles_k3.train`,
`python -m miles_k3.model_info`). The engine, trainer, weight sync, evals and kernels live in the top-level
folders `rollout/`, `trainer/`, `weight_sync/`, `evals/`, imported as `miles_k3.<folder>`, and `kernels/`,
imported as `miles_k3.kernels`.
"""

__version__ = "0.1.0"
