"""Fused Triton kernels for the eager fp32 elementwise chains of `miles_k3.model.layers`.

Each kernel replaces a chain of ~8-14 small torch kernels (one launch each in the captured decode graph) with one
launch. They compute in fp32 like their references. The first three are forward-only, meant for inference (the
callers in `layers.py` use them only on CUDA when no gradient is needed); `situ_glu_train` is SiTU-GLU for training:
an autograd function whose forward is `situ_glu`'s kernel (bit for bit the inference output) and whose backward is
one more kernel. RMSNorm and the AttnRes mix have their training functions beside this module
(`fused_norm_train.rms_norm_train`, `fused_attn_res_train.attn_res_mix_train`).

| kernel | reference (pure torch, `miles_k3.model.layers`) | launches |
| --- | --- | --- |
| `rms_norm(x, weight, eps, out_dtype=None)` | `_rms_norm_torch` (`RMSNorm.forward`) | 1 |
| `attn_res_mix(sources, norm_weight, proj_weight, eps)` | `_attn_res_mix_torch` (`attn_res_mix`) | 2: stack, mix |
| `situ_glu(gate, up, beta, linear_beta)` | `_situ_glu_torch` (`situ_glu`) | 1 |
| `situ_glu_train(gate, up, beta, linear_beta)` (differentiable) | `_situ_glu_torch` + autograd (`situ_glu` with grad) | 1 forward, 1 backward |

Legend for tensor suffixes: R rows (all leading dims flattened), D hidden size (last dim), N residual sources.
Accepted activation dtypes: torch.float32, torch.bfloat16, torch.float16 (weights may be any of these).

Numerics: fp32 math throughout; results are rounded (to nearest even, like torch) to the activation dtype exactly
where the reference rounds: RMSNorm twice (normed, then normed * weight), the others once at the end. What differs
from torch: reductions run in another order, rsqrt / exp / division use the GPU's fast approximations, x / beta
is x * (1 / beta) (as torch does on CUDA), and the AttnRes score is rsqrt(mean(v^2) + eps) * <q, v> (the
reference scales v first). So fp32 outputs agree to ~1e-6 relative, and 16-bit outputs are within 1 ulp of the
reference (RMSNorm: its `normed` is; tests/kernels/test_fused_kernels.py states the exact criteria).
tanh is built from exp (tl has no tanh in every Triton version): an odd Taylor polynomial for |x| < 0.3, where
(1 - e^-2|x|) / (1 + e^-2|x|) would cancel, and that quotient above (it never overflows: the exponent is <= 0);
sigmoid uses exp(-|x|) likewise. Finite inputs give finite outputs (no NaN) for any magnitude.
SiTU-GLU's backward recomputes the activation from the saved g and u (no fp32 intermediate is kept between forward
and backward) and uses the derivatives by hand, t = tanh(g / beta), s = sigmoid(g), gate = beta * t * s:
d gate / dg = (1 - t^2) * s + gate * (1 - s), d up / du = 1 - tanh^2(u / linear_beta) (1 without linear_beta);
grad_g = grad_out * up * d gate / dg, grad_u = grad_out * gate * d up / du, each rounded once to its input's
dtype. Torch's autograd of the reference evaluates the same terms in another order (its tanh and sigmoid
backwards), so the two differ by fp32 rounding before that last rounding (criteria: the test file).

This module imports torch and triton only; launching a kernel needs CUDA tensors (or `TRITON_INTERPRET=1`, set
before this module is imported, for CPU tensors).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

MAX_BLOCK_D = 8192  # widest row held in registers in one tile (K3's D = 7168 fits); wider rows loop over tiles
_SITU_BLOCK = 1024  # elements per SiTU-GLU program


# ---- validation and launch helpers ---------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_act(fn: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in ACT_DTYPES:
        raise ValueError(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}; "
                         "use the torch reference in miles_k3.model.layers for other dtypes")
    if t.dim() < 1:
        raise ValueError(f"{fn}: {name} must have at least one dim [..., D], got a 0-d tensor")
    if not _interpreting() and not t.is_cuda:
        raise ValueError(f"{fn}: {name} must be a CUDA tensor, got {t.device}; "
                         "use the torch reference in miles_k3.model.layers on other devices")


def _check_weight(fn: str, name: str, w: torch.Tensor, d: int, device: torch.device) -> torch.Tensor:
    """Validate a per-channel weight (`[D]`, or `[1, D]` for a pseudo-query); return it as a contiguous [D]."""
    if not isinstance(w, torch.Tensor) or w.dtype not in ACT_DTYPES:
        raise ValueError(f"{fn}: {name} must be a float32, bfloat16 or float16 tensor, got "
                         f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.numel() != d or w.dim() not in (1, 2):
        raise ValueError(f"{fn}: {name} must have shape [{d}] or [1, {d}] (D = {d}), got {tuple(w.shape)}")
    if w.device != device:
        raise ValueError(f"{fn}: {name} ({w.device}) must be on the input's device ({device})")
    return w.reshape(d).contiguous()


def _check_eps(fn: str, eps: float) -> float:
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"{fn}: eps must be a finite number >= 0, got {eps}")
    return eps


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as a 2-d [R, D] view with unit stride along D (a copy only when no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def _warps(block: int) -> int:
    """Warps for a program that holds `block` fp32 values per row tile: 1 per 256, within [1, 16]."""
    return max(1, min(16, block // 256))


def _on_device(t: torch.Tensor):
    """Launch on t's GPU (multi-GPU hosts); a no-op context for CPU tensors under the interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


