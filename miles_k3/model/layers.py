"""Small K3 building blocks: RMSNorm, the SiTU activation and its GLU MLP, and the Block-AttnRes depth mixer.

Legend for tensor suffixes: B batch, T tokens, D hidden size, N number of residual sources, I MLP width.
Precision rules (K3 reference): RMSNorm variances, SiTU nonlinearities and AttnRes mixing run in fp32; results
are cast back to the activation dtype.

Fused kernels: on CUDA, when no gradient is needed (`torch.no_grad()`/`inference_mode()`, or no input requires
grad), `RMSNorm.forward`, `situ_glu` and `attn_res_mix` run one fused Triton kernel each
(`miles_k3.kernels.fused`, forward only) instead of their eager fp32 chains. When autograd is needed they run
differentiable fused functions whose forward is the same kernel (so the same values bit for bit) and whose backward
is one fused kernel (plus one sum over rows for the weights' gradients): `fused.situ_glu_train`,
`fused_norm_train.rms_norm_train`, `fused_attn_res_train.attn_res_mix_train`. Every CPU call keeps the
differentiable pure-torch references `_rms_norm_torch`, `_situ_glu_torch` and `_attn_res_mix_torch`. The same
switch (`use_fused_kernels`) gates the router's and the KDA decode's kernels (`moe`, `kda`).
`kernels.reference=true` forces the references everywhere, training included, for a whole run (set once at
startup: `set_reference_kernels`, called by `miles_k3.model.kernel_config.apply_kernels`); tests force them within a
block: `with reference_kernels():`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from miles_k3.parallel.comm import copy_to, reduce_from

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # = miles_k3.kernels.fused.ACT_DTYPES
_force_reference = False  # kernels.reference (`set_reference_kernels`), or a `reference_kernels()` block's


def set_reference_kernels(enabled: bool) -> None:
    """Make the pure-torch references the process's choice (`enabled`) or allow the fused kernels again:
    kernels.reference, set once at startup (`miles_k3.model.kernel_config.apply_kernels`). A `reference_kernels()`
    block overrides it."""
    global _force_reference
    _force_reference = bool(enabled)


@contextlib.contextmanager
def reference_kernels(enabled: bool = True) -> Iterator[None]:
    """Inside the block, RMSNorm / situ_glu / attn_res_mix use their pure-torch references on every device
    (`enabled=False`: allow the fused kernels again). Restores the previous setting on exit; not thread-local."""
    global _force_reference
    prev, _force_reference = _force_reference, bool(enabled)
    try:
        yield
    finally:
        _force_reference = prev


def fused_kernels_active() -> bool:
    """False while kernels.reference (`set_reference_kernels`) or a `reference_kernels()` block forces the torch
    references."""
    return not _force_reference


def _fused_eligible(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """x on CUDA, supported dtypes, the fused kernels not forced off (autograd aside)."""
    if not x.is_cuda or _force_reference or x.dtype not in _FUSED_DTYPES:
        return False
    return all(t.dtype in _FUSED_DTYPES for t in tensors)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def use_fused_kernels(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Take the fused Triton path: x on CUDA, supported dtypes, no autograd needed, not forced off."""
    return _fused_eligible(x, *tensors) and not _needs_grad(x, *tensors)


