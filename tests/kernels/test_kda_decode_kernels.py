"""KDA decode kernels (`miles_k3.kernels.kda_decode`) against their pure-torch references, and the
references against today's `KDAAttention` code.

CPU: the references equal `KDAAttention._short_conv` (T = 1, pooled window, index_copy_ scatter) and
`KDAAttention._gated_output` (o_proj aside) bit for bit; every kernel case runs once under the Triton
interpreter, in one subprocess (TRITON_INTERPRET=1 must be set before the kernel modules are imported), each
case reported as its own test; argument validation.
GPU (`python -m pytest -m gpu tests/kernels/test_kda_decode_kernels.py`): the same checks at k3_m shapes (C = 3072,
W = 4, H = 8, V = 128, up to 512 rows), one launch per call (profiler), and CUDA-graph capture / replay.

References are always evaluated on CPU copies of the inputs (on CUDA, F.conv1d goes through cuDNN, which may
pick TF32 algorithms; the CPU conv is plain fp32).

Tolerances:
  * pool (conv window) after a step: bitwise equal to the reference for every slot except the padding rows'
    shared scratch slot (undefined: the padding programs race on it); slots that no row names are untouched.
  * short_conv_step outputs: fp32 within 1e-5 relative + 2e-6 * m, where m = sum_j |w_j * seq_j| is the size
    of the terms of the conv sum. Both sides sum W fp32 products in different orders (the kernel may use FMA),
    each within ~(W-1) * 2^-24 * m of the exact sum (measured: <= 2.4e-7 * m), so where the sum cancels the
    relative error is unbounded while the absolute one stays below ~1e-6 * m (silu' <= 1.1). 16-bit outputs:
    within 1 ulp, except where the sum cancels; those must be within 2e-6 * m + 1 ulp (the 16-bit dtype's
    relative eps) of the reference.
  * gated_head_norm: fp32 within 1e-5 relative (atol 1e-30: gates of -100 give fp32-subnormal outputs, which
    the GPU's exp flushes to zero); 16-bit within 1 ulp (all products: no cancellation), same floor.
  * 16-bit outputs, both kernels: at most 1% (or 2) not bitwise equal to the reference. The fp32 values
    before the final rounding agree to ~1e-6 relative, so round-to-nearest-even gives the same 16-bit value
    except near a tie (~1e-3 of outputs); a truncating cast or a skipped rounding step differs in ~half.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import capture, cuda_kernels, gpu_test, print_results, ulps16
from torch import nn

from miles_k3.kernels.kda_decode import gated_head_norm_reference, short_conv_step_reference
from miles_k3.model.config import K3Config

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
K3M = {"c": 3072, "w": 4, "h": 8, "v": 128}  # k3_m: 8 heads x 128, q|k|v = 3 x 1024 conv channels, 4 taps


# ---- comparison helpers ------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _fail(bad: torch.Tensor, got: torch.Tensor, ref: torch.Tensor, what: str, extra: str = "") -> None:
    if bool(bad.any()):
        idx = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} outputs out of tolerance{extra}; "
                             f"first at {idx}: got {got.reshape(-1)[idx].item()!r}, "
                             f"ref {ref.reshape(-1)[idx].item()!r}")


def _assert_close(got: torch.Tensor, ref: torch.Tensor, floor: torch.Tensor | float, what: str) -> None:
    """fp32: |got - ref| <= 1e-5 |ref| + floor. 16-bit: <= 1 ulp, or |got - ref| <= floor + eps * max(|got|,
    |ref|); and at most 1% not bitwise equal. `floor` may be per element (broadcast to got's shape)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype, got.shape, ref.shape)
    assert got.device == ref.device, (got.device, ref.device)
    assert not bool(got.isnan().any()), f"{what}: NaN in output"
    diff = (got.float() - ref.float()).abs()
    if got.dtype == torch.float32:
        _fail(diff > 1e-5 * ref.abs() + floor, got, ref, what)
        return
    d = ulps16(got, ref)
    eps = torch.finfo(got.dtype).eps
    bad = (d > 1) & (diff > floor + eps * torch.maximum(got.float().abs(), ref.float().abs()))
    _fail(bad, got, ref, what, f" (max {int(d.max())} ulp)")
    # Both round the same fp32 value (up to ~1e-6 relative) to nearest even, so they rarely differ at all;
    # a truncating cast (the interpreter's fp32 -> bf16) or a missing rounding step differs in ~half.
    differ = int((d > 0).sum())
    assert differ <= max(2, got.numel() // 100), f"{what}: {differ} of {got.numel()} outputs differ in bits"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the checks (device-agnostic: run under the interpreter on CPU, and on CUDA) ---------------------------
def check_short_conv(device: str, act: torch.dtype, b: int, c: int, w: int = 4,
                     pool: torch.dtype | None = None, weight: torch.dtype = F32, weight_form: str = "cat",
                     n_pad: int = 0, extra_slots: int = 3, strided: bool = False,
                     slot_dtype: torch.dtype = torch.int64, block_c: int | None = None, steps: int = 1,
                     seed: int = 0) -> None:
    """`steps` decode steps of `b` real rows (distinct slots, random order) plus `n_pad` padding rows that
    all name one scratch slot; `extra_slots` pool rows nobody names. weight_form: "cat" [C, W], "cat3d"
    [C, 1, W], "three" (the q, k, v conv1d weights [C/3, 1, W]). strided: qkv rows with a stride != C and a
    pool stored as [N, W-1, C] (a transposed view)."""
    from miles_k3.kernels.kda_decode import short_conv_step

    g = _gen(seed)
    pool = pool or act
    n = b + 1 + extra_slots
    perm = torch.randperm(n, generator=g)
    real, scratch, untouched = perm[:b], int(perm[b]), perm[b + 1:]
    slots = torch.cat([real, torch.full((n_pad,), scratch)])
    order = torch.randperm(b + n_pad, generator=g)  # padding rows interleaved with real ones
    slots, is_real = slots[order], (order < b)
    rows = b + n_pad
    pool_NCW = (torch.randn(n, c, w - 1, generator=g) * 2).to(pool)
    if strided:
        pool_NCW = pool_NCW.transpose(1, 2).contiguous().to(device).transpose(1, 2)  # strides (C(W-1), 1, C)
    else:
        pool_NCW = pool_NCW.to(device)
    p = c // 3
    ws = [(torch.randn(p, 1, w, generator=g) * 0.6).to(weight) for _ in range(3)]
    wcat = torch.cat(ws)
    weight_arg = {"cat": wcat[:, 0], "cat3d": wcat, "three": ws}[weight_form]
    weight_arg = [t.to(device) for t in weight_arg] if weight_form == "three" else weight_arg.to(device)
    pool_ref = pool_NCW.cpu().clone()
    what = (f"short_conv_step act={act} pool={pool} w={weight} {weight_form} B={b}+{n_pad} C={c} W={w} "
            f"strided={strided} block_c={block_c}")
    for step in range(steps):
        x = torch.randn(rows, c + 7 if strided else c, generator=g) * 2
        x[::3] *= 0.01  # a range of row scales
        x = x.to(act).to(device)
        if strided:
            x = x[:, 3:c + 3]
        before = pool_NCW.cpu().clone()
        got = short_conv_step(x, pool_NCW, slots.to(device=device, dtype=slot_dtype), weight_arg,
                              block_c=block_c)
        assert got.shape == (rows, c) and got.dtype == act and got.device == x.device, what
        ref = short_conv_step_reference(x.cpu(), pool_ref, slots, wcat)
        # m: sum_j |w_j seq_j|, the scale of the conv sum's terms (see the module docstring)
        seq = torch.cat([before[slots].to(act).float(), x.cpu().float()[:, :, None]], dim=2)
        m = (seq.abs() * wcat[:, 0].float().abs()).sum(-1)
        _assert_close(got.cpu()[is_real], ref[is_real], 2e-6 * m[is_real], f"{what} step {step}")
        got_pool = pool_NCW.cpu()
        keep = torch.ones(n, dtype=torch.bool)
        keep[scratch] = False
        assert torch.equal(_bits(got_pool[keep]), _bits(pool_ref[keep])), f"{what} step {step}: pool differs"
        assert torch.equal(_bits(got_pool[untouched]), _bits(before[untouched])), f"{what}: untouched changed"
        if n_pad == 0:
            assert torch.equal(_bits(got_pool[scratch]), _bits(before[scratch])), f"{what}: unnamed changed"


GATE_SPECIALS = [100.0, -100.0, 30.0, -30.0, 10.0, -10.0, 0.0, -0.0, 1e-3, -1e-3]


def check_gated_norm(device: str, o_dtype: torch.dtype, lead: tuple[int, ...], h: int, v: int,
                     gate_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                     weight: torch.dtype = F32, eps: float = 1e-5, block_h: int | None = None,
                     seed: int = 0) -> None:
    from miles_k3.kernels.kda_decode import gated_head_norm

    g = _gen(seed)
    gate_dtype, out_dtype = gate_dtype or o_dtype, out_dtype or o_dtype
    o = torch.randn(*lead, h, v, generator=g)
    heads = o.reshape(-1, h, v)
    heads *= torch.exp(torch.empty(heads.shape[0], h, 1).uniform_(-7, 7, generator=g))  # ~1e-3..1e3 a head
    heads[::3, 0] = 0.0  # all-zero heads: rsqrt(eps) * 0
    heads[1::4, -1] *= 1e-4  # tiny heads (eps matters)
    gate = torch.randn(*lead, h * v, generator=g) * 4
    sp = torch.tensor(GATE_SPECIALS)
    k = min(sp.numel(), gate.numel())
    gate.view(-1)[:k] = sp[:k]
    w = torch.empty(v).uniform_(0.5, 1.5, generator=g).to(weight)
    o, gate = o.to(o_dtype), gate.to(gate_dtype)
    got = gated_head_norm(o.to(device), gate.to(device), w.to(device), eps, out_dtype, block_h=block_h)
    what = f"gated_head_norm o={o_dtype} gate={gate_dtype} out={out_dtype} w={weight} {lead}x{h}x{v}"
    assert got.shape == (*lead, h * v) and got.dtype == out_dtype and got.device.type == device, what
    assert bool(got.isfinite().all()), f"{what}: non-finite output"
    _assert_close(got.cpu(), gated_head_norm_reference(o, gate, w, eps, out_dtype), 1e-30, what)


# ---- CPU: the checks under the Triton interpreter, in one subprocess ---------------------------------------
INTERPRETER_CASES: dict[str, tuple] = {}  # name -> (check, kwargs); on CPU tensors under TRITON_INTERPRET=1
for _n, _dt in (("fp32", F32), ("bf16", BF16), ("fp16", F16)):
    INTERPRETER_CASES |= {
        f"conv-{_n}-C96-W4": (check_short_conv, {"act": _dt, "b": 5, "c": 96, "n_pad": 3, "steps": 2}),
        f"conv-{_n}-C105-W2-blocks": (check_short_conv, {"act": _dt, "b": 4, "c": 105, "w": 2, "n_pad": 2,
                                                         "weight_form": "three", "block_c": 32, "seed": 1}),
        f"norm-{_n}-H8-V128": (check_gated_norm, {"o_dtype": _dt, "lead": (3, 1), "h": 8, "v": 128}),
        f"norm-{_n}-H3-V17": (check_gated_norm, {"o_dtype": _dt, "lead": (2, 3), "h": 3, "v": 17, "seed": 1}),
    }
INTERPRETER_CASES |= {
    "conv-bf16-k3m": (check_short_conv, {"act": BF16, "b": 2, "n_pad": 1, **{k: K3M[k] for k in ("c", "w")},
                                         "weight_form": "three", "seed": 2}),
    "conv-bf16-act-fp32-pool": (check_short_conv, {"act": BF16, "pool": F32, "b": 4, "c": 48, "n_pad": 2,
                                                   "steps": 2, "seed": 3}),
    "conv-fp32-act-bf16-pool-bf16-w": (check_short_conv, {"act": F32, "pool": BF16, "weight": BF16, "b": 4,
                                                          "c": 48, "weight_form": "cat3d", "seed": 4}),
    "conv-fp16-act-bf16-pool": (check_short_conv, {"act": F16, "pool": BF16, "b": 3, "c": 33, "w": 3,
                                                   "seed": 5}),
    "conv-bf16-strided-int32-slots": (check_short_conv, {"act": BF16, "b": 4, "c": 105, "n_pad": 2,
                                                         "strided": True, "slot_dtype": torch.int32,
                                                         "block_c": 64, "steps": 2, "seed": 6}),
    "conv-fp32-no-padding": (check_short_conv, {"act": F32, "b": 3, "c": 24, "w": 2, "seed": 7}),
    "norm-bf16-fp32o-bf16gate": (check_gated_norm, {"o_dtype": F32, "gate_dtype": BF16, "out_dtype": BF16,
                                                    "lead": (4, 1), "h": 8, "v": 128, "seed": 2}),
    "norm-fp32-bf16w-blockh": (check_gated_norm, {"o_dtype": F32, "weight": BF16, "lead": (3,), "h": 5,
                                                  "v": 24, "block_h": 2, "eps": 1e-6, "seed": 3}),
    "norm-bf16-H8-V128-blockh": (check_gated_norm, {"o_dtype": BF16, "lead": (2, 1), "h": 8, "v": 128,
                                                    "block_h": 4, "seed": 4}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


# ---- CPU: the references are today's KDAAttention code -----------------------------------------------------
def _tiny_kda(dtype: torch.dtype, seed: int = 0):
    from miles_k3.model.kda import KDAAttention

    torch.manual_seed(seed)
    kda = KDAAttention(K3Config.from_name("k3_tiny"))
    for p in kda.parameters():
        nn.init.normal_(p, std=0.3)
    return kda.to(dtype)


@pytest.mark.parametrize("act,pool", [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16)],
                         ids=["fp32", "bf16", "bf16-act-fp32-pool", "fp16"])
def test_short_conv_reference_is_kda_short_conv_bitwise(act, pool):
    """What KDAAttention.forward does for a pooled decode step (gather, _short_conv, index_copy_), bit for
    bit, with duplicate scratch slots among the padding rows; weights concatenated or as the three conv1d
    weights."""
    kda = _tiny_kda(act)
    g = _gen(1)
    c, w1 = 3 * kda.num_heads * kda.head_dim, kda.conv_size - 1
    pool0 = (torch.randn(9, c, w1, generator=g) * 2).to(pool)
    slots = torch.tensor([4, 0, 7, 2, 8, 2])  # rows 3 and 5: padding on scratch slot 2
    x = torch.randn(slots.numel(), 1, 128, generator=g).to(act)
    with torch.no_grad():
        want_pool = pool0.clone()
        want_act, new = kda._short_conv(x, want_pool[slots], None)  # as in KDAAttention.forward, pooled
        want_pool.index_copy_(0, slots, new.to(want_pool.dtype))
        qkv = torch.cat([kda.q_proj(x), kda.k_proj(x), kda.v_proj(x)], dim=-1)[:, 0]
        convs = [kda.q_conv1d.weight, kda.k_conv1d.weight, kda.v_conv1d.weight]
        for weight in (torch.cat(convs), torch.cat(convs)[:, 0], convs):
            got_pool = pool0.clone()
            got_act = short_conv_step_reference(qkv, got_pool, slots, weight)
            assert got_act.dtype == act and torch.equal(_bits(got_act), _bits(want_act[:, 0]))
            assert torch.equal(_bits(got_pool), _bits(want_pool))


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_gated_head_norm_reference_is_kda_gated_output_bitwise(dtype):
    kda = _tiny_kda(dtype, seed=2)
    kda.o_proj = nn.Identity()  # _gated_output = o_proj(the reference)
    g = _gen(3)
    x = torch.randn(3, 2, 128, generator=g).to(dtype)
    o = torch.randn(3, 2, kda.num_heads, kda.head_dim, generator=g).to(dtype)
    with torch.no_grad():
        want = kda._gated_output(o, x)
        got = gated_head_norm_reference(o, kda.g_proj(x), kda.o_norm.weight, kda.norm_eps, x.dtype)
    assert got.dtype == want.dtype == dtype and got.shape == (3, 2, kda.num_heads * kda.head_dim)
    assert torch.equal(_bits(got), _bits(want))


def test_short_conv_reference_matches_the_conv_definition():
    """Independent of kda.py: out = silu(sum_j w_j seq_j), window shifted by one with x appended."""
    g = _gen(4)
    pool = torch.randn(5, 6, 3, generator=g, dtype=torch.float64)
    x = torch.randn(2, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    slots = torch.tensor([3, 1])
    before = pool.clone()
    got = short_conv_step_reference(x, pool, slots, w)
    seq = torch.cat([before[slots], x[:, :, None]], dim=2)
    torch.testing.assert_close(got, torch.nn.functional.silu((seq * w).sum(-1)))
    assert torch.equal(pool[slots], seq[:, :, 1:]) and torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])


def test_entry_points_validate(monkeypatch):
    from miles_k3.kernels import kda_decode as kd

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, pool, slots, w = torch.zeros(2, 12), torch.zeros(4, 12, 3), torch.tensor([0, 1]), torch.zeros(12, 4)
    o, gate, nw = torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 12), torch.ones(4)
    with pytest.raises(ValueError, match="CUDA"):
        kd.short_conv_step(x, pool, slots, w)
    with pytest.raises(ValueError, match="CUDA"):
        kd.gated_head_norm(o, gate, nw, 1e-5, F32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check: shape / argument errors (no launch)
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        kd.short_conv_step(x.double(), pool, slots, w)
    with pytest.raises(ValueError, match="int32, int64"):
        kd.short_conv_step(x, pool, slots.float(), w)
    with pytest.raises(ValueError, match=r"\[N, C, W-1\] with C = 12"):
        kd.short_conv_step(x, torch.zeros(4, 11, 3), slots, w)
    with pytest.raises(ValueError, match="W-1 = 3"):
        kd.short_conv_step(x, torch.zeros(4, 12, 2), slots, w)
    with pytest.raises(ValueError, match="one slot per row"):
        kd.short_conv_step(x, pool, torch.tensor([0]), w)
    with pytest.raises(ValueError, match=r"\[12, W\] or \[12, 1, W\]"):
        kd.short_conv_step(x, pool, slots, torch.zeros(12, 2, 4))
    with pytest.raises(ValueError, match="expected W = 4"):
        kd.short_conv_step(x, pool, slots, [torch.zeros(4, 1, 4), torch.zeros(4, 1, 4), torch.zeros(4, 1, 3)])
    with pytest.raises(TypeError, match="sequence of the three"):
        kd.short_conv_step(x, pool, slots, [w, w])
    with pytest.raises(ValueError, match="W >= 2"):
        kd.short_conv_step(x, torch.zeros(4, 12, 0), slots, torch.zeros(12, 1))
    with pytest.raises(ValueError, match="power of two"):
        kd.short_conv_step(x, pool, slots, w, block_c=48)
    with pytest.raises(ValueError, match=r"gate_BTP must have shape \(2, 1, 12\)"):
        kd.gated_head_norm(o, torch.zeros(2, 1, 13), nw, 1e-5, F32)
    with pytest.raises(ValueError, match=r"norm_weight_V must have shape \[4\]"):
        kd.gated_head_norm(o, gate, torch.ones(3), 1e-5, F32)
    with pytest.raises(ValueError, match="out_dtype"):
        kd.gated_head_norm(o, gate, nw, 1e-5, torch.float64)
    with pytest.raises(ValueError, match="eps"):
        kd.gated_head_norm(o, gate, nw, float("nan"), F32)
    with pytest.raises(TypeError, match="torch.Tensor"):
        kd.gated_head_norm(o.numpy(), gate, nw, 1e-5, F32)
    assert kd.short_conv_step(x[:0], pool, slots[:0], w).shape == (0, 12)  # empty: no launch
    assert kd.gated_head_norm(o[:0], gate[:0], nw, 1e-5, BF16).shape == (0, 1, 12)


# ---- GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act,pool", [(BF16, BF16), (F32, F32), (BF16, F32)],
                         ids=["bf16", "fp32", "bf16-fp32pool"])
@pytest.mark.parametrize("b", [1, 7, 64, 512])
@gpu_test
def test_gpu_short_conv_step_k3m(b, act, pool):
    kw = {"c": K3M["c"], "w": K3M["w"], "act": act, "pool": pool, "steps": 2}
    check_short_conv("cuda", b=b, n_pad=0, seed=b, **kw)
    check_short_conv("cuda", b=b, n_pad=(-b) % 8 or 3, weight_form="three", seed=b + 1, **kw)  # padded to x8
    check_short_conv("cuda", b=b, n_pad=5, weight=BF16, weight_form="cat3d", slot_dtype=torch.int32,
                     seed=b + 2, **kw)


@pytest.mark.parametrize("case", [{"c": 105, "w": 2, "block_c": 32}, {"c": 3072, "w": 4, "strided": True},
                                  {"c": 33, "w": 3, "pool": BF16, "act": F16},
                                  {"c": 3072, "w": 4, "block_c": 2048}],
                         ids=["C105-W2-blocks", "k3m-strided", "W3-fp16-bf16pool", "k3m-wide-block"])
@gpu_test
def test_gpu_short_conv_step_odd_shapes(case):
    case = {"act": BF16, **case}
    check_short_conv("cuda", b=37, n_pad=11, steps=2, seed=5, **case)


@pytest.mark.parametrize("dtypes", [(BF16, BF16, BF16), (F32, F32, F32), (F32, BF16, BF16), (F16, F16, F16)],
                         ids=["bf16", "fp32", "fp32o-bf16", "fp16"])
@pytest.mark.parametrize("b", [1, 7, 64, 512])
@gpu_test
def test_gpu_gated_head_norm_k3m(b, dtypes):
    o_dtype, gate_dtype, out_dtype = dtypes
    kw = {"o_dtype": o_dtype, "gate_dtype": gate_dtype, "out_dtype": out_dtype, "h": K3M["h"], "v": K3M["v"]}
    check_gated_norm("cuda", lead=(b, 1), seed=b, **kw)
    check_gated_norm("cuda", lead=(b, 1), weight=BF16, block_h=2, seed=b + 1, **kw)


@pytest.mark.parametrize("case", [{"lead": (3, 5), "h": 3, "v": 17}, {"lead": (9,), "h": 64, "v": 128},
                                  {"lead": (2, 1), "h": 5, "v": 24, "block_h": 8}],
                         ids=["odd", "H64", "block8"])
@gpu_test
def test_gpu_gated_head_norm_odd_shapes(case):
    check_gated_norm("cuda", BF16, seed=7, **case)


def _k3m_step_inputs(b: int, n_pad: int, act: torch.dtype = BF16, seed: int = 0):
    g = _gen(seed)
    c, w, h, v = K3M["c"], K3M["w"], K3M["h"], K3M["v"]
    n = b + 4
    slots = torch.cat([torch.randperm(n - 1, generator=g)[:b], torch.full((n_pad,), n - 1)]).cuda()
    pool = (torch.randn(n, c, w - 1, generator=g) * 2).to(act).cuda()
    weights = [(torch.randn(c // 3, 1, w, generator=g) * 0.6).cuda() for _ in range(3)]
    x = (torch.randn(b + n_pad, c, generator=g) * 2).to(act).cuda()
    o = torch.randn(b + n_pad, 1, h, v, generator=g).to(act).cuda()
    gate = (torch.randn(b + n_pad, 1, h * v, generator=g) * 4).to(act).cuda()
    nw = torch.empty(v).uniform_(0.5, 1.5, generator=g).cuda()
    return slots, pool, weights, x, o, gate, nw


@gpu_test
def test_gpu_one_launch_each():
    """torch.profiler: each call is exactly one kernel (today's torch code is ~10 each)."""
    from miles_k3.kernels.kda_decode import gated_head_norm, short_conv_step

    slots, pool, weights, x, o, gate, nw = _k3m_step_inputs(64, 0)
    calls = {"_short_conv_step_kernel": lambda: short_conv_step(x, pool, slots, weights),
             "_gated_head_norm_kernel": lambda: gated_head_norm(o, gate, nw, 1e-5, BF16)}
    with torch.no_grad():
        for name, fn in calls.items():
            kernels = cuda_kernels(fn)
            assert len(kernels) == 1 and name in kernels[0], (name, kernels)


@gpu_test
def test_gpu_cuda_graph_capture_and_replay():
    """Both kernels in one captured graph (the weights read in place through three pointers); replays with new
    inputs give what eager calls give, bit for bit (real rows; the scratch slot is undefined), and each replay
    shifts the pool rows like the reference."""
    from miles_k3.kernels.kda_decode import gated_head_norm, short_conv_step

    b, n_pad = 24, 8
    slots, pool, weights, x, o, gate, nw = _k3m_step_inputs(b, n_pad, seed=1)
    real = slots[:b]

    def step():
        return short_conv_step(x, pool, slots, weights), gated_head_norm(o, gate, nw, 1e-5, BF16)

    with torch.no_grad():
        graph, outs = capture(step)  # the warm-up's pool update is just one more step
        g = _gen(9)
        for _ in range(3):
            for t, scale in ((x, 2.0), (o, 1.0), (gate, 4.0)):
                t.copy_(torch.randn(t.shape, generator=g).mul_(scale).to(t.dtype))
            before = pool.clone()
            graph.replay()
            torch.cuda.synchronize()
            after_graph, conv_graph, norm_graph = pool.clone(), outs[0].clone(), outs[1].clone()
            pool.copy_(before)
            conv_eager, norm_eager = step()
            assert torch.equal(_bits(conv_graph[:b]), _bits(conv_eager[:b]))
            assert torch.equal(_bits(norm_graph), _bits(norm_eager))
            assert torch.equal(_bits(after_graph[real]), _bits(pool[real]))
            ref_pool = before.cpu()
            ref = short_conv_step_reference(x.cpu(), ref_pool, slots.cpu(), torch.cat(weights).cpu())
            seq = torch.cat([before[slots].float(), x.float()[:, :, None]], dim=2).cpu()
            m = (seq.abs() * torch.cat(weights)[:, 0].float().abs().cpu()).sum(-1)
            _assert_close(conv_graph[:b].cpu(), ref[:b], 2e-6 * m[:b], "graph replay conv")
            assert torch.equal(_bits(after_graph[real].cpu()), _bits(ref_pool[real.cpu()]))
            want = gated_head_norm_reference(o.cpu(), gate.cpu(), nw.cpu(), 1e-5, BF16)
            _assert_close(norm_graph.cpu(), want, 1e-30, "graph replay norm")
            pool.copy_(after_graph)


if __name__ == "__main__":  # the interpreter subprocess of `interpreter_results`
    print_results(INTERPRETER_CASES)