_ROUND_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # ROUND constexpr of the kernels


@triton.jit
def _round(x, ROUND: tl.constexpr):
    """fp32 x rounded to nearest-even in the output dtype, returned as fp32 (so the final `.to(odt)` is exact).
    ROUND: 0 fp32 (identity), 1 bf16, 2 fp16. bf16 rounds with integer ops, like torch: the interpreter's
    fp32 -> bf16 cast truncates, and this keeps the GPU and the interpreter bit-identical (NaN stays NaN)."""
    if ROUND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # noqa: PLR0124 (the NaN test)
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


# ---- RMSNorm ------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, eps, BLOCK_D: tl.constexpr, NUM_TILES: tl.constexpr,
                     ROUND: tl.constexpr, OUT_ROUND: tl.constexpr):
    """One program per row: var = mean(x^2) in fp32, y = (x * rsqrt(var + eps)).to(xdt) * w.to(xdt), rounded
    to xdt (ROUND; the product of two 16-bit floats is exact in fp32, so this is xdt's own rounded multiply), then
    to the output's dtype (OUT_ROUND; the same as ROUND unless the caller asks for another output dtype)."""
    odt = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * D
    cols = tl.arange(0, BLOCK_D)
    if NUM_TILES == 1:  # the whole row in registers: one read of x
        mask = cols < D
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = _round(tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32), ROUND)
        y = _round(_round(_round(x * rstd, ROUND) * w, ROUND), OUT_ROUND)
        tl.store(o_row + cols, y.to(odt), mask=mask)
    else:  # wide rows: sum of squares over tiles, then a second pass that normalises
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for t in range(NUM_TILES):
            c = t * BLOCK_D + cols
            x = tl.load(x_row + c, mask=c < D, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / D + eps)
        for t in range(NUM_TILES):
            c = t * BLOCK_D + cols
            mask = c < D
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w = _round(tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32), ROUND)
            y = _round(_round(_round(x * rstd, ROUND) * w, ROUND), OUT_ROUND)
            tl.store(o_row + c, y.to(odt), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out_dtype: torch.dtype | None = None,
             block_d: int | None = None) -> torch.Tensor:
    """Fused RMSNorm: x [..., D] (any leading shape) -> [..., D] in x.dtype (or `out_dtype`), one Triton launch.

    Equals `(normed.to(x.dtype) * weight.to(x.dtype)).to(out_dtype)` with `normed = x32 * rsqrt(mean(x32^2) + eps)`
    (fp32).
    `weight` [D] may be fp32 or 16-bit. Rows need unit stride along D only (strided row views are read in
    place). `block_d` (a power of two) overrides the row tile, for tests of the multi-tile path.
    """
    fn = "rms_norm"
    _check_act(fn, "x", x)
    d = x.shape[-1]
    w = _check_weight(fn, "weight", weight, d, x.device)
    eps = _check_eps(fn, eps)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return _rms_norm_fwd(x, w, eps, out_dtype, block_d)


