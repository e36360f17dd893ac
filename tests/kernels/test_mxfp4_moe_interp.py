"""The fused MXFP4 expert matmul (`miles_k3.kernels.mxfp4_moe`) on CPU under the Triton interpreter: its "tl"
decode and tiling against the pure-torch reference (forward and input gradient, ragged and empty experts,
widths that are not tile multiples, host counts and device-style row ends), the chunked tiling (`TileConfig.chunks`:
the chunks each group size uses, the MMA widths the kernel issues, refused configs), and the experts backend switch
resolving to torch on CPU. The GPU file (tests/kernels/test_gpu_mxfp4_moe.py) covers the "asm" decode and CUDA
graphs."""
import pytest
import torch
from kernel_testing import print_results

import miles_k3.model.experts as experts_mod


def check_matches_reference(device, transpose, swap, scale_2d=False, prefetch=True, fast=False, split=False,
                            big_scales=False):
    """big_scales: some scale bytes above 128 (and one 255, a NaN block, in an expert without rows): the fast
    decode must recompute exactly the tiles that read them."""
    from miles_k3.kernels.mxfp4 import quantize_mxfp4
    from miles_k3.kernels.mxfp4_moe import TileConfig

    torch.manual_seed(0)
    out_f, in_f, counts = 40, 96, [5, 0, 19, 3]
    packed, scale = quantize_mxfp4(torch.randn(4, out_f, in_f) * 0.5)
    if big_scales:
        scale[2, 3, 1] = 131  # expert 2's first n-tile (forward) / a k-tile (input gradient): 2^4 larger
        scale[1, :, :] = 255  # no rows: never read
    cfg = TileConfig(16, 32, 32, decode="tl", swap=swap, scale_2d=scale_2d, prefetch=prefetch, fast=fast,
                     split=split)
    _assert_matches_reference(counts, packed, scale, transpose, cfg)


def _assert_matches_reference(counts, packed, scale, transpose, cfg):
    """The kernel on random x against the reference, then host counts against device row ends (identical)."""
    from miles_k3.kernels.mxfp4_moe import mxfp4_moe_matmul, mxfp4_moe_matmul_reference

    x = torch.randn(sum(counts), packed.shape[1] if transpose else packed.shape[2] * 2).bfloat16()
    ref = mxfp4_moe_matmul_reference(x.float(), counts, packed, scale, transpose=transpose)  # fp32 sums
    y = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose, config=cfg)
    err = (y.float() - ref).abs()
    # 1 bf16 ulp (2^-7 relative): the interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest)
    assert bool((err <= 2.0 ** -7 * ref.abs() + 1e-6).all()), err.max()
    ends = torch.tensor(counts).cumsum(0).int()
    assert torch.equal(mxfp4_moe_matmul(x, ends, packed, scale, transpose=transpose, config=cfg), y)


# Rows per expert at every boundary of the (64, 32, 16) chunk choice (C3, C2 + C3, C1, G = 112 and one past each),
# an empty expert, and experts of several groups (113 = 112 + 1, 229 = 2 * 112 + 5).
CHUNK_BOUNDARY_COUNTS = [0, 1, 16, 17, 32, 33, 48, 49, 64, 65, 80, 81, 96, 97, 111, 112, 113, 229]


def check_chunked_matches_reference(device, transpose, chunks, fast=True, scale_2d=True, big_scales=False):
    """The chunked kernel against the reference. (64, 32, 16): counts at every boundary of the chunk choice;
    big_scales: fewer experts, a scale byte of 131 in expert 1 (its groups are recomputed by the general decode) and
    a NaN block in the empty expert 0 (never read). Other chunks: G = sum(chunks) and its neighbours."""
    from miles_k3.kernels.mxfp4 import quantize_mxfp4
    from miles_k3.kernels.mxfp4_moe import TileConfig

    torch.manual_seed(0)
    g = sum(chunks)
    if big_scales:
        counts = [0, 73, 40, 2 * g + 5, 9]
    elif chunks == (64, 32, 16):
        counts = CHUNK_BOUNDARY_COUNTS
    else:
        counts = [0, 1, chunks[2], chunks[2] + 1, g - 1, g, g + 1, 2 * g + 5]
    packed, scale = quantize_mxfp4(torch.randn(len(counts), 40, 96) * 0.5)
    if big_scales:
        scale[1, 3, 1] = 131  # forward: expert 1's only n-tile; input gradient: its first k-step
        scale[0] = 255
    cfg = TileConfig(g, 64, 64, decode="tl", swap=True, scale_2d=scale_2d, prefetch=False, fast=fast, chunks=chunks)
    _assert_matches_reference(counts, packed, scale, transpose, cfg)


