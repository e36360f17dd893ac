"""The weight-sync channel (`miles_k3.weight_sync`): versioned, checksummed, all-or-nothing pushes of LoRA
tensors from the trainer into the rollout engine's buffers.

`channel.open_sender` / `open_receiver` pick the transport from `sync:` (`config.WeightSyncConfig`): `local`
(same process), `ipc` (same host: shared memory / CUDA IPC) or `dist` (torch.distributed). `protocol` defines a
push (manifest, payload, checksums, PushReport), `receiver` the engine side every byte-moving transport shares,
and `sglang` the channel into an SGLang engine (versioned adapter loads checked by log-prob parity).
"""
