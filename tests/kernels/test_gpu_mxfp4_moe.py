"""The fused MXFP4 expert matmul (`miles_k3.kernels.mxfp4_moe`) on CUDA against its reference: forward, the
input gradient (W read along the other axis), ragged and empty experts, shapes that are not tile multiples
(K3 and k3_m widths), exact decode at extreme scale bytes, the decode tiling captured in a CUDA graph, and the
`RoutedExperts` module (with expert LoRA on top) on the triton backend against the torch backend.

Tolerance (`_assert_accumulation_close`): the kernel multiplies the same bf16 activations by the same exact bf16
weights as the reference (dequantize_mxfp4, then an fp32 matmul); the products are exact in fp32, only the order
of the fp32 accumulation differs (tensor-core k16 chunks vs the reference's), then the sum is rounded once to
bf16. So |y - ref32| <= 2^-8 |ref32| (the bf16 rounding, 2^-9, with margin) + 2^-14 (|x| @ |W|^T) (a generous
bound on fp32 accumulation error over K <= 4096 terms), and y equals bf16(ref32) for at least 95% of elements
(a 1-ulp difference needs an fp32 sum within accumulation error of a bf16 rounding midpoint). The one-multiply
decode (`fast`) is checked bit for bit against the general decode (same dots, same order), with tiles that read
scale bytes above 128 (recomputed in the kernel); `split` (two dots) against the reference by the criterion above;
the chunked tiling (`TileConfig.chunks`) against the reference with every choice of chunks.
Run with `python -m pytest -m gpu tests/kernels/test_gpu_mxfp4_moe.py`."""
import pytest
import torch
from kernel_testing import capture

from miles_k3.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from miles_k3.model.experts import PROJS, RoutedExperts, mxfp4_experts_backend, sync_free_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _weights(num_experts, out_f, in_f, std=0.05, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(num_experts, out_f, in_f, device="cuda", generator=g) * std
    return quantize_mxfp4(w)


def _ref32(x, counts, packed, scale, transpose):
    """fp32 reference and the |x| @ |W| magnitude (for the accumulation allowance)."""
    w = dequantize_mxfp4(packed, scale, torch.bfloat16).float()
    y = torch.zeros(x.shape[0], w.shape[2] if transpose else w.shape[1], device=x.device)
    mag = torch.zeros_like(y)
    r0 = 0
    for e, c in enumerate(counts):
        if c:
            we = w[e] if transpose else w[e].t()
            xe = x[r0:r0 + c].float()
            y[r0:r0 + c] = xe @ we
            mag[r0:r0 + c] = xe.abs() @ we.abs()
        r0 += c
    return y, mag


def _assert_accumulation_close(y, x, counts, packed, scale, transpose, what=""):
    ref, mag = _ref32(x, counts, packed, scale, transpose)
    err = (y.float() - ref).abs()
    bound = 2.0 ** -8 * ref.abs() + 2.0 ** -14 * mag
    exact = (y == ref.to(torch.bfloat16)).float().mean().item() if y.numel() else 1.0
    print(f"{what}: max err {err.max().item() if y.numel() else 0:.3g}, max err/bound "
          f"{(err / bound.clamp_min(1e-30)).max().item() if y.numel() else 0:.3f}, bf16-equal {exact:.4f}")
    assert bool((err <= bound).all()), what
    assert exact >= 0.95, (what, exact)


SHAPES = [  # (E, O, In, counts): K3 (O 3072 / In 3584 and back), k3_m (128 x 384 and back), odd widths
    (4, 3072, 3584, [0, 77, 130, 1]),
    (4, 3584, 3072, [33, 0, 0, 260]),
    (8, 128, 384, [300, 0, 17, 1, 64, 0, 129, 5]),
    (8, 384, 128, [1, 2, 3, 0, 500, 0, 0, 16]),
    (5, 200, 96, [7, 0, 40, 3, 0]),
]


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "input_grad"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}_O{s[1]}_In{s[2]}")
def test_kernel_matches_reference(shape, transpose):
    from miles_k3.kernels.mxfp4_moe import mxfp4_moe_matmul

    num_experts, out_f, in_f, counts = shape
    packed, scale = _weights(num_experts, out_f, in_f)
    torch.manual_seed(1)
    x = torch.randn(sum(counts), out_f if transpose else in_f, device="cuda").bfloat16()
    y = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose)
    _assert_accumulation_close(y, x, counts, packed, scale, transpose, f"{shape[:3]} t={transpose}")
    ends = torch.tensor(counts, device="cuda").cumsum(0).int()  # device row ends: same tiling, same bits
    assert torch.equal(mxfp4_moe_matmul(x, ends, packed, scale, transpose=transpose), y)