def _rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype,
                  block_d: int | None) -> torch.Tensor:
    """`rms_norm` on validated inputs (w a contiguous [D]): the forward of both `rms_norm` and
    `fused_norm_train.rms_norm_train`."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = _rows(x)
    block = block_d or min(triton.next_power_of_2(d), MAX_BLOCK_D)
    with _on_device(x):
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, d, x2.stride(0), eps, BLOCK_D=block,
                                         NUM_TILES=triton.cdiv(d, block),
                                         ROUND=_ROUND_KIND[x.dtype], OUT_ROUND=_ROUND_KIND[out_dtype],
                                         num_warps=_warps(block))
    return out


# ---- Block-AttnRes depth mixer ------------------------------------------------------------------------------
@triton.jit
def _attn_res_mix_kernel(v_ptr, nw_ptr, pw_ptr, out_ptr, D, eps, N: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, NUM_TILES: tl.constexpr, ROUND: tl.constexpr):
    """One program per row r of v [R, N, D] (contiguous): pass 1 scores every source,
    s_i = rsqrt(mean(v_i^2) + eps) * <nw * pw, v_i>, into a [BLOCK_N] register vector; softmax over i; pass 2
    writes out[r] = sum_i alpha_i v_i tile by tile (the re-read of v mostly hits L1/L2). N is a compile-time
    constant (one compilation per source count: at most ~10 in k3_m and K3), like the tile count; loops with
    runtime bounds would also break Triton 3.6's interpreter under numpy >= 2.5."""
    odt = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    v_row = v_ptr + row * N * D
    o_row = out_ptr + row * D
    cols = tl.arange(0, BLOCK_D)
    src = tl.arange(0, BLOCK_N)
    scores = tl.full([BLOCK_N], float("-inf"), tl.float32)
    v_i = v_row
    for i in range(N):
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        sq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for t in range(NUM_TILES):
            c = t * BLOCK_D + cols
            mask = c < D
            v = tl.load(v_i + c, mask=mask, other=0.0).to(tl.float32)
            q = (tl.load(nw_ptr + c, mask=mask, other=0.0).to(tl.float32)
                 * tl.load(pw_ptr + c, mask=mask, other=0.0).to(tl.float32))
            dot += q * v
            sq += v * v
        s = tl.sum(dot, axis=0) * tl.math.rsqrt(tl.sum(sq, axis=0) / D + eps)
        scores = tl.where(src == i, s, scores)
        v_i += D
    p = tl.exp(scores - tl.max(scores, axis=0))  # padding lanes: exp(-inf) = 0
    alpha = p / tl.sum(p, axis=0)
    for t in range(NUM_TILES):
        c = t * BLOCK_D + cols
        mask = c < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        v_i = v_row
        for i in range(N):
            a = tl.sum(tl.where(src == i, alpha, 0.0), axis=0)
            acc += a * tl.load(v_i + c, mask=mask, other=0.0).to(tl.float32)
            v_i += D
        tl.store(o_row + c, _round(acc, ROUND).to(odt), mask=mask)