def to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, skipped when t already has that dtype (Tensor.to would return t itself, after a trip through
    the dispatcher: host time on every forward, e.g. an fp32 parameter's `.float()` in a bf16 model)."""
    return t if t.dtype == dtype else t.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 variance; the weight multiplies after casting back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Normalised x in x.dtype, then rounded once to `out_dtype` when given (an fp32 residual stream read by
        bf16 sublayers: `model.fp32_residual`)."""
        if _fused_eligible(x, self.weight):
            if _needs_grad(x, self.weight):
                from miles_k3.kernels import fused_norm_train
                return fused_norm_train.rms_norm_train(x, self.weight, self.eps, out_dtype=out_dtype)
            from miles_k3.kernels import fused
            return fused.rms_norm(x, self.weight, self.eps, out_dtype=out_dtype)
        return _rms_norm_torch(x, self.weight, self.eps, out_dtype)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
                    ) -> torch.Tensor:
    """Reference RMSNorm: fp32 variance; `normed.to(x.dtype) * weight.to(x.dtype)`, then `.to(out_dtype)`."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = normed.to(x.dtype) * weight.to(x.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def situ_gate(g: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU gate branch, fp32: beta * tanh(g / beta) * sigmoid(g). Soft-capped SiLU, range (-0.27, beta)."""
    g = g.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def situ_up(u: torch.Tensor, linear_beta: float | None) -> torch.Tensor:
    """SiTU up branch, fp32: linear_beta * tanh(u / linear_beta); identity when linear_beta is None."""
    u = u.float()
    return u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU(g, u) = situ_gate(g) * situ_up(u), computed in fp32 and returned in gate's dtype.

    On CUDA (not forced to the references): `fused.situ_glu` when no gradient is needed, else
    `fused.situ_glu_train`, whose forward is the same kernel (the same values, bit for bit) and whose backward is
    one fused kernel; otherwise the torch reference `_situ_glu_torch`."""
    if _fused_eligible(gate, up) and gate.shape == up.shape:
        from miles_k3.kernels import fused
        if _needs_grad(gate, up):
            return fused.situ_glu_train(gate, up, beta, linear_beta)
        return fused.situ_glu(gate, up, beta, linear_beta)
    return _situ_glu_torch(gate, up, beta, linear_beta)


def _situ_glu_torch(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """Reference SiTU-GLU (pure torch, differentiable)."""
    return (situ_gate(gate, beta) * situ_up(up, linear_beta)).to(gate.dtype)


class SiTUMLP(nn.Module):
    """Gated MLP `down(SiTU-GLU(gate(x), up(x)))`: the dense layer 0 (`mlp`) and the shared experts.

    Under tensor parallelism (`tp_group` set by `miles_k3.model.parallelize`) gate/up hold this rank's
    rows of the width I and down its columns: x enters through `copy_to`, the partial outputs are summed by
    `reduce_from`, so the output is the whole MLP's on every rank."""

    def __init__(self, hidden: int, inter: int, beta: float, linear_beta: float | None):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.tp_group = None
        """The tensor-parallel group the width is split over (None: the whole width here)."""
        self.fused_projections = None
        """The rollout engine's `FusedProjections` over gate and up (None: each linear on its own); read in decode
        steps (one token per request, x [B, 1, D])."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        group = self.fused_projections
        if group is not None and group.serves(x_BTD):
            return self.down(*group(x_BTD))  # gate and up in one GEMM (+ 2 for adapters)
        x_BTD = copy_to(x_BTD, self.tp_group)
        return self.down(self.gate_proj(x_BTD), self.up_proj(x_BTD))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """down_proj(SiTU-GLU(gate, up)) of the gate and up projections' outputs (summed over TP)."""
        return reduce_from(self.down_proj(situ_glu(gate, up, self.beta, self.linear_beta)), self.tp_group)


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Block-AttnRes depth mixer over residual sources (completed blocks + the current partial sum).

    k_i = v_i / sqrt(mean(v_i^2) + eps); score_i = <norm.weight * proj.weight, k_i>; alpha = softmax_i(score);
    out = sum_i alpha_i v_i. All in fp32; returns the input dtype. `sources`: N tensors [..., D];
    `proj.weight` is the pseudo-query [1, D] and `norm.weight` the RMS weight gamma [D].
    """
    tensors = (*sources[:-1], norm.weight, proj.weight)
    if _fused_eligible(sources[-1], *tensors):
        if _needs_grad(sources[-1], *tensors):
            from miles_k3.kernels import fused_attn_res_train
            return fused_attn_res_train.attn_res_mix_train(sources, norm.weight, proj.weight, norm.eps)
        from miles_k3.kernels import fused
        return fused.attn_res_mix(sources, norm.weight, proj.weight, norm.eps)
    return _attn_res_mix_torch(sources, norm.weight, proj.weight, norm.eps)


def _attn_res_mix_torch(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """Reference Block-AttnRes mixer (pure torch, differentiable); `proj_weight` [1, D], `norm_weight` [D]."""
    v_NBTD = torch.stack(sources).float()
    query_D = (norm_weight.float() * proj_weight.float()[0])
    k_NBTD = v_NBTD * torch.rsqrt(v_NBTD.pow(2).mean(-1, keepdim=True) + eps)
    alpha_NBT = torch.softmax(k_NBTD @ query_D, dim=0)
    return (alpha_NBT.unsqueeze(-1) * v_NBTD).sum(0).to(sources[-1].dtype)