@pytest.mark.parametrize("variant", ["tl_bm16", "asm_bm16", "tl_swap_bm128", "asm_swap_bm16", "asm_swap_bm64",
                                     "asm_swap_bm128", "asm_swap_s2d_nopf_bm16", "asm_swap_s2d_nopf_bm128",
                                     "asm_swap_s2d_bm16", "asm_s2d_nopf_fast_split_bm16",
                                     "asm_s2d_nopf_fast_split_bm32", "tl_s2d_nopf_fast_split_bm16",
                                     "asm_swap_s2d_nopf_fast_bm16", "asm_swap_s2d_nopf_fast_bm128",
                                     "asm_swap_s2d_nopf_fast_split_bm16", "asm_swap_s2d_fast_split_bm64"])
@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "input_grad"])
def test_every_decode_and_tiling_matches_reference(variant, transpose):
    from miles_k3.kernels.mxfp4_moe import TileConfig, mxfp4_moe_matmul

    decode, *flags = variant.split("_")
    bm = int(flags[-1][2:])
    cfg = TileConfig(bm, 128, 128 if bm <= 32 or "s2d" in flags else 64, num_warps=4 if bm <= 64 else 8,
                     decode=decode, swap="swap" in flags, scale_2d="s2d" in flags, prefetch="nopf" not in flags,
                     fast="fast" in flags, split="split" in flags)
    counts = [0, 150, 3, 0, 64, 17]
    packed, scale = _weights(6, 640, 448)
    if "fast" in flags:  # a few scale bytes above 128: the fast decode recomputes those tiles
        scale[1, 5, 3] = 133
        scale[4, 300, 13] = 129
    x = torch.randn(sum(counts), 640 if transpose else 448, device="cuda").bfloat16()
    y = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose, config=cfg)
    _assert_accumulation_close(y, x, counts, packed, scale, transpose, f"{variant} t={transpose}")


def _chunk_counts(seed=3):
    """Rows per expert for chunks (64, 32, 16): one count drawn from each range of n that picks another set of
    chunks (1-16: {3}, 17-32: {2}, 33-48: {2, 3}, 49-64: {1}, 65-80: {1, 3}, 81-96: {1, 2}, 97-112: all three;
    `mxfp4_moe` module docstring), the boundaries 112 and 113, empty experts and an expert of three groups."""
    g = torch.Generator().manual_seed(seed)
    drawn = [int(torch.randint(lo, lo + 16, (1,), generator=g)) for lo in range(1, 113, 16)]
    return [0, *drawn[:4], 0, *drawn[4:], 112, 113, 250]


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "input_grad"])
@pytest.mark.parametrize("bn,warps", [(128, 8), (64, 4)])
@pytest.mark.parametrize("out_f,in_f", [(256, 512), (200, 96)], ids=["O256_In512", "O200_In96"])
def test_chunked_tiling_matches_reference(out_f, in_f, bn, warps, transpose):
    """The chunked kernel (chunks 64, 32, 16; "asm" fast decode) against the reference by the criterion above,
    with a scale byte above 128 in one expert (its groups recomputed): bit for bit the general decode's output,
    and host counts give the device row ends' bits."""
    from miles_k3.kernels.mxfp4_moe import TileConfig, mxfp4_moe_matmul

    counts = _chunk_counts()
    packed, scale = _weights(len(counts), out_f, in_f)
    scale[7, 5, 1] = 133
    x = torch.randn(sum(counts), out_f if transpose else in_f, device="cuda").bfloat16()
    kw = {"num_warps": warps, "num_stages": 3, "decode": "asm", "swap": True, "scale_2d": True, "prefetch": False,
          "chunks": (64, 32, 16)}
    y = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose, config=TileConfig(112, bn, 128, fast=True,
                                                                                          **kw))
    _assert_accumulation_close(y, x, counts, packed, scale, transpose, f"chunked {out_f}x{in_f} bn{bn} t={transpose}")
    general = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose, config=TileConfig(112, bn, 128, **kw))
    assert torch.equal(y, general)
    ends = torch.tensor(counts, device="cuda").cumsum(0).int()
    assert torch.equal(mxfp4_moe_matmul(x, ends, packed, scale, transpose=transpose,
                                        config=TileConfig(112, bn, 128, fast=True, **kw)), y)


