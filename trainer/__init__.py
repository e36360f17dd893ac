"""The trainer (`miles_k3.trainer`): advantages, GRPO-family policy losses, importance-sampling corrections,
optimizer over LoRA parameters, micro-batching, atomic checkpoints and resume, distributed setup."""
