"""Device and precision, chosen once at start and logged with the reason (the same code runs on CPU)."""
import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; `cpu`, `cuda`, `cuda:N` as given (cuda fails without CUDA)."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        reason = "auto: CUDA available" if device.type == "cuda" else "auto: no CUDA device"
    else:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={name} but CUDA is not available here; use device=cpu or device=auto")
        reason = "as configured"
    log.info("device=%s (%s)", device, reason)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` -> bf16 on CUDA (the checkpoint's dtype), fp32 on CPU (bf16 matmuls are slow there)."""
    if name == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        reason = f"auto on {device.type}"
    else:
        dtype, reason = DTYPES[name], "as configured"
    log.info("dtype=%s (%s)", str(dtype).removeprefix("torch."), reason)
    return dtype