@pytest.mark.parametrize("decode", ["tl", "asm", "tl_fast", "asm_fast", "asm_fast_split"])
def test_decode_is_exact_at_extreme_scales(decode):
    """Every code at scale bytes 0 (2^-127: bf16 subnormal weights), 1, 2, 40, 100, 127, 200, 252: x = c * identity
    picks single weights (c a power of two keeping the products normal fp32 numbers, so the tensor cores'
    treatment of subnormals is not what is tested), so y must equal c * the dequantized bf16 weights exactly,
    forward and transposed; a 255 (NaN) block makes the outputs that reduce over it NaN, and only those."""
    from miles_k3.kernels.mxfp4_moe import TileConfig, mxfp4_moe_matmul

    in_f = 256
    name, *flags = decode.split("_")  # fast: scale bytes <= 128 on the one-multiply decode, the rest recomputed
    cfg = TileConfig(16, 128, 64, decode=name, scale_2d="fast" in flags, prefetch="fast" not in flags,
                     fast="fast" in flags, split="split" in flags)
    for scale_bytes, c in (([0, 1, 2, 40], 2.0 ** 100), ([100, 127, 200, 252], 1.0)):
        rows = len(scale_bytes)
        codes = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(rows, 1)[:, :in_f // 2]
        codes[:, 64:] = codes[:, :64].flip(1)  # every byte value somewhere in each row
        packed = codes.contiguous()[None]
        scale = torch.tensor(scale_bytes, dtype=torch.uint8, device="cuda")[:, None].expand(rows, in_f // 32)
        scale = scale.contiguous()[None]
        want = dequantize_mxfp4(packed[0], scale[0], torch.bfloat16).float() * c  # exact: a power of two
        eye = (torch.eye(in_f, device="cuda") * c).bfloat16()
        y = mxfp4_moe_matmul(eye, [in_f], packed, scale, config=cfg)  # [In, O]: y[i, o] = c W[o, i]
        assert torch.equal(y.float(), want.t()), (decode, scale_bytes)
        eye_o = (torch.eye(rows, device="cuda") * c).bfloat16()
        y_t = mxfp4_moe_matmul(eye_o, [rows], packed, scale, transpose=True, config=cfg)  # [O, In] = c W
        assert torch.equal(y_t.float(), want), (decode, scale_bytes)
    nan_scale = scale.clone()
    nan_scale[0, 3, 2] = 255
    y_nan = mxfp4_moe_matmul(eye, [in_f], packed, nan_scale, config=cfg)
    assert bool(y_nan[:, 3].isnan().all()) and not bool(y_nan[:, :3].isnan().any())  # 0 * NaN = NaN


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "input_grad"])
@pytest.mark.parametrize("bm", [16, 128])
def test_fast_decode_gives_the_general_decodes_bits(bm, transpose):
    """The one-multiply decode (`fast`, no split: the same dots in the same order) gives bit for bit the general
    decode's output, on K3-like scale bytes (117..128) and with tiles whose scale bytes exceed 128 (recomputed
    by the general decode in the kernel); the split variant equals it up to fp32 accumulation order."""
    from miles_k3.kernels.mxfp4_moe import TileConfig, mxfp4_moe_matmul

    num_experts, out_f, in_f = 5, 768, 1024
    g = torch.Generator(device="cuda").manual_seed(7)
    packed = torch.randint(0, 256, (num_experts, out_f, in_f // 2), generator=g, device="cuda",
                           dtype=torch.int16).to(torch.uint8)
    scale = torch.randint(117, 129, (num_experts, out_f, in_f // 32), generator=g, device="cuda",
                          dtype=torch.int16).to(torch.uint8)
    scale[2, 100, 7] = 140
    scale[4, 700, 30] = 200
    counts = [3, 0, 200 if bm == 128 else 9, 1, 40]
    x = torch.randn(sum(counts), out_f if transpose else in_f, device="cuda").bfloat16() * 2 ** 6
    kw = {"num_warps": 4, "num_stages": 3, "swap": bm >= 64 or transpose, "scale_2d": True, "prefetch": False}
    bn = 64 if (bm >= 64 or transpose) else 128
    y_general = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose,
                                 config=TileConfig(bm, bn, 128, **kw))
    y_fast = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose,
                              config=TileConfig(bm, bn, 128, fast=True, **kw))
    assert torch.equal(y_fast, y_general)
    y_split = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose,
                               config=TileConfig(bm, bn, 128, fast=True, split=True, **kw))
    _assert_accumulation_close(y_split, x, counts, packed, scale, transpose, f"fast split bm{bm} t={transpose}")


