"""The fused MXFP4 expert matmul (`miles_k3.kernels.mxfp4_moe`) on CPU under the Triton interpreter: its "tl"
decode and tiling against the pure-torch reference (forward and input gradient, ragged and empty experts,
widths that are not tile multiples, host counts and device-style row ends), and the experts backend switch
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
    from miles_k3.kernels.mxfp4_moe import TileConfig, mxfp4_moe_matmul, mxfp4_moe_matmul_reference

    torch.manual_seed(0)
    out_f, in_f, counts = 40, 96, [5, 0, 19, 3]
    packed, scale = quantize_mxfp4(torch.randn(4, out_f, in_f) * 0.5)
    if big_scales:
        scale[2, 3, 1] = 131  # expert 2's first n-tile (forward) / a k-tile (input gradient): 2^4 larger
        scale[1, :, :] = 255  # no rows: never read
    x = torch.randn(sum(counts), out_f if transpose else in_f).bfloat16()
    ref = mxfp4_moe_matmul_reference(x.float(), counts, packed, scale, transpose=transpose)  # fp32 sums
    cfg = TileConfig(16, 32, 32, decode="tl", swap=swap, scale_2d=scale_2d, prefetch=prefetch, fast=fast,
                     split=split)
    y = mxfp4_moe_matmul(x, counts, packed, scale, transpose=transpose, config=cfg)
    err = (y.float() - ref).abs()
    # 1 bf16 ulp (2^-7 relative): the interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest)
    assert bool((err <= 2.0 ** -7 * ref.abs() + 1e-6).all()), err.max()
    ends = torch.tensor(counts).cumsum(0).int()
    assert torch.equal(mxfp4_moe_matmul(x, ends, packed, scale, transpose=transpose, config=cfg), y)


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


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_kernel_under_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


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


if __name__ == "__main__":
    print_results(INTERPRETER_CASES)
