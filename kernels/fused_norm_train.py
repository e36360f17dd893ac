"""RMSNorm for training: `rms_norm_train`, an autograd function whose forward is `fused.rms_norm`'s kernel (bit
for bit the inference output, so trainer and engine see the same values) and whose backward is two launches.

| function | reference (`miles_k3.model.layers`) | launches |
| --- | --- | --- |
| `rms_norm_train(x, weight, eps, *, out_dtype=None)` | `_rms_norm_torch` + autograd | 1 forward, 2 backward |
| `rms_norm_backward(x, weight, grad_out, eps)` | its gradients | 2 (1 without grad_weight) |

Backward: `_rms_norm_bwd_kernel` writes grad_x and fp32 partial sums of grad_weight, one row of a [P, D]
buffer per program (a program takes a block of rows; P ~ 2 per SM); `_sum_partials_kernel` sums the P rows in
one fixed order (deterministic: no atomics) and rounds once to the weight's dtype (`.sum(0).to(dtype)` in one
launch: a separate cast would make it three).
Only x (rows of unit stride, a view of the input) and the weight are saved for it: no fp32 intermediate.

Math. Forward: y = round(round(n) * round(w)), then to out_dtype; n = x32 * rstd, rstd = rsqrt(mean(x32^2) +
eps) in fp32; round() is x.dtype's rounding. Backward, per row, in fp32, with g the output gradient,
w = round(weight) and the roundings straight-through (as torch's autograd of the reference treats them):
dn = g * w, grad_x = rstd * (dn - n * proj) with proj = rstd * mean(dn * x) (= mean(dn * n)), rounded once to
x.dtype; grad_weight = the sum over rows of g * round(n) (the value the forward multiplies w by), rounded once to
the weight's dtype. rstd is recomputed as the forward computes it. Torch's autograd of the reference rounds g
(out_dtype fp32), dn and the products g * round(n) to a 16-bit x.dtype on the way; the kernel keeps them in fp32.
Error bounds and measured errors: tests/kernels/test_fused_norm_train.py.

Not twice differentiable: a backward with create_graph=True through it raises. Imports torch and triton only;
launching needs CUDA tensors (or TRITON_INTERPRET=1, set before import, for CPU tensors).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from miles_k3.kernels.fused import (
    _ROUND_KIND,
    ACT_DTYPES,
    MAX_BLOCK_D,
    _check_act,
    _check_eps,
    _check_weight,
    _on_device,
    _rms_norm_fwd,
    _round,
    _rows,
    _warps,
)

_PROGRAMS_PER_SM = 2  # backward programs per SM (each holds a row tile of up to 8192 fp32 values)
_CPU_PROGRAMS = 4  # programs under the interpreter (CPU tensors): few, so the tests reach multi-row programs
_SUM_TILE = 4096  # partials per program of the grad_weight reduction


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, gx_ptr, gw_ptr, R, D, stride_x, stride_g, eps,
                         ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_TILES: tl.constexpr, ROUND: tl.constexpr,
                         HAS_GX: tl.constexpr, HAS_GW: tl.constexpr):
    """Program p takes rows [p * ROWS, (p + 1) * ROWS) of x [R, D]: recomputes rstd as `_rms_norm_kernel` does,
    writes grad_x [R, D] (x's dtype, contiguous; HAS_GX) and the sum over its rows of g * round(n) into row p of
    the fp32 partials gw [P, D] (HAS_GW). Wide rows (NUM_TILES > 1): a pass for sum(x^2) and sum(g * w * x), then
    one that writes, adding into gw's row p in place (only this program touches it; its first row stores)."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    gw_row = gw_ptr + pid * D
    if NUM_TILES == 1:  # the whole row in registers: one read of x and g per row, w read once per program
        mask = cols < D
        w = _round(tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32), ROUND)
        acc_w = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(ROWS):
            row = pid * ROWS + i
            if row < R:
                x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
                n = x * rstd
                if HAS_GX:
                    dn = g * w
                    proj = rstd * (tl.sum(dn * x, axis=0) / D)
                    gx = _round(rstd * (dn - n * proj), ROUND)
                    tl.store(gx_ptr + row * D + cols, gx.to(gx_ptr.dtype.element_ty), mask=mask)
                if HAS_GW:
                    acc_w += g * _round(n, ROUND)
        if HAS_GW:
            tl.store(gw_row + cols, acc_w, mask=mask)
    else:  # wide rows: sums over tiles, then a second pass that writes
        for i in range(ROWS):
            row = pid * ROWS + i
            if row < R:
                x_row = x_ptr + row * stride_x
                g_row = g_ptr + row * stride_g
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                acc_d = tl.zeros([BLOCK_D], dtype=tl.float32)
                for t in range(NUM_TILES):
                    cc = t * BLOCK_D + cols
                    m = cc < D
                    x = tl.load(x_row + cc, mask=m, other=0.0).to(tl.float32)
                    acc += x * x
                    if HAS_GX:
                        g = tl.load(g_row + cc, mask=m, other=0.0).to(tl.float32)
                        w = _round(tl.load(w_ptr + cc, mask=m, other=0.0).to(tl.float32), ROUND)
                        acc_d += g * w * x
                rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / D + eps)
                proj = rstd * (tl.sum(acc_d, axis=0) / D)
                for t in range(NUM_TILES):
                    cc = t * BLOCK_D + cols
                    m = cc < D
                    x = tl.load(x_row + cc, mask=m, other=0.0).to(tl.float32)
                    g = tl.load(g_row + cc, mask=m, other=0.0).to(tl.float32)
                    n = x * rstd
                    if HAS_GX:
                        w = _round(tl.load(w_ptr + cc, mask=m, other=0.0).to(tl.float32), ROUND)
                        gx = _round(rstd * (g * w - n * proj), ROUND)
                        tl.store(gx_ptr + row * D + cc, gx.to(gx_ptr.dtype.element_ty), mask=m)
                    if HAS_GW:
                        prev = tl.load(gw_row + cc, mask=m & (i > 0), other=0.0)
                        tl.store(gw_row + cc, prev + g * _round(n, ROUND), mask=m)


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                         ROUND: tl.constexpr):
    """out[c] = the sum of column c of the fp32 partials [P, D] (P <= BLOCK_P) in one tree order (deterministic),
    rounded once to out's dtype (ROUND): `.sum(0).to(dtype)` in one launch."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, BLOCK_P)
    mask = (rows[:, None] < P) & (cols[None, :] < D)
    s = tl.sum(tl.load(p_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(out_ptr + cols, _round(s, ROUND).to(out_ptr.dtype.element_ty), mask=cols < D)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, eps: float, *,
                      need_x: bool = True, need_weight: bool = True, block_d: int | None = None,
                      block_rows: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_x, grad_weight) of `fused.rms_norm(x, weight, eps)` (any out_dtype) for the output gradient
    `grad_out` (x's shape, any dtype of ACT_DTYPES): fp32 math, grad_x in x's dtype and shape (contiguous),
    grad_weight in weight's dtype and shape; None for what `need_x` / `need_weight` leave out. Two launches (one
    without grad_weight). `block_d` (a power of two) overrides the row tile, `block_rows` the rows per program."""
    fn = "rms_norm_backward"
    _check_act(fn, "x", x)
    d = x.shape[-1]
    w = _check_weight(fn, "weight", weight, d, x.device)
    eps = _check_eps(fn, eps)
    _check_act(fn, "grad_out", grad_out)
    if grad_out.shape != x.shape or grad_out.device != x.device:
        raise ValueError(f"{fn}: grad_out must have x's shape and device, got {tuple(grad_out.shape)} on "
                         f"{grad_out.device} for {tuple(x.shape)} on {x.device}")
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
    if not (need_x or need_weight):
        return None, None
    if x.numel() == 0:
        return grad_x, (torch.zeros_like(weight) if need_weight else None)
    x2, g2 = _rows(x), _rows(grad_out)  # an expanded grad_out (`.sum()`'s) is copied
    r = x2.shape[0]
    if block_rows is None:
        programs = _sm_count(x.device.index or 0) * _PROGRAMS_PER_SM if x.is_cuda else _CPU_PROGRAMS
        block_rows = triton.next_power_of_2(triton.cdiv(r, programs))
    p = triton.cdiv(r, block_rows)
    partial_PD = torch.empty(p, d, dtype=torch.float32, device=x.device) if need_weight else None
    block = block_d or min(triton.next_power_of_2(d), MAX_BLOCK_D)
    with _on_device(x):
        gx = x2 if grad_x is None else grad_x  # (a placeholder when not written)
        gw = w if partial_PD is None else partial_PD
        _rms_norm_bwd_kernel[(p,)](x2, w, g2, gx, gw, r, d, x2.stride(0), g2.stride(0), eps, ROWS=block_rows,
                                   BLOCK_D=block, NUM_TILES=triton.cdiv(d, block), ROUND=_ROUND_KIND[x.dtype],
                                   HAS_GX=need_x, HAS_GW=need_weight, num_warps=_warps(block))
        if not need_weight:
            return grad_x, None
        grad_w = torch.empty(d, dtype=weight.dtype, device=x.device)
        block_p = triton.next_power_of_2(p)
        block_c = max(1, _SUM_TILE // block_p)
        _sum_partials_kernel[(triton.cdiv(d, block_c),)](partial_PD, grad_w, p, d, BLOCK_P=block_p,
                                                         BLOCK_C=block_c, ROUND=_ROUND_KIND[weight.dtype],
                                                         num_warps=4)
    return grad_x, grad_w.reshape(weight.shape)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with the fused kernels both ways; saves x (rows of unit stride) and the weight, nothing in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None,
                block_d: int | None, block_rows: int | None) -> torch.Tensor:
        x2 = _rows(x) if x.numel() else x  # what the kernels read (a copy only for rows without unit stride)
        ctx.save_for_backward(x2, weight)
        ctx.shape, ctx.eps, ctx.block_d, ctx.block_rows = x.shape, eps, block_d, block_rows
        return _rms_norm_fwd(x2, weight.reshape(-1).contiguous(), eps, out_dtype or x.dtype, block_d).view(x.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the gradients would have to be differentiable
            raise RuntimeError("rms_norm_train is not twice differentiable (a backward with create_graph=True "
                               "through it); use the torch reference (miles_k3.model.layers.reference_kernels())")
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x, grad_w = rms_norm_backward(x2, weight, grad_out.reshape(x2.shape), ctx.eps, need_x=need_x,
                                           need_weight=need_w, block_d=ctx.block_d, block_rows=ctx.block_rows)
        return (None if grad_x is None else grad_x.view(ctx.shape)), grad_w, None, None, None, None


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out_dtype: torch.dtype | None = None,
                   block_d: int | None = None, block_rows: int | None = None) -> torch.Tensor:
    """Differentiable fused RMSNorm (training): the output is `fused.rms_norm(x, weight, eps,
    out_dtype=out_dtype)`, bit for bit (the same kernel), and backward is `rms_norm_backward` (two launches), which
    recomputes rstd from the saved x. Same arguments and refusals as `fused.rms_norm`; gradients come back in x's
    and weight's dtypes and shapes. `block_d` / `block_rows`: the row tile / rows per backward program (tests).
    Not twice differentiable: a backward through it with create_graph=True raises."""
    fn = "rms_norm_train"
    _check_act(fn, "x", x)
    _check_weight(fn, "weight", weight, x.shape[-1], x.device)
    eps = _check_eps(fn, eps)
    if out_dtype is not None and out_dtype not in ACT_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return _RMSNormFunction.apply(x, weight, eps, out_dtype, block_d, block_rows)
