"""Grouping routed (token, slot) pairs by expert in one launch, and combining the expert outputs back by token in
one more (`combine_rows`, below): pure-torch references and Triton kernels.

`RoutedExperts.forward` (`miles_k3.model.experts`) feeds its grouped matmuls with the M = N*K routed pairs
sorted by expert. Flattening ids [N, K] to ids [M] (pair i is token i // K, slot i % K), the grouping is

    order[j]    = the i of the j-th pair in a stable sort by id   (== torch.argsort(ids, stable=True))
    token_of[j] = order[j] // K                                    (the token whose row goes to row j)
    ends[e]     = #{i : ids[i] <= e}                               (cumulative row ends, int32 [E]: the `offs`
                                                                    of torch._grouped_mm)

so rows ends[e-1] .. ends[e] (ends[-1] = 0) belong to expert e. In torch that is a radix sort, a division and
zeros + index_add_ + cumsum: about seven launches, the sort alone ~28 us per MoE layer on an H200 at decode
sizes. The kernel does it in one launch with one program per expert e: it reads all M ids (blocks of BLOCK),
counting start_e = #(ids < e); then reads them again and gives each pair with id == e its stable rank (a
`tl.cumsum` of the match mask plus the running count of earlier blocks), storing order[start_e + rank] = i and
token_of likewise, and finally ends[e] = start_e + count_e. A pair's position depends only on how many ids
are smaller and how many equal ids precede it: exactly the stable sort, so the result equals the reference bit
for bit.

Cost: O(E * M) compares and E * 2M id loads (from L2 after the first program), e.g. E = 384, M = 4096 (batch
512 x top-k 8): 3 M compares, a few microseconds: fine for decode, wasteful for large prefill/training M, where
torch's sort is the better tool. The engine uses the kernel only in the sync-free decode path (experts
under `sync_free_experts()` with ids on CUDA, i.e. captured decode steps); every other path keeps torch's
argsort.

Ids are expected in [0, E) (router top-k output). An id outside that range is still counted in `ends` exactly
as the definition says, and every in-range pair lands where the stable sort puts it; only the positions the
sort would give the out-of-range pairs are left unwritten by the kernel (`torch.empty` contents). No value
check is made (it would synchronise with the GPU).

Legend: N tokens, K top-k slots per token, M = N * K routed pairs, E experts.
This module imports torch and triton only; launching the kernel needs CUDA (or `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from miles_k3.kernels.fused import _ROUND_KIND, _on_device, _round

ID_DTYPES = (torch.int64, torch.int32)

_MAX_BLOCK = 4096  # ids per loop iteration of a program (decode M <= 4096 is a single block)


def _check_inputs(fn: str, flat_ids_M: torch.Tensor, num_experts: int, top_k: int) -> None:
    """Validate dtype, shape and the integer arguments (no value checks: those would synchronise)."""
    if not isinstance(flat_ids_M, torch.Tensor) or flat_ids_M.dim() != 1 or flat_ids_M.dtype not in ID_DTYPES:
        raise ValueError(f"{fn}: flat_ids_M must be a 1-d torch.int64 (or int32) tensor [M] of expert ids, got "
                         f"{getattr(flat_ids_M, 'dtype', type(flat_ids_M))} of shape "
                         f"{tuple(getattr(flat_ids_M, 'shape', ()))}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{fn}: top_k must be a positive int, got {top_k!r}")
    if flat_ids_M.shape[0] % top_k:
        raise ValueError(f"{fn}: M = {flat_ids_M.shape[0]} routed pairs is not a multiple of top_k = {top_k} "
                         "(flat_ids_M must be ids [N, top_k] flattened)")
    if flat_ids_M.shape[0] >= 2**31:
        raise ValueError(f"{fn}: M = {flat_ids_M.shape[0]} routed pairs do not fit int32 row ends")


def group_by_expert_reference(flat_ids_M: torch.Tensor, num_experts: int,
                              top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition, on any device: (order int64 [M] = torch.argsort(ids, stable=True), token_of int64 [M] =
    order // top_k, ends int32 [E] = #(ids <= e)). Module docstring for the meaning."""
    _check_inputs("group_by_expert_reference", flat_ids_M, num_experts, top_k)
    order_M = torch.argsort(flat_ids_M, stable=True)
    token_of_M = order_M // top_k
    experts_E = torch.arange(num_experts, device=flat_ids_M.device, dtype=flat_ids_M.dtype)
    ends_E = torch.searchsorted(flat_ids_M[order_M], experts_E, right=True).to(torch.int32)
    return order_M, token_of_M, ends_E


