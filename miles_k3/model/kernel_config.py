"""`kernels:` in the train, eval and sft configs: which kernels the K3 model's forward takes, set once when a run
starts (`apply_kernels`, called with the run's device by `launch.build_run`, `eval.eval_engine` and
`sft.train_sft`), which logs each choice with its reason:

    mxfp4 experts: triton (auto: CUDA available; bf16 projections of >= 134,217,728 weights or <= 64 rows, others torch)
    fused kernels: torch references (kernels.reference=true)

The switches themselves are `miles_k3.model.experts` (MXFP4 routed experts) and `miles_k3.model.layers`
(RMSNorm, SiTU-GLU, the AttnRes mix, the router and the KDA decode); their context managers
(`mxfp4_experts_backend`, `reference_kernels`) override the config's choice within a block (tests, benchmarks).
The environment variables that chose them before (REPLACED_ENV) are not read: a run where one is set logs a
warning naming the field that replaced it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from miles_k3.model.experts import MXFP4_BACKENDS, resolve_mxfp4_backend, set_mxfp4_experts_backend
from miles_k3.model.layers import set_reference_kernels

log = logging.getLogger(__name__)

MXFP4_EXPERTS = ("auto", *MXFP4_BACKENDS)
REPLACED_ENV = {"MILES_K3_MXFP4_EXPERTS": "kernels.mxfp4_experts", "MILES_K3_REFERENCE_KERNELS": "kernels.reference"}
"""Environment variables that once chose the kernels, and the config field that does now."""


@dataclass
class KernelsConfig:
    """The kernels of the K3 model's forward (trainer, rollout engine, eval); the defaults pick the fastest that
    is exact enough on the run's device."""

    mxfp4_experts: str = "auto"
    """Matmuls of the frozen MXFP4 routed experts: auto (triton on CUDA with bf16 activations for projections of
    >= 2^27 weights, i.e. real-width K3, and for any projection of <= 64 rows, a small decode step; torch
    elsewhere), torch (dequantize a chunk of experts to bf16, then a
    grouped matmul: the CPU path and the reference) or triton (the fused W4A16 grouped matmul for every
    projection with bf16 activations; needs CUDA)."""
    reference: bool = False
    """Use the pure-torch references instead of the fused Triton kernels (RMSNorm, SiTU-GLU, the AttnRes mix, the
    router, the KDA decode) on every device: a debugging and parity switch (the CPU always runs the references)."""

    def validate(self) -> None:
        if self.mxfp4_experts not in MXFP4_EXPERTS:
            raise ValueError(f"mxfp4_experts: '{self.mxfp4_experts}' is not one of {', '.join(MXFP4_EXPERTS)}")


def apply_kernels(cfg: KernelsConfig, device: torch.device) -> None:
    """Make `cfg` the process's kernel choice and log what it resolves to on `device`, with the reason; warn
    about a set REPLACED_ENV variable (it is ignored)."""
    for env, field in REPLACED_ENV.items():
        if env in os.environ:
            log.warning("%s=%s is set but no longer read: set %s in the config instead (this run uses %s=%s)",
                        env, os.environ[env], field, field, str(getattr(cfg, field.partition(".")[2])).lower())
    set_mxfp4_experts_backend(cfg.mxfp4_experts)
    set_reference_kernels(cfg.reference)
    log.info("mxfp4 experts: %s (%s)", *resolve_mxfp4_backend(device))
    if cfg.reference:
        log.info("fused kernels: torch references (kernels.reference=true)")
    elif device.type == "cuda":
        log.info("fused kernels: triton (RMSNorm, SiTU-GLU and the AttnRes mix, with gradients too; the router and "
                 "the KDA decode step where no gradient is needed) (kernels.reference=false)")
    else:
        log.info("fused kernels: torch references (%s: the fused kernels run on CUDA only)", device.type)