def test_experts_without_rows_are_never_read():
    """NaN scale blocks in every expert without rows leave the output finite."""
    from miles_k3.kernels.mxfp4_moe import mxfp4_moe_matmul

    counts = [0, 40, 0, 0, 9, 0]
    packed, scale = _weights(6, 256, 512)
    for e, c in enumerate(counts):
        if not c:
            scale[e] = 255
    for transpose in (False, True):
        x = torch.randn(sum(counts), 256 if transpose else 512, device="cuda").bfloat16()
        y = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose)
        assert bool(y.isfinite().all())
        _assert_accumulation_close(y, x, counts, packed, scale, transpose, f"empty experts t={transpose}")
    assert mxfp4_moe_matmul(x[:0], [0] * 6, packed, scale, transpose=True).shape == (0, 512)


def _module(num_experts, latent, inter, lora_rank=None, seed=0):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        m = RoutedExperts(num_experts, latent, inter, 4.0, 25.0, expert_format="mxfp4")
        m.reset_parameters(std=0.05)
    if lora_rank:
        from miles_k3.model.lora import LoRAConfig, _expert_lora
        cfg = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank, targets=list(PROJS))
        m.lora = torch.nn.ModuleDict({n: _expert_lora(m, n, cfg) for n in PROJS})
        with torch.no_grad():
            for mod in m.lora.values():
                mod.lora_B.normal_(0, 0.05)
    return m


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_routed_experts_triton_backend_matches_torch_backend_with_expert_lora():
    """Forward, input gradient and LoRA gradients of a k3_m-shaped experts block (64 experts, 384 x 128,
    top-4) on the triton backend against the torch backend (dequantize + grouped_mm): the same math up to
    accumulation order, then three chained bf16 matmul levels and SiTU-GLU, so relative L2 errors ~1e-3."""
    m = _module(64, 384, 128, lora_rank=8)
    g = torch.Generator().manual_seed(2)
    ids = torch.rand(512, 64, generator=g).topk(4, dim=-1).indices.cuda()
    w = torch.rand(512, 4, generator=g).cuda()
    z = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for backend in ("triton", "torch"):
        with mxfp4_experts_backend(backend):
            zz = z.clone().requires_grad_()
            out = m(zz, ids, w)
            out.backward(grad)
            outs[backend] = (out, zz.grad, [p.grad.clone() for p in m.lora.parameters()])
            m.zero_grad(set_to_none=True)
    errs = {"out": _rel(outs["triton"][0], outs["torch"][0]), "dz": _rel(outs["triton"][1], outs["torch"][1]),
            "dlora": max(_rel(a, b) for a, b in zip(outs["triton"][2], outs["torch"][2]))}
    print("routed experts triton vs torch backend:", errs)
    assert max(errs.values()) < 1e-2, errs


