"""The weight-sync channel (`miles_k3.weight_sync`): versioned, all-or-nothing pushes of the trainer's LoRA tensors
into the rollout engine after each optimizer step.

`channel.open_sender` builds the native engine's channel from `sync:` (`config.WeightSyncConfig`): `local`, an
in-place copy into the engine in the trainer's process (one transaction across the ranks of a torchrun launch);
`sglang` holds the channels into an SGLang engine (versioned adapter loads, or merged base weights, checked by
log-prob parity); `push` what every push shares (SyncError, PushReport).
"""