def _check_mix(fn: str, sources, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Validate the mixer's inputs (`attn_res_mix`, `fused_attn_res_train.attn_res_mix_train`), naming `fn`; return
    (norm_weight, proj_weight) as contiguous [D] and eps."""
    if not isinstance(sources, (list, tuple)) or len(sources) == 0:
        raise ValueError(f"{fn}: sources must be a non-empty list of tensors [..., D], got "
                         f"{type(sources).__name__} {'(empty)' if isinstance(sources, (list, tuple)) else ''}")
    for i, s in enumerate(sources):
        _check_act(fn, f"sources[{i}]", s)
    last = sources[-1]
    for i, s in enumerate(sources):
        if s.shape != last.shape or s.device != last.device:
            raise ValueError(f"{fn}: all sources must share one shape and device; sources[{i}] is "
                             f"{tuple(s.shape)} on {s.device}, sources[-1] {tuple(last.shape)} on {last.device}")
    d = last.shape[-1]
    nw = _check_weight(fn, "norm_weight", norm_weight, d, last.device)
    pw = _check_weight(fn, "proj_weight", proj_weight, d, last.device)
    return nw, pw, _check_eps(fn, eps)


def attn_res_mix(sources: list[torch.Tensor] | tuple[torch.Tensor, ...], norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, eps: float, *, block_d: int | None = None) -> torch.Tensor:
    """Fused Block-AttnRes mixer: N sources [..., D] (one shape) -> [..., D] in sources[-1].dtype.

    out = sum_i alpha_i v_i, alpha = softmax_i(<norm_weight * proj_weight[0], v_i * rsqrt(mean(v_i^2) + eps)>),
    all in fp32. The sources are stacked once into [R, N, D] (one copy kernel), then one program per row mixes
    them (one launch). `norm_weight` [D], `proj_weight` [1, D] or [D]. `block_d` overrides the row tile (tests).
    """
    nw, pw, eps = _check_mix("attn_res_mix", sources, norm_weight, proj_weight, eps)
    return _mix_stacked(sources, nw, pw, eps, _mix_block(sources[-1].shape[-1], block_d))[0]


def _mix_block(d: int, block_d: int | None) -> int:
    """The mixer's row tile: `block_d` when given (tests), else the row width's power of two up to MAX_BLOCK_D."""
    return block_d or min(triton.next_power_of_2(d), MAX_BLOCK_D)


def _mix_stacked(sources, nw: torch.Tensor, pw: torch.Tensor, eps: float, block: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, v): the sources stacked once into v [R, N, D] (one copy; dtype promoted like the reference), then one
    program per row mixes them (one launch, none without rows). Inputs validated (`_check_mix`); the forward of
    both `attn_res_mix` and `fused_attn_res_train.attn_res_mix_train`, which keeps v for its backward."""
    last = sources[-1]
    d, n = last.shape[-1], len(sources)
    out = torch.empty(last.shape, dtype=last.dtype, device=last.device)
    v_RND = torch.stack([s.reshape(-1, d) for s in sources], dim=1)
    if out.numel():
        with _on_device(last):
            _attn_res_mix_kernel[(v_RND.shape[0],)](v_RND, nw, pw, out, d, eps, N=n,
                                                    BLOCK_N=triton.next_power_of_2(n), BLOCK_D=block,
                                                    NUM_TILES=triton.cdiv(d, block), ROUND=_ROUND_KIND[last.dtype],
                                                    num_warps=_warps(block))
    return out, v_RND


# ---- SiTU-GLU -----------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh in fp32 from exp: odd Taylor polynomial (through x^9) for |x| < 0.3, else
    sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 0.55]: no overflow, no NaN for finite x."""
    ax = tl.abs(x)
    small = ax < 0.3
    xs = tl.where(small, x, 0.0)  # keeps the powers finite for huge x (the branch is discarded there)
    x2 = xs * xs
    poly = xs + xs * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203)))
    e = tl.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(small, poly, tl.where(x < 0, -t, t))


@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-x)) in fp32, evaluated with exp(-|x|) <= 1 so it never overflows."""
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    return tl.where(x >= 0, r, e * r)