def check_chunked_mma_widths(device):
    """The widths of the dots the chunked kernel issues for one group of n rows (one n-tile, one k-step), worked
    out by hand for (64, 32, 16): n rounded up to a multiple of 16, as chunks of 64, 32 and 16 in that order."""
    import triton.runtime.interpreter as interp

    from miles_k3.kernels.mxfp4 import quantize_mxfp4
    from miles_k3.kernels.mxfp4_moe import TileConfig, mxfp4_moe_matmul

    want = {1: [16], 16: [16], 17: [32], 32: [32], 33: [32, 16], 40: [32, 16], 48: [32, 16], 49: [64], 50: [64],
            64: [64], 65: [64, 16], 73: [64, 16], 80: [64, 16], 81: [64, 32], 96: [64, 32], 97: [64, 32, 16],
            100: [64, 32, 16], 112: [64, 32, 16]}
    packed, scale = quantize_mxfp4(torch.randn(1, 64, 32))
    cfg = TileConfig(112, 64, 32, decode="tl", swap=True, scale_2d=True, prefetch=False, fast=True,
                     chunks=(64, 32, 16))
    widths, real = [], interp.InterpreterBuilder.create_dot

    def record(self, a, b, d, *args):
        widths.append(b.data.shape[-1])  # swap: [BN, BK] @ [BK, Ci]
        return real(self, a, b, d, *args)

    interp.InterpreterBuilder.create_dot = record
    try:
        got = {}
        for n in want:
            widths.clear()
            mxfp4_moe_matmul(torch.randn(n, 32).bfloat16(), [n], packed, scale, config=cfg)
            got[n] = list(widths)
    finally:
        interp.InterpreterBuilder.create_dot = real
    assert got == want, got


def check_refuses_bad_chunk_configs(device):
    """Configs the chunked kernel cannot run are refused before any launch, the message naming the field."""
    from miles_k3.kernels.mxfp4 import quantize_mxfp4
    from miles_k3.kernels.mxfp4_moe import TileConfig, mxfp4_moe_matmul

    packed, scale = quantize_mxfp4(torch.randn(2, 64, 64))
    x = torch.randn(8, 64).bfloat16()
    good = {"swap": True, "scale_2d": True, "prefetch": False, "fast": True, "decode": "tl"}
    for kw, words in (({"bm": 128, "chunks": (64, 32, 16)}, "bm must equal sum(chunks) = 112"),
                      ({"bm": 104, "chunks": (64, 24, 16)}, "chunks must be three powers of two"),
                      ({"bm": 80, "chunks": (64, 8, 8)}, "chunks must be three powers of two >= 16"),
                      ({"bm": 112, "chunks": (16, 32, 64)}, "C1 >= C2 >= C3"),
                      ({"bm": 112, "chunks": (64, 32, 16), "split": True}, "got split=True"),
                      ({"bm": 112, "chunks": (64, 32, 16), "swap": False}, "got swap=False"),
                      ({"bm": 112, "chunks": (64, 32, 16), "prefetch": True}, "got prefetch=True")):
        cfg = TileConfig(bn=64, bk=64, **{**good, **kw})
        try:
            mxfp4_moe_matmul(x, [3, 5], packed, scale, config=cfg)
        except ValueError as e:
            assert words in str(e), (kw, str(e))
        else:
            raise AssertionError(f"{kw} was not refused")


INTERPRETER_CASES = {f"{'input_grad' if t else 'forward'}{'_swap' if s else ''}": (check_matches_reference,
                                                                                  {"transpose": t, "swap": s})
                     for t, s in ((False, False), (False, True), (True, False), (True, True))}
INTERPRETER_CASES.update({f"{'input_grad' if t else 'forward'}_scale2d_no_prefetch": (
    check_matches_reference, {"transpose": t, "swap": True, "scale_2d": True, "prefetch": False}) for t in (False, True)})
INTERPRETER_CASES.update({  # the fast decode (scale bytes > 128 recomputed) and the split dots, both tilings
    f"{'input_grad' if t else 'forward'}{'_swap' if sw else ''}_fast{'_split' if sp else ''}{'_big' if big else ''}": (
        check_matches_reference, {"transpose": t, "swap": sw, "scale_2d": True, "prefetch": pf, "fast": True,
                                  "split": sp, "big_scales": big})
    for t in (False, True) for sw, sp, pf, big in ((False, True, False, False), (False, True, False, True),
                                                   (True, True, True, True), (True, False, False, True))})
