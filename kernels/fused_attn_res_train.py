"""The Block-AttnRes depth mixer for training: `attn_res_mix_train`, a differentiable form of
`miles_k3.kernels.fused.attn_res_mix` (the reference is `miles_k3.model.layers._attn_res_mix_torch` + autograd).

| pass | launches |
| --- | --- |
| forward | 2: stack the N sources into v [R, N, D], mix (`fused._attn_res_mix_kernel`, the inference kernel) |
| backward | 2: one Triton kernel (every source's gradient, per-program weight-gradient partials), one `.sum(0)` |
| backward, 16-bit weights | 3: the same, and one cast of both weights' gradients (one each if their dtypes differ) |

(torch's autograd of the reference: 38 launches forward + backward with fp32 weights, 42 with bf16 ones, at N = 5.)
On an H100, N = 8 sources of 4,096 x 7168 bf16: forward + backward 1.3 ms (the backward kernel 0.6 ms, 96 registers,
no spills), torch's reference 14.3 ms.

The forward is `fused.attn_res_mix`'s output bit for bit (the same stacked v, the same kernel and launch settings),
so trainer and engine see the same activations. Saved for backward: v [R, N, D] in the sources' (promoted) dtype and
the two weights; nothing in fp32.

Backward, with q = norm_weight * proj_weight (fp32), per row and source i: r_i = rsqrt(mean(v_i^2) + eps),
k_i = r_i v_i, s_i = <q, k_i>, alpha = softmax_i(s), out = sum_i alpha_i v_i, g = grad_out:
    da_i = <g, v_i>,  ds_i = alpha_i (da_i - sum_j alpha_j da_j),  dk_i = ds_i q,
    grad_v_i = alpha_i g + r_i (dk_i - k_i mean(dk_i * k_i)) = alpha_i g + b_i q - c_i v_i,
        with b_i = ds_i r_i and c_i = b_i r_i s_i / D (mean(dk_i * k_i) = ds_i s_i / D),
    dq = sum over rows and i of ds_i k_i = sum b_i v_i;  grad_norm_weight = dq * proj_weight,
    grad_proj_weight = dq * norm_weight.
The kernel (`_attn_res_mix_bwd_kernel`) runs one program per block of BLOCK_R rows: per row, pass 1 recomputes
r, s (in the forward kernel's order), alpha and da from v and g; pass 2 writes grad_v_i tile by tile (fp32, rounded
once to the sources' dtype) and accumulates b_i v_i into the program's dq. Each program writes its own fp32
partials [2, D] (dq * proj_weight, dq * norm_weight) into a [P, 2, D] buffer that one `.sum(0)` reduces: no atomics,
so the gradients are deterministic (bitwise the same run to run). The source gradients live in one [N, R, D] buffer
(not [R, N, D]): each source's gradient is the contiguous view `grad[i].view(source.shape)`, which autograd hands on
(and a leaf's AccumulateGrad adopts) without a copy. Rows up to MAX_BLOCK_D = 8192 wide keep the row and the
program's dq in registers; wider rows loop over tiles (NUM_TILES) and accumulate dq in the program's own slot of the
partial buffer (read-modify-write by the same program only).

Not twice differentiable: a backward with create_graph=True through it raises.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_k3.kernels.fused import (
    _ROUND_KIND,
    _check_mix,
    _mix_block,
    _mix_stacked,
    _on_device,
    _round,
    _rows,
    _warps,
)

_MAX_ROWS_PER_PROGRAM = 16
_MIN_PROGRAMS = 256  # rows per program grow (powers of two, up to 16) only while at least this many programs remain


@triton.jit
def _q_and_g(nw_ptr, pw_ptr, g_row, c, D, d_row):
    """Columns c of q = norm_weight * proj_weight (fp32; masked at D) and of a row's grad_out (masked at d_row:
    0 for the rows past R)."""
    q = (tl.load(nw_ptr + c, mask=c < D, other=0.0).to(tl.float32)
         * tl.load(pw_ptr + c, mask=c < D, other=0.0).to(tl.float32))
    return q, tl.load(g_row + c, mask=c < d_row, other=0.0).to(tl.float32)


@triton.jit
def _attn_res_mix_bwd_kernel(v_ptr, go_ptr, nw_ptr, pw_ptr, gv_ptr, part_ptr, R, D, stride_go, stride_gv, eps,
                             need_src, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             NUM_TILES: tl.constexpr, BLOCK_R: tl.constexpr, ROUND: tl.constexpr):
    """Program p: rows [p * BLOCK_R, (p + 1) * BLOCK_R) of v [R, N, D] (contiguous) and grad_out (row stride
    stride_go); writes grad_v_i of row r at gv_ptr + i * stride_gv + r * D (the [N, R, D] buffer; only sources with
    bit i of need_src set) and part[p] = (dq_p * pw, dq_p * nw), dq_p this program's sum of b_i v_i."""
    gdt = gv_ptr.dtype.element_ty
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    src = tl.arange(0, BLOCK_N)
    p0 = part_ptr + pid.to(tl.int64) * 2 * D
    p1 = p0 + D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # the program's dq (one tile)
    if NUM_TILES == 1:  # q once per program
        m1 = cols < D
        q1 = (tl.load(nw_ptr + cols, mask=m1, other=0.0).to(tl.float32)
              * tl.load(pw_ptr + cols, mask=m1, other=0.0).to(tl.float32))
    for rr in range(BLOCK_R):
        row = pid * BLOCK_R + rr
        ok = row < R  # the last program's rows past R: loads masked, nothing stored, no dq contribution
        d_row = tl.where(ok, D, 0)  # masks are c < d_row (the interpreter mishandles vector & scalar masks)
        v_row = v_ptr + row.to(tl.int64) * N * D
        g_row = go_ptr + row.to(tl.int64) * stride_go
        if NUM_TILES == 1:  # g once per row
            g1 = tl.load(g_row + cols, mask=cols < d_row, other=0.0).to(tl.float32)
        # pass 1: s_i and r_i exactly as the forward kernel computes them, and da_i = <g, v_i>
        scores = tl.full([BLOCK_N], float("-inf"), tl.float32)
        rs = tl.zeros([BLOCK_N], dtype=tl.float32)
        das = tl.zeros([BLOCK_N], dtype=tl.float32)
        v_i = v_row
        for i in range(N):
            dot = tl.zeros([BLOCK_D], dtype=tl.float32)
            sq = tl.zeros([BLOCK_D], dtype=tl.float32)
            da = tl.zeros([BLOCK_D], dtype=tl.float32)
            for t in range(NUM_TILES):
                c = t * BLOCK_D + cols
                if NUM_TILES == 1:
                    q, g = q1, g1
                else:
                    q, g = _q_and_g(nw_ptr, pw_ptr, g_row, c, D, d_row)
                v = tl.load(v_i + c, mask=c < d_row, other=0.0).to(tl.float32)
                dot += q * v
                sq += v * v
                da += g * v
            r = tl.math.rsqrt(tl.sum(sq, axis=0) / D + eps)
            sel = src == i
            scores = tl.where(sel, tl.sum(dot, axis=0) * r, scores)
            rs = tl.where(sel, r, rs)
            das = tl.where(sel, tl.sum(da, axis=0), das)
            v_i += D
        p = tl.exp(scores - tl.max(scores, axis=0))  # padding lanes: exp(-inf) = 0
        alpha = p / tl.sum(p, axis=0)
        ds = alpha * (das - tl.sum(alpha * das, axis=0))
        bs = tl.where(ok, ds * rs, 0.0)  # b_i = ds_i r_i (0 past R: eps = 0 would make it NaN there)
        cs = bs * rs * tl.where(src < N, scores, 0.0) / D  # c_i = b_i r_i s_i / D (padding lanes: 0)
        # pass 2: grad_v_i = alpha_i g + b_i q - c_i v_i; dq += b_i v_i
        for t in range(NUM_TILES):
            c = t * BLOCK_D + cols
            mask = c < D
            if NUM_TILES == 1:
                q, g = q1, g1
            else:
                q, g = _q_and_g(nw_ptr, pw_ptr, g_row, c, D, d_row)
            contrib = tl.zeros([BLOCK_D], dtype=tl.float32)
            v_i = v_row
            gv_i = gv_ptr + row.to(tl.int64) * D
            for i in range(N):
                sel = src == i
                a_i = tl.sum(tl.where(sel, alpha, 0.0), axis=0)
                b_i = tl.sum(tl.where(sel, bs, 0.0), axis=0)
                c_i = tl.sum(tl.where(sel, cs, 0.0), axis=0)
                v = tl.load(v_i + c, mask=c < d_row, other=0.0).to(tl.float32)
                gv = a_i * g + b_i * q - c_i * v
                d_store = tl.where(((need_src >> i) & 1) != 0, d_row, 0)
                tl.store(gv_i + c, _round(gv, ROUND).to(gdt), mask=c < d_store)
                if NUM_TILES == 1:
                    acc += b_i * v
                else:
                    contrib += b_i * v
                v_i += D
                gv_i += stride_gv
            if NUM_TILES > 1:  # dq in the program's slot p0 (the first row overwrites what was there)
                prev = tl.load(p0 + c, mask=c < tl.where(rr > 0, D, 0), other=0.0)
                tl.store(p0 + c, prev + contrib, mask=mask)
        if NUM_TILES > 1:
            tl.debug_barrier()
    if NUM_TILES == 1:
        tl.store(p0 + cols, acc * tl.load(pw_ptr + cols, mask=m1, other=0.0).to(tl.float32), mask=m1)
        tl.store(p1 + cols, acc * tl.load(nw_ptr + cols, mask=m1, other=0.0).to(tl.float32), mask=m1)
    else:
        for t in range(NUM_TILES):
            c = t * BLOCK_D + cols
            mask = c < D
            dq = tl.load(p0 + c, mask=mask, other=0.0)
            tl.store(p1 + c, dq * tl.load(nw_ptr + c, mask=mask, other=0.0).to(tl.float32), mask=mask)
            tl.store(p0 + c, dq * tl.load(pw_ptr + c, mask=mask, other=0.0).to(tl.float32), mask=mask)


