"""Grouping routed pairs by expert (`miles_k3.kernels.moe_routing`): the one-launch Triton kernel against its
argsort-based reference, exactly.

CPU: the reference against argsort / bincount semantics; the kernel under the Triton interpreter in one
subprocess (TRITON_INTERPRET=1 must be set before the kernel's module is imported): blocks that do not divide
M, several blocks (carried ranks), empty experts (first, last, middle), one expert taking everything, M = 1,
E = 384 with M = 4096, real top-k ids and arbitrary ones; and `RoutedExperts` taking the kernel path under
`sync_free_experts()` gives bitwise the torch path. Off CUDA the experts never call the kernel.
GPU (`python -m pytest -m gpu tests/kernels/test_moe_routing_kernel.py`): decode shapes (M = 1*8 .. 512*8, E = 64 and
384) exactly, the kernel in a captured CUDA graph, and `RoutedExperts` (mxfp4 and bf16) under
`sync_free_experts()` against the same module without it, and captured in a graph.
"""
from __future__ import annotations

import os

import pytest
import torch
from kernel_testing import assert_ulps16, capture, interpreted

import miles_k3.model.experts as experts_mod
from miles_k3.kernels.moe_routing import group_by_expert, group_by_expert_reference
from miles_k3.model.experts import RoutedExperts, sync_free_experts

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton routing kernel)")


