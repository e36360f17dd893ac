"""The weight-sync channel (`miles_k3.weight_sync`): versioned, checksummed, all-or-nothing pushes of LoRA
tensors from the trainer into the rollout engine's buffers (local, IPC and torch.distributed transports)."""