@triton.jit
def _group_by_expert_kernel(ids_ptr, order_ptr, token_of_ptr, ends_ptr, row_of_ptr, M, top_k, num_experts,
                            BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, WITH_ROWS: tl.constexpr):
    """Program e: the pairs routed to expert e, in pair order, to rows start_e .. start_e + count_e of the
    grouping; writes ends[e] (and with WITH_ROWS each such pair's row: row_of[order[j]] = j). NUM_BLOCKS * BLOCK
    >= M (a constexpr trip count; the tail is masked)."""
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    # Pass 1: start_e = #(ids < e). Masked lanes read num_experts, which is neither < e nor == e.
    less = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(NUM_BLOCKS):
        i = b * BLOCK + offs
        ids = tl.load(ids_ptr + i, mask=i < M, other=num_experts)
        less += (ids < e).to(tl.int32)
    start = tl.sum(less, axis=0)
    # Pass 2: the stable rank of each pair with id == e, carried across blocks in `seen`.
    seen = start * 0  # an int32 scalar (a loop-carried value must keep one type)
    for b in range(NUM_BLOCKS):
        i = b * BLOCK + offs
        ids = tl.load(ids_ptr + i, mask=i < M, other=num_experts)
        hit = ids == e
        hit_i = hit.to(tl.int32)
        row = start + seen + tl.cumsum(hit_i, axis=0) - 1
        tl.store(order_ptr + row, i.to(tl.int64), mask=hit)
        tl.store(token_of_ptr + row, (i // top_k).to(tl.int64), mask=hit)
        if WITH_ROWS:
            tl.store(row_of_ptr + i, row.to(tl.int64), mask=hit)
        seen += tl.sum(hit_i, axis=0)
    tl.store(ends_ptr + e, start + seen)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_shape(m: int) -> tuple[int, int, int]:
    """(BLOCK, NUM_BLOCKS, num_warps) for M ids. BLOCK is a power of two (one block up to 4096 ids); beyond
    that NUM_BLOCKS is rounded up to a power of two, so few M values compile a new kernel."""
    block = min(_MAX_BLOCK, max(16, triton.next_power_of_2(m)))
    num_blocks = triton.next_power_of_2(triton.cdiv(m, block))
    return block, num_blocks, 4 if block <= 1024 else 8


def group_by_expert(flat_ids_M: torch.Tensor, num_experts: int, top_k: int,
                    with_rows: bool = False) -> tuple[torch.Tensor, ...]:
    """(order int64 [M], token_of int64 [M], ends int32 [E]) in one Triton launch, equal to
    `group_by_expert_reference` (module docstring for the meaning and the cost). `with_rows`: also row_of int64
    [M], the inverse of order (row_of[order[j]] = j: the row of pair i), written by the same launch, for
    `combine_rows`.

    flat_ids_M: expert ids [N, top_k] flattened, int64 (or int32), values in [0, num_experts), on CUDA (any
    device under TRITON_INTERPRET=1). No host synchronisation: capturable in a CUDA graph (after a first call
    has compiled the kernel for this M's launch shape). Outputs are on flat_ids_M's device.
    """
    fn = "group_by_expert"
    _check_inputs(fn, flat_ids_M, num_experts, top_k)
    if not _interpreting() and not flat_ids_M.is_cuda:
        raise ValueError(f"{fn}: flat_ids_M must be a CUDA tensor, got {flat_ids_M.device}; use "
                         "group_by_expert_reference on other devices")
    m = flat_ids_M.shape[0]
    dev = flat_ids_M.device
    order_M = torch.empty(m, dtype=torch.int64, device=dev)
    token_of_M = torch.empty(m, dtype=torch.int64, device=dev)
    row_of_M = torch.empty(m if with_rows else 0, dtype=torch.int64, device=dev)
    extra = (row_of_M,) if with_rows else ()
    if m == 0:
        return order_M, token_of_M, torch.zeros(num_experts, dtype=torch.int32, device=dev), *extra
    ends_E = torch.empty(num_experts, dtype=torch.int32, device=dev)
    ids = flat_ids_M.contiguous()
    block, num_blocks, num_warps = _launch_shape(m)
    args = (ids, order_M, token_of_M, ends_E, row_of_M if with_rows else order_M, m, top_k, num_experts)
    with _on_device(ids):
        _group_by_expert_kernel[(num_experts,)](*args, BLOCK=block, NUM_BLOCKS=num_blocks, WITH_ROWS=with_rows,
                                                num_warps=num_warps)
    return order_M, token_of_M, ends_E, *extra


# ---- combining the expert outputs back by token ------------------------------------------------------------
def combine_rows_reference(y_MD: torch.Tensor, row_of_M: torch.Tensor, w_NK: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """u [N, D] in `dtype`: u[n] = sum_k w[n, k] * y[row_of[n * K + k]], in fp32 (the products, then the sum over k
    in slot order, k = 0 first), rounded once. With row_of the inverse of order this is `experts.combine_slots(y,
    order, w, dtype)` (y's row j is pair order[j]'s output) up to the order of its fp32 sum over k."""
    n_tok, top_k = w_NK.shape
    y_NKD = y_MD[row_of_M].view(n_tok, top_k, y_MD.shape[-1]).float()
    w_NK1 = w_NK.float().unsqueeze(-1)
    acc = y_NKD[:, 0] * w_NK1[:, 0]
    for k in range(1, top_k):
        acc = acc + y_NKD[:, k] * w_NK1[:, k]
    return acc.to(dtype)


@triton.jit
def _combine_rows_kernel(y_ptr, row_of_ptr, w_ptr, out_ptr, D, stride_y, K: tl.constexpr, BLOCK_D: tl.constexpr,
                         ROUND: tl.constexpr):
    """Program (n, d-tile): out[n, tile] = sum over k in order of w[n, k] * y[row_of[n K + k], tile], fp32, rounded
    once to nearest-even in the output dtype (`fused._round`: the interpreter's cast would truncate)."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(K):
        row = tl.load(row_of_ptr + n * K + k)
        w = tl.load(w_ptr + n * K + k).to(tl.float32)
        acc += w * tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * D + cols, _round(acc, ROUND).to(out_ptr.dtype.element_ty), mask=mask)


def combine_rows(y_MD: torch.Tensor, row_of_M: torch.Tensor, w_NK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`combine_rows_reference` in one Triton launch (no host synchronisation: capturable), replacing the torch
    form's index_copy, two casts, a multiply and a sum. y_MD [M, D] (rows of unit stride), row_of_M int64 [M]
    (`group_by_expert(..., with_rows=True)`), w_NK [N, K] fp32 with N * K = M; on CUDA (any device under
    TRITON_INTERPRET=1). The reference's fp32 operations per element in its order (on a GPU a multiply and add may
    contract to one FMA: the last fp32 bit); against `combine_slots`, whose sum over k runs in torch's order, at
    most one ulp of a 16-bit output (tests/kernels/test_moe_routing_kernel.py)."""
    fn = "combine_rows"
    if dtype not in _ROUND_KIND:
        raise ValueError(f"{fn}: dtype must be one of {list(_ROUND_KIND)}, got {dtype}")
    n_tok, top_k = w_NK.shape
    if y_MD.dim() != 2 or y_MD.shape[0] != n_tok * top_k or row_of_M.shape != (n_tok * top_k,):
        raise ValueError(f"{fn}: y_MD must be [N * K, D] and row_of_M [N * K] for w_NK [N, K] = {tuple(w_NK.shape)}, "
                         f"got {tuple(y_MD.shape)} and {tuple(row_of_M.shape)}")
    if not _interpreting() and not y_MD.is_cuda:
        raise ValueError(f"{fn}: y_MD must be a CUDA tensor, got {y_MD.device}; use combine_rows_reference")
    d = y_MD.shape[-1]
    out = torch.empty(n_tok, d, dtype=dtype, device=y_MD.device)
    if out.numel() == 0:
        return out
    y = y_MD if y_MD.stride(-1) == 1 else y_MD.contiguous()
    block = min(1024, triton.next_power_of_2(d))
    args = (y, row_of_M.contiguous(), w_NK.float().contiguous(), out, d, y.stride(0))
    with _on_device(y):
        _combine_rows_kernel[(n_tok, triton.cdiv(d, block))](*args, K=top_k, BLOCK_D=block, ROUND=_ROUND_KIND[dtype],
                                                             num_warps=4)
    return out