def _topk_ids(n_tok: int, num_experts: int, top_k: int, seed: int, skip=()) -> torch.Tensor:
    """Router-like ids [n_tok, top_k]: distinct experts per token (unsorted top-k), never an expert in `skip`."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n_tok, num_experts, generator=g)
    if skip:
        scores[:, list(skip)] = -1.0
    return scores.topk(top_k, dim=-1, sorted=False).indices


# ---- CPU: the reference ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["topk", "arbitrary", "one_expert", "m1", "int32"])
def test_reference_is_stable_argsort_and_bincount(case):
    num_experts, top_k = 10, 4
    if case == "topk":
        ids = _topk_ids(33, num_experts, top_k, seed=0, skip=(0, 4, 9)).reshape(-1)
    elif case == "arbitrary":
        ids = torch.randint(0, num_experts, (200,), generator=torch.Generator().manual_seed(1))
    elif case == "one_expert":
        ids = torch.full((40,), 7)
    elif case == "m1":
        ids, top_k = torch.tensor([3]), 1
    else:
        ids = torch.randint(0, num_experts, (64,), generator=torch.Generator().manual_seed(2)).int()
    order, token_of, ends = group_by_expert_reference(ids, num_experts, top_k)
    assert order.dtype == token_of.dtype == torch.int64 and ends.dtype == torch.int32
    assert order.shape == token_of.shape == ids.shape and ends.shape == (num_experts,)
    assert torch.equal(order, torch.argsort(ids, stable=True)) and torch.equal(token_of, order // top_k)
    counts = torch.bincount(ids.long(), minlength=num_experts)
    assert torch.equal(ends, counts.cumsum(0).int())
    # the grouping it defines: rows ends[e-1]..ends[e] are expert e's pairs, in pair order
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).tolist()
    for e in range(num_experts):
        rows = order[starts[e]:ends[e]]
        assert bool((ids[rows] == e).all()) and bool((rows.diff() > 0).all())


def test_input_validation():
    ids = torch.zeros(8, dtype=torch.int64)
    for fn in (group_by_expert, group_by_expert_reference):
        with pytest.raises(ValueError, match="flat_ids_M must be a 1-d"):
            fn(ids.view(4, 2), 4, 2)
        with pytest.raises(ValueError, match="flat_ids_M must be a 1-d"):
            fn(ids.float(), 4, 2)
        with pytest.raises(ValueError, match="num_experts must be a positive int"):
            fn(ids, 0, 2)
        with pytest.raises(ValueError, match="top_k must be a positive int"):
            fn(ids, 4, 0)
        with pytest.raises(ValueError, match="not a multiple of top_k = 3"):
            fn(ids, 4, 3)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError, match="must be a CUDA tensor"):
            group_by_expert(ids, 4, 2)


def test_cpu_experts_keep_the_torch_path(monkeypatch):
    """Off CUDA `RoutedExperts` never calls the kernel, with or without sync_free_experts()."""
    import miles_k3.kernels.moe_routing as mr

    def boom(*args, **kwargs):
        raise AssertionError("routing kernel called on CPU")

    monkeypatch.setattr(mr, "group_by_expert", boom)
    torch.manual_seed(0)
    m = RoutedExperts(6, 64, 32, 4.0, 25.0, expert_format="mxfp4")
    m.reset_parameters(std=0.5)
    ids, z = _topk_ids(9, 6, 2, seed=3), torch.randn(9, 64)
    w = torch.rand(9, 2)
    out = m(z, ids, w)
    with sync_free_experts():
        assert torch.equal(m(z, ids, w), out)


# ---- CPU: the kernel under the Triton interpreter -------------------------------------------------------------
_INTERPRETER_SCRIPT = r'''
import torch

import miles_k3.kernels.moe_routing as mr
import miles_k3.model.experts as experts_mod
from miles_k3.model.experts import RoutedExperts, sync_free_experts

torch.set_num_threads(1)  # idle OpenMP workers spinning beside the interpreter slow CPU matmuls ~20x


def topk_ids(n_tok, num_experts, top_k, seed, skip=()):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n_tok, num_experts, generator=g)
    if skip:
        scores[:, list(skip)] = -1.0
    return scores.topk(top_k, dim=-1, sorted=False).indices.reshape(-1)


def arbitrary(m, num_experts, seed, lo=0, hi=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, num_experts if hi is None else hi, (m,), generator=g)


def check(name, ids, num_experts, top_k):
    got = mr.group_by_expert(ids, num_experts, top_k)
    ref = mr.group_by_expert_reference(ids, num_experts, top_k)
    for what, a, b in zip(("order", "token_of", "ends"), got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, what, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (name, what, a.tolist()[:64], b.tolist()[:64])
    # with_rows: the same three, and row_of the inverse of order (row_of[order[j]] = j)
    *same, row_of = mr.group_by_expert(ids, num_experts, top_k, with_rows=True)
    assert all(torch.equal(a, b) for a, b in zip(same, ref)), name
    inverse = torch.empty_like(ref[0]).scatter_(0, ref[0], torch.arange(ref[0].numel()))
    assert row_of.dtype == torch.int64 and torch.equal(row_of, inverse), (name, row_of.tolist()[:64])


E8 = 8
check("m1", torch.tensor([5]), E8, 1)
check("m1-expert0", torch.tensor([0]), E8, 1)
check("m37-not-a-block-multiple", arbitrary(37, E8, 1), E8, 1)
check("topk-empty-first-middle-last", topk_ids(25, E8, 3, 2, skip=(0, 3, 7)), E8, 3)
used = torch.tensor([1, 2, 4, 5, 6])  # experts 0 (first), 3 (middle) and 7 (last) get nothing
check("arbitrary-empty-first-middle-last", used[arbitrary(120, len(used), 3)], E8, 4)
check("all-on-one-expert", torch.full((48,), 5), E8, 8)
check("all-on-expert-0", torch.zeros(16, dtype=torch.int64), E8, 2)
check("all-on-last-expert", torch.full((16,), E8 - 1), E8, 2)
check("one-expert-of-one", torch.zeros(12, dtype=torch.int64), 1, 4)
check("int32-ids", arbitrary(99, E8, 5).int(), E8, 3)
check("strided-ids", topk_ids(40, 16, 4, 6)[::2], 16, 2)  # a non-contiguous view
check("decode-E384-M4096-topk", topk_ids(512, 384, 8, 7), 384, 8)
check("two-blocks-M5000", topk_ids(625, 16, 8, 8, skip=(0, 15)), 16, 8)
check("masked-blocks-M9000", arbitrary(9000, 7, 9), 7, 3)  # 3 blocks of 4096 rounded up to 4
mr._MAX_BLOCK = 64  # many blocks: ranks carried across up to 10 blocks (launched as 4..16), tails masked
check("blocks64-arbitrary", arbitrary(600, 5, 10), 5, 8)
check("blocks64-topk", topk_ids(70, 12, 4, 11, skip=(2,)), 12, 4)
check("blocks64-one-expert", torch.full((130,), 3), 5, 2)
mr._MAX_BLOCK = 4096

# M = 0: empty grouping, all ends 0
o, t, e = mr.group_by_expert(torch.zeros(0, dtype=torch.int64), 5, 2)
assert o.shape == t.shape == (0,) and torch.equal(e, torch.zeros(5, dtype=torch.int32))

# Out-of-range ids (not produced by a router): ends follow the definition exactly, every in-range pair lands
# where the stable sort puts it; only the sort's positions of out-of-range pairs are left unwritten.
ids = arbitrary(300, 9, 12, lo=-2)  # -2 .. 8 with 7 experts
o, t, e = mr.group_by_expert(ids, 7, 3)
ro, rt, re = mr.group_by_expert_reference(ids, 7, 3)
valid = (ids[ro] >= 0) & (ids[ro] < 7)
assert torch.equal(e, re) and torch.equal(o[valid], ro[valid]) and torch.equal(t[valid], rt[valid])

# combine_rows: hand-worked (2 tokens, top-2, D = 2): y rows 0..3 are pairs order = [2, 0, 3, 1], so row_of =
# [1, 3, 0, 2]; token 0 = 0.5 * y[1] + 0.25 * y[3] = [1.5, 2.5]; token 1 = 2 * y[0] - 1 * y[2] = [-3, -2]
y_hand = torch.tensor([[1.0, 2.0], [2.0, 3.0], [5.0, 6.0], [2.0, 4.0]])
w_hand = torch.tensor([[0.5, 0.25], [2.0, -1.0]])
got = mr.combine_rows(y_hand, torch.tensor([1, 3, 0, 2]), w_hand, torch.float32)
assert got.tolist() == [[1.5, 2.5], [-3.0, -2.0]], got.tolist()
# against the reference (its fp32 sums in slot order: bitwise, the interpreter does not contract to FMA) and
# combine_slots (the torch form the engine used; its sum over k in torch's order: 1 ulp of bf16, 1e-6 in fp32):
# bf16 and fp32 outputs, D not a power of two, D over one tile
from miles_k3.model.experts import combine_slots
from kernel_testing import assert_ulps16
for n_tok, top_k, d, dt, seed in ((7, 4, 96, torch.bfloat16, 20), (3, 8, 1500, torch.float32, 21),
                                  (1, 1, 5, torch.bfloat16, 22)):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_tok * top_k, generator=g)
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    y = (torch.randn(n_tok * top_k, d, generator=g) * 3).to(dt)
    w = torch.rand(n_tok, top_k, generator=g)
    got = mr.combine_rows(y, row_of, w, dt)
    assert got.dtype == dt and torch.equal(got, mr.combine_rows_reference(y, row_of, w, dt)), (n_tok, top_k, d)
    if dt == torch.float32:
        torch.testing.assert_close(got, combine_slots(y, order, w, dt), rtol=1e-6, atol=1e-6)
    else:
        assert_ulps16(got, combine_slots(y, order, w, dt), 1, what=f"combine_rows {n_tok}x{top_k}x{d}")
    wide = torch.full((n_tok * top_k, d + 3), float("nan"), dtype=dt)
    wide[:, :d] = y  # y as rows of a wider tensor (row stride d + 3): read in place
    assert torch.equal(mr.combine_rows(wide[:, :d], row_of, w, dt), got)

# RoutedExperts on the kernel path (forced on CPU) under sync_free_experts() == the torch path, bit for bit.
calls = []
real = mr.group_by_expert
mr.group_by_expert = lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
torch.manual_seed(0)
for fmt in ("mxfp4", "bf16"):
    m = RoutedExperts(12, 64, 32, 4.0, 25.0, expert_format=fmt)
    m.reset_parameters(std=0.5)
    ids_NK = topk_ids(21, 12, 4, 13, skip=(0, 5, 11)).view(21, 4)
    z, w = torch.randn(21, 64), torch.rand(21, 4)
    with sync_free_experts():
        expected = m(z, ids_NK, w)  # argsort + index_add + cumsum
        use_kernel = experts_mod._use_routing_kernel
        experts_mod._use_routing_kernel = lambda ids: experts_mod._SYNC_FREE  # as if on CUDA
        got = m(z, ids_NK, w)
        experts_mod._use_routing_kernel = use_kernel
    assert torch.equal(got, expected) and torch.equal(expected, m(z, ids_NK, w)), fmt
assert calls == [84, 84], calls
print("ok")
'''


@pytest.mark.slow
def test_kernel_equals_reference_under_interpreter():
    assert interpreted(_INTERPRETER_SCRIPT, timeout=300).strip().endswith("ok")


# ---- GPU ------------------------------------------------------------------------------------------------------
def _assert_same_grouping(got, ids, num_experts, top_k):
    ref = group_by_expert_reference(ids, num_experts, top_k)  # argsort on the same GPU
    ref_cpu = group_by_expert_reference(ids.cpu(), num_experts, top_k)
    for what, a, b, c in zip(("order", "token_of", "ends"), got, ref, ref_cpu):
        assert a.is_cuda and a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{what}: {int((a != b).sum())} of {a.numel()} differ from the reference"
        assert torch.equal(a.cpu(), c), what
    # and the cumulative ends the torch sync-free path builds (index_add + cumsum)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    ones = torch.ones_like(ids, dtype=torch.int32)
    assert torch.equal(got[2], counts.index_add_(0, ids.long(), ones).cumsum(0, dtype=torch.int32))


@gpu
@needs_cuda
@pytest.mark.parametrize("num_experts", [64, 384])
@pytest.mark.parametrize("n_tok,top_k", [(1, 8), (2, 8), (4, 1), (4, 8), (16, 8), (64, 8), (128, 8), (256, 8),
                                         (512, 8), (512, 4), (300, 8)])
def test_gpu_decode_shapes_equal_reference(num_experts, n_tok, top_k):
    seed = n_tok * 1000 + top_k + num_experts
    cases = {
        "topk": _topk_ids(n_tok, num_experts, top_k, seed).reshape(-1),
        "topk-empty-ends": _topk_ids(n_tok, num_experts, top_k, seed + 1, skip=(0, num_experts // 2,
                                                                                  num_experts - 1)).reshape(-1),
        "arbitrary": torch.randint(0, num_experts, (n_tok * top_k,),
                                   generator=torch.Generator().manual_seed(seed + 2)),
        "hot-expert": torch.full((n_tok * top_k,), num_experts - 3),
    }
    for name, ids in cases.items():
        ids = ids.cuda()
        got = group_by_expert(ids, num_experts, top_k)
        torch.cuda.synchronize()
        try:
            _assert_same_grouping(got, ids, num_experts, top_k)
        except AssertionError as err:
            raise AssertionError(f"case {name}: {err}") from err


@gpu
@needs_cuda
@pytest.mark.parametrize("m,max_block", [(5000, 4096), (9000, 4096), (20000, 4096), (1000, 64), (4096, 256)])
def test_gpu_several_blocks_equal_reference(monkeypatch, m, max_block):
    """Beyond one block (prefill-sized M, or a small block forced): ranks carried across blocks."""
    import miles_k3.kernels.moe_routing as mr

    monkeypatch.setattr(mr, "_MAX_BLOCK", max_block)
    for num_experts in (7, 384):
        ids = torch.randint(0, num_experts, (m,), generator=torch.Generator().manual_seed(m + num_experts)).cuda()
        _assert_same_grouping(group_by_expert(ids, num_experts, 4), ids, num_experts, 4)
        ids32 = ids.int()
        _assert_same_grouping(group_by_expert(ids32, num_experts, 4), ids32, num_experts, 4)


@gpu
@needs_cuda
def test_gpu_kernel_replays_in_a_cuda_graph():
    num_experts, n_tok, top_k = 384, 512, 8
    static_ids = _topk_ids(n_tok, num_experts, top_k, seed=0).reshape(-1).cuda()
    graph, outs = capture(lambda: group_by_expert(static_ids, num_experts, top_k))
    for seed in (1, 2, 3):
        new = _topk_ids(n_tok, num_experts, top_k, seed=seed, skip=(seed, 100 + seed)).reshape(-1)
        static_ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_grouping(outs, static_ids, num_experts, top_k)
    static_ids.fill_(7)  # everything on one expert
    graph.replay()
    torch.cuda.synchronize()
    _assert_same_grouping(outs, static_ids, num_experts, top_k)


def _cuda_experts(fmt: str, num_experts: int, latent: int = 256, inter: int = 128) -> RoutedExperts:
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = RoutedExperts(num_experts, latent, inter, 4.0, 25.0, expert_format=fmt)
        m.reset_parameters(std=0.05)
    return m.bfloat16().requires_grad_(False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("num_experts,n_tok,top_k", [(16, 512, 4), (64, 64, 8), (384, 512, 8), (384, 1, 8)])
def test_gpu_routed_experts_sync_free_equal_the_plain_forward(monkeypatch, fmt, num_experts, n_tok, top_k):
    """Under sync_free_experts() on CUDA the experts take the kernel path (one call per forward); the output
    is bitwise the sync-free torch grouping's (same order and ends, then the same kernels) and, against the
    plain forward (host counts, chunked dequant), within the grouped_mm tolerance of tests/model/test_gpu_experts.py."""
    import miles_k3.kernels.moe_routing as mr

    m = _cuda_experts(fmt, num_experts)
    g = torch.Generator().manual_seed(n_tok + num_experts)
    ids = _topk_ids(n_tok, num_experts, top_k, seed=n_tok, skip=(5,)).cuda()
    w = torch.rand(n_tok, top_k, generator=g)
    w = (w / w.sum(-1, keepdim=True)).cuda()
    z = torch.randn(n_tok, 256, generator=g).to("cuda", torch.bfloat16)
    with torch.no_grad():
        plain = m(z, ids, w)
        calls = []
        real = mr.group_by_expert
        monkeypatch.setattr(mr, "group_by_expert", lambda *a, **k: calls.append(a[1:]) or real(*a, **k))
        with sync_free_experts():
            fast = m(z, ids, w)
        assert calls == [(num_experts, top_k)], calls
        monkeypatch.setattr(experts_mod, "_use_routing_kernel", lambda flat_ids: False)
        with sync_free_experts():
            torch_grouped = m(z, ids, w)  # argsort + index_add + cumsum, then the same kernels, combine_slots
    torch.cuda.synchronize()
    # the same expert outputs; combine_rows sums the k slots in slot order, torch's sum(1) in its own: at most one
    # bf16 ulp apart (printed: whether bitwise)
    print(f"{fmt} E={num_experts} N={n_tok} K={top_k}: kernel path bitwise the torch grouping: "
          f"{torch.equal(fast, torch_grouped)}")
    assert_ulps16(fast, torch_grouped, 1, what="combine_rows vs combine_slots")
    err = _rel(fast, plain)
    print(f"{fmt} E={num_experts} N={n_tok} K={top_k}: sync-free vs plain rel err {err:.2e}, "
          f"bitwise {torch.equal(fast, plain)}")
    assert err < 1e-2, err


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_gpu_routed_experts_sync_free_capture_in_a_cuda_graph(fmt):
    """The whole experts forward (routing kernel, dequant, grouped matmuls) under sync_free_experts() captured
    once; replays with new ids, weights and inputs equal the eager sync-free forward bit for bit, and the
    plain forward within the grouped_mm tolerance."""
    num_experts, n_tok, top_k = 64, 128, 8
    m = _cuda_experts(fmt, num_experts)
    ids = _topk_ids(n_tok, num_experts, top_k, seed=0).cuda()
    w = torch.full((n_tok, top_k), 1.0 / top_k, device="cuda")
    z = torch.randn(n_tok, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), sync_free_experts():
        graph, out = capture(lambda: m(z, ids, w), warmups=2)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        ids.copy_(_topk_ids(n_tok, num_experts, top_k, seed=seed, skip=(seed, 40 + seed)))
        nw = torch.rand(n_tok, top_k, generator=g)
        w.copy_(nw / nw.sum(-1, keepdim=True))
        z.copy_(torch.randn(n_tok, 256, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            with sync_free_experts():
                eager = m(z, ids, w)
            plain = m(z, ids, w)
        assert torch.equal(out, eager), seed
        assert _rel(out, plain) < 1e-2