INTERPRETER_CASES.update({  # the chunked tiling: FAST with and without recomputed groups; equal chunks, general decode
    f"chunked{'_'.join(map(str, ch))}_{'input_grad' if t else 'forward'}{'_fast' if f else ''}{'_big' if big else ''}":
        (check_chunked_matches_reference, {"transpose": t, "chunks": ch, "fast": f, "scale_2d": f, "big_scales": big})
    for t in (False, True) for ch, f, big in (((64, 32, 16), True, False), ((64, 32, 16), True, True),
                                              ((16, 16, 16), False, False))})
INTERPRETER_CASES["chunked_mma_widths"] = (check_chunked_mma_widths, {})
INTERPRETER_CASES["chunked_bad_configs_refused"] = (check_refuses_bad_chunk_configs, {})


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_kernel_under_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_chunk_plan_by_hand():
    """(first row, width) of the chunks a group of n rows uses, worked out by hand from the rule in the
    `mxfp4_moe` docstring, at every boundary of three chunk shapes."""
    from miles_k3.kernels.mxfp4_moe import chunk_plan

    c = (64, 32, 16)
    assert chunk_plan(1, c) == chunk_plan(16, c) == ((0, 16),)
    assert chunk_plan(17, c) == chunk_plan(32, c) == ((0, 32),)
    assert chunk_plan(33, c) == chunk_plan(40, c) == chunk_plan(48, c) == ((0, 32), (32, 16))
    assert chunk_plan(49, c) == chunk_plan(50, c) == chunk_plan(64, c) == ((0, 64),)
    assert chunk_plan(65, c) == chunk_plan(73, c) == chunk_plan(80, c) == ((0, 64), (64, 16))
    assert chunk_plan(81, c) == chunk_plan(96, c) == ((0, 64), (64, 32))
    assert chunk_plan(97, c) == chunk_plan(100, c) == chunk_plan(112, c) == ((0, 64), (64, 32), (96, 16))
    e = (16, 16, 16)
    assert chunk_plan(1, e) == chunk_plan(16, e) == ((0, 16),)
    assert chunk_plan(17, e) == chunk_plan(32, e) == ((0, 16), (16, 16))
    assert chunk_plan(33, e) == chunk_plan(48, e) == ((0, 16), (16, 16), (32, 16))
    w = (32, 16, 16)
    assert chunk_plan(32, w) == ((0, 16), (16, 16))
    assert chunk_plan(33, w) == chunk_plan(48, w) == ((0, 32), (32, 16))
    assert chunk_plan(49, w) == chunk_plan(64, w) == ((0, 32), (32, 16), (48, 16))
    for bad in (0, 113):
        with pytest.raises(ValueError, match="a group has 1..112 rows"):
            chunk_plan(bad, c)


def test_backend_switch_is_torch_on_cpu_and_forcible():
    assert experts_mod.resolve_mxfp4_backend(torch.device("cpu"))[0] == "torch"
    x = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert not experts_mod._use_fused_mxfp4(x, torch.zeros(2**27, dtype=torch.uint8).view(1, 1, -1))
    with experts_mod.mxfp4_experts_backend("torch"):
        assert experts_mod.resolve_mxfp4_backend(torch.device("cuda"))[0] == "torch"
    with experts_mod.mxfp4_experts_backend("triton"), pytest.raises(ValueError, match="needs CUDA"):
        experts_mod.resolve_mxfp4_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="not one of auto"), experts_mod.mxfp4_experts_backend("fast"):
        pass


def test_auto_takes_the_kernel_for_big_projections_or_few_rows(monkeypatch):
    """auto on a GPU (the resolution patched to triton, nothing launched): the kernel for a projection of at least
    2**27 weights whatever the rows, and for a smaller one at most 64 rows (k3_m: batch 16 x top-4); fp32
    activations never; forced triton always."""
    monkeypatch.setattr(experts_mod, "resolve_mxfp4_backend", lambda device: ("triton", "patched"))
    small = torch.zeros(64, 128, 192, dtype=torch.uint8)  # k3_m's w1: 64 x 128 x 384 weights
    big = torch.zeros(1, 1, 2**26, dtype=torch.uint8)  # 2**27 weights
    rows = {n: torch.zeros(n, 384, dtype=torch.bfloat16) for n in (1, 4, 64, 65, 1024)}
    assert [experts_mod._use_fused_mxfp4(rows[n], small) for n in (1, 4, 64, 65, 1024)] == [True] * 3 + [False] * 2
    assert all(experts_mod._use_fused_mxfp4(rows[n], big) for n in (1, 65, 1024))
    assert not experts_mod._use_fused_mxfp4(torch.zeros(4, 384), small)  # fp32 activations: the exact torch path
    with experts_mod.mxfp4_experts_backend("triton"):
        assert experts_mod._use_fused_mxfp4(rows[1024], small)


if __name__ == "__main__":
    print_results(INTERPRETER_CASES)