def test_decode_step_in_a_cuda_graph_matches_eager_torch_backend():
    """K3-like decode: 128 experts of 512 x 256 (latent x inter), top-8, batch 32: under sync_free_experts()
    the triton path is captured once, then replayed with new routing and inputs copied into the captured
    tensors; each replay matches the eager torch backend on the same inputs."""
    m = _module(128, 512, 256, lora_rank=8)  # rank >= 8: grouped_mm (graph-capturable) for the LoRA deltas
    n_tok, top_k = 32, 8
    z = torch.zeros(n_tok, 512, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(n_tok, top_k, device="cuda", dtype=torch.long)
    w = torch.zeros(n_tok, top_k, device="cuda")

    def fill(seed):
        g = torch.Generator().manual_seed(seed)
        ids.copy_(torch.rand(n_tok, 128, generator=g).topk(top_k, dim=-1).indices)
        w.copy_(torch.rand(n_tok, top_k, generator=g))
        z.copy_(torch.randn(n_tok, 512, generator=g))

    fill(0)
    with torch.no_grad(), sync_free_experts(), mxfp4_experts_backend("triton"):  # small experts: force it
        graph, out = capture(lambda: m(z, ids, w))
    for seed in (1, 2):
        fill(seed)
        graph.replay()
        with torch.no_grad(), mxfp4_experts_backend("torch"):
            ref = m(z, ids, w)
        err = _rel(out, ref)
        print(f"graph replay {seed}: rel err vs torch backend {err:.2e}")
        assert err < 1e-2, err


def test_switch_dispatches_to_the_kernel_on_cuda_only_for_bf16(monkeypatch):
    import miles_k3.kernels.mxfp4_moe as mk
    import miles_k3.model.experts as experts_mod
    from miles_k3.model.experts import resolve_mxfp4_backend

    calls = []
    real = mk.mxfp4_moe_matmul
    monkeypatch.setattr(mk, "mxfp4_moe_matmul", lambda *a, **k: calls.append(k.get("transpose")) or real(*a, **k))
    m = _module(8, 64, 32)
    ids = torch.randint(0, 8, (16, 2), device="cuda")
    w = torch.rand(16, 2, device="cuda")
    z = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert resolve_mxfp4_backend(z.device)[0] == "triton"
    with mxfp4_experts_backend("triton"):
        m(z, ids, w).sum().backward()
        assert calls == [False, False, False, True, True, True], calls
        calls.clear()
        m(z.float().detach(), ids, w)  # fp32 activations: the exact torch path
    with mxfp4_experts_backend("torch"):
        m(z, ids, w).sum().backward()
    assert calls == []
    m(z, ids, w).sum().backward()  # auto: 8 x 64 x 32 weights, but 32 rows <= FUSED_MAX_ROWS: the kernel
    assert calls == [False, False, False, True, True, True], calls
    calls.clear()
    ids33, w33 = torch.randint(0, 8, (33, 2), device="cuda"), torch.rand(33, 2, device="cuda")
    z33 = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m(z33, ids33, w33).sum().backward()  # auto: 66 rows of a projection below FUSED_MIN_WEIGHTS, the torch path
    assert calls == []
    big = torch.empty(experts_mod.FUSED_MIN_WEIGHTS // 2, dtype=torch.uint8, device="cuda").view(1, 1, -1)
    assert experts_mod._use_fused_mxfp4(z, big)  # auto: K3-sized projections take the kernel