@triton.jit
def _situ_glu_kernel(g_ptr, u_ptr, out_ptr, n, cols, stride_g, stride_u, beta, inv_beta, lin_beta, inv_lin_beta,
                     HAS_LIN: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    """Elementwise over the [n / cols, cols] rows (g and u read with their row strides, out contiguous):
    out = beta*tanh(g/beta)*sigmoid(g) * (lin*tanh(u/lin) | u), fp32, multiplied in the reference's order;
    x / beta is x * (1 / beta), as torch does on CUDA."""
    odt = out_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = offs // cols
    col = offs - row * cols
    g = tl.load(g_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
    h = beta * _tanh(g * inv_beta) * _sigmoid(g)
    if HAS_LIN:
        u = lin_beta * _tanh(u * inv_lin_beta)
    tl.store(out_ptr + offs, _round(h * u, ROUND).to(odt), mask=mask)


@triton.jit
def _situ_glu_bwd_kernel(g_ptr, u_ptr, go_ptr, gg_ptr, gu_ptr, n, beta, inv_beta, lin_beta, inv_lin_beta,
                         HAS_LIN: tl.constexpr, BLOCK: tl.constexpr, ROUND_G: tl.constexpr, ROUND_U: tl.constexpr):
    """Elementwise backward of `_situ_glu_kernel`: reads g, u, grad_out, writes grad_g (g's dtype) and grad_u
    (u's dtype); the activation is recomputed in fp32 exactly as the forward computes it."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(g * inv_beta)
    s = _sigmoid(g)
    h = beta * t * s
    dh = (1.0 - t * t) * s + h * (1.0 - s)  # d/dg beta*tanh(g/beta)*sigmoid(g)
    if HAS_LIN:
        tu = _tanh(u * inv_lin_beta)
        up = lin_beta * tu
        grad_u = go * h * (1.0 - tu * tu)
    else:
        up = u
        grad_u = go * h
    grad_g = go * up * dh
    tl.store(gg_ptr + offs, _round(grad_g, ROUND_G).to(gg_ptr.dtype.element_ty), mask=mask)
    tl.store(gu_ptr + offs, _round(grad_u, ROUND_U).to(gu_ptr.dtype.element_ty), mask=mask)


def _check_situ(fn: str, gate: torch.Tensor, up: torch.Tensor, beta: float,
                linear_beta: float | None) -> tuple[float, float | None]:
    """Validate SiTU-GLU's arguments; (beta, linear_beta) as floats."""
    _check_act(fn, "gate", gate)
    _check_act(fn, "up", up)
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(f"{fn}: gate and up must have one shape and device, got {tuple(gate.shape)} on "
                         f"{gate.device} and {tuple(up.shape)} on {up.device}")
    beta = float(beta)
    if not beta > 0.0:
        raise ValueError(f"{fn}: beta must be > 0, got {beta}")
    if linear_beta is not None:
        linear_beta = float(linear_beta)
        if not linear_beta > 0.0:
            raise ValueError(f"{fn}: linear_beta must be > 0 or None, got {linear_beta}")
    return beta, linear_beta


def _situ_glu_fwd(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The forward launch on validated g and u of one shape (rows with unit stride along the last dim are read in
    place, as views of a wider output are; others are copied): the output in g's dtype and shape, contiguous."""
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    n = out.numel()
    if n == 0:
        return out
    lin = 1.0 if linear_beta is None else linear_beta
    g2, u2 = _rows(g), _rows(u)
    with _on_device(g):
        _situ_glu_kernel[(triton.cdiv(n, _SITU_BLOCK),)](g2, u2, out, n, g2.shape[-1], g2.stride(0), u2.stride(0),
                                                         beta, 1.0 / beta, lin, 1.0 / lin,
                                                         HAS_LIN=linear_beta is not None, BLOCK=_SITU_BLOCK,
                                                         ROUND=_ROUND_KIND[g.dtype], num_warps=4)
    return out


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """Fused SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) * (linear_beta*tanh(u/linear_beta), or u when linear_beta is
    None), fp32 math, returned in gate.dtype with gate's shape. gate and up: one shape (no broadcasting), any
    dtype of ACT_DTYPES each; rows with unit stride along the last dim (such as column slices of one projection's
    output) are read in place, other layouts copied first. One launch. Forward only (no autograd: `situ_glu_train`
    is the differentiable form)."""
    beta, linear_beta = _check_situ("situ_glu", gate, up, beta, linear_beta)
    return _situ_glu_fwd(gate, up, beta, linear_beta)


def situ_glu_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, beta: float,
                      linear_beta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of `situ_glu(gate, up, beta, linear_beta)` for the output gradient `grad_out` (gate's
    shape, any dtype of ACT_DTYPES): fp32 math, returned in gate's and up's dtypes (contiguous, their shape).
    One launch."""
    fn = "situ_glu_backward"
    beta, linear_beta = _check_situ(fn, gate, up, beta, linear_beta)
    _check_act(fn, "grad_out", grad_out)
    if grad_out.shape != gate.shape or grad_out.device != gate.device:
        raise ValueError(f"{fn}: grad_out must have gate's shape and device, got {tuple(grad_out.shape)} on "
                         f"{grad_out.device} for {tuple(gate.shape)} on {gate.device}")
    g, u, go = gate.contiguous(), up.contiguous(), grad_out.contiguous()  # an expanded grad (sum()) is copied
    grad_g = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    grad_u = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    n = g.numel()
    if n == 0:
        return grad_g, grad_u
    lin = 1.0 if linear_beta is None else linear_beta
    with _on_device(g):
        _situ_glu_bwd_kernel[(triton.cdiv(n, _SITU_BLOCK),)](g, u, go, grad_g, grad_u, n, beta, 1.0 / beta, lin,
                                                             1.0 / lin, HAS_LIN=linear_beta is not None,
                                                             BLOCK=_SITU_BLOCK, ROUND_G=_ROUND_KIND[g.dtype],
                                                             ROUND_U=_ROUND_KIND[u.dtype], num_warps=4)
    return grad_g, grad_u


class _SiTUGLUFunction(torch.autograd.Function):
    """SiTU-GLU with the fused kernels both ways; saves only g and u (contiguous), never an fp32 intermediate."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
        g, u = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(g, u)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        return _situ_glu_fwd(g, u, beta, linear_beta)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        g, u = ctx.saved_tensors
        if torch.is_grad_enabled() and (grad_out.requires_grad or g.requires_grad or u.requires_grad):
            raise RuntimeError("situ_glu_train is not twice differentiable (a backward with create_graph=True "
                               "through it); use the torch reference (miles_k3.model.layers.reference_kernels())")
        grad_g, grad_u = situ_glu_backward(g, u, grad_out, ctx.beta, ctx.linear_beta)
        need_g, need_u = ctx.needs_input_grad[:2]
        return (grad_g if need_g else None), (grad_u if need_u else None), None, None


def situ_glu_train(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """Differentiable fused SiTU-GLU (training): the output is `situ_glu(gate, up, beta, linear_beta)`, bit for bit
    (the same kernel), and backward is one launch of `situ_glu_backward`, which recomputes the activation from
    the saved gate and up. Same arguments and refusals as `situ_glu`; gradients come back in gate's and up's dtypes.
    Not twice differentiable: a backward through it with create_graph=True raises."""
    beta, linear_beta = _check_situ("situ_glu_train", gate, up, beta, linear_beta)
    return _SiTUGLUFunction.apply(gate, up, beta, linear_beta)