def _rows_per_program(rows: int) -> int:
    """Rows per backward program: a power of two <= 16, as large as keeps >= _MIN_PROGRAMS programs (fewer, larger
    programs mean fewer fp32 partials of dq to write and sum: [P, 2, D])."""
    block = 1
    while block < _MAX_ROWS_PER_PROGRAM and rows // (2 * block) >= _MIN_PROGRAMS:
        block *= 2
    return block


class _AttnResMixFunction(torch.autograd.Function):
    """Inputs (norm_weight, proj_weight, eps, block_d, rows_per_program, *sources), validated by the caller."""

    @staticmethod
    def forward(ctx, norm_weight, proj_weight, eps, block_d, rows_per_program, *sources):
        last = sources[-1]
        d = last.shape[-1]
        block = _mix_block(d, block_d)
        out, v_RND = _mix_stacked(sources, norm_weight.reshape(d).contiguous(), proj_weight.reshape(d).contiguous(),
                                  eps, block)
        ctx.save_for_backward(v_RND, norm_weight, proj_weight)
        ctx.eps, ctx.block, ctx.rows_per_program = eps, block, rows_per_program
        ctx.src_shape, ctx.src_dtypes = last.shape, [s.dtype for s in sources]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: the gradients would have to be differentiable
            raise RuntimeError("attn_res_mix_train is not twice differentiable (a backward with create_graph=True "
                               "through it); use the torch reference (miles_k3.model.layers.reference_kernels())")
        v, norm_weight, proj_weight = ctx.saved_tensors
        rows, n, d = v.shape
        need_nw, need_pw = ctx.needs_input_grad[:2]
        need = ctx.needs_input_grad[5:]
        # every source's slot, even those needing none (never written then); none at all when no source needs one
        grad_v = torch.empty((n, rows, d) if any(need) else (1,), dtype=v.dtype, device=v.device)
        if v.numel() == 0:
            part = torch.zeros((1, 2, d), dtype=torch.float32, device=v.device)
        else:
            go = _rows(grad_out)  # [R, D], unit stride along D (an expanded grad, e.g. of .sum(), is copied)
            block_r = ctx.rows_per_program or _rows_per_program(rows)
            programs = triton.cdiv(rows, block_r)
            part = torch.empty((programs, 2, d), dtype=torch.float32, device=v.device)
            nw, pw = norm_weight.reshape(d).contiguous(), proj_weight.reshape(d).contiguous()
            with _on_device(v):
                _attn_res_mix_bwd_kernel[(programs,)](
                    v, go, nw, pw, grad_v, part, rows, d, go.stride(0), rows * d, ctx.eps,
                    sum(1 << i for i, x in enumerate(need) if x), N=n, BLOCK_N=triton.next_power_of_2(n),
                    BLOCK_D=ctx.block, NUM_TILES=triton.cdiv(d, ctx.block), BLOCK_R=block_r,
                    ROUND=_ROUND_KIND[v.dtype], num_warps=_warps(ctx.block))
        grad_nw = grad_pw = None
        if need_nw or need_pw:
            gw = part.sum(0)  # [2, D] fp32: (grad_norm_weight, grad_proj_weight)
            if norm_weight.dtype == proj_weight.dtype:
                gw = gw.to(norm_weight.dtype)  # one cast for both (none for fp32 weights)
            grad_nw = gw[0].to(norm_weight.dtype).view(norm_weight.shape) if need_nw else None
            grad_pw = gw[1].to(proj_weight.dtype).view(proj_weight.shape) if need_pw else None
        grads = [grad_v[i].view(ctx.src_shape).to(dt) if x else None  # .to: a copy only for mixed-dtype sources
                 for i, (x, dt) in enumerate(zip(need, ctx.src_dtypes))]
        return grad_nw, grad_pw, None, None, None, *grads


def attn_res_mix_train(sources: list[torch.Tensor] | tuple[torch.Tensor, ...], norm_weight: torch.Tensor,
                       proj_weight: torch.Tensor, eps: float, *, block_d: int | None = None,
                       rows_per_program: int | None = None) -> torch.Tensor:
    """Differentiable fused Block-AttnRes mixer (training): the output is `fused.attn_res_mix(sources, norm_weight,
    proj_weight, eps)` bit for bit (two launches: stack, mix), and backward is one kernel plus one `.sum(0)` (and one
    cast for 16-bit weights), see the module docstring. Same arguments and refusals as `fused.attn_res_mix`
    (`sources`: N tensors [..., D] of one shape; `norm_weight` [D]; `proj_weight` [1, D] or [D]); gradients come
    back in each input's dtype and shape, the sources' as contiguous views of one [N, R, D] buffer. `block_d` (a
    power of two) overrides the row tile and `rows_per_program` (a power of two) the rows per backward program
    (tests). Not twice differentiable: a backward through it with create_graph=True raises."""
    _, _, eps = _check_mix("attn_res_mix_train", sources, norm_weight, proj_weight, eps)
    return _AttnResMixFunction.apply(norm_weight, proj_weight, eps, block_d, rows_per_program, *sources)
