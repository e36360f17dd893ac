"""The checked multi-tensor copy (`miles_k3.kernels.checked_copy`) against its pure-torch reference.

CPU: every case runs once under the Triton interpreter (one subprocess; each case reports its own test).
GPU (`python -m pytest -m gpu tests/kernels/test_checked_copy_kernel.py`): the same cases on CUDA, at the size of a
rank-8 k3_m adapter's 514 tensors too; the launch is three kernels (memset, check, copy) per dtype pair, and a
captured graph of it copies the values its sources hold at replay time.

Parity is exact (bit-identical to `torch._foreach_copy_`): the kernel rounds fp32 -> bf16 to nearest even with
integer ops like torch, and every other pair is exact or the hardware's own fp16 rounding.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import capture, cuda_kernels, gpu_test, print_results

from miles_k3.kernels.checked_copy import CheckedCopy, checked_copy_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _pairs(device, shapes, pairs, seed=0):
    """Sources (random, with huge and tiny magnitudes so that rounding and overflow matter) and zeroed
    destinations, cycling through the (src dtype, dst dtype) `pairs`; every source value is finite."""
    g = torch.Generator().manual_seed(seed)
    src, dst = [], []
    for i, shape in enumerate(shapes):
        sd, dd = pairs[i % len(pairs)]
        x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4)
        src.append(x.to(sd).nan_to_num().to(device))  # fp16 overflow -> its largest finite value
        dst.append(torch.zeros(shape, dtype=dd, device=device))
    return src, dst


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def check_parity(device, shapes, pairs, block):
    src, dst = _pairs(device, shapes, pairs)
    ref = [d.clone() for d in dst]
    cc = CheckedCopy(dst, src, block=block)
    cc.launch()
    assert not cc.refused()
    assert checked_copy_reference(ref, src)
    bad = [i for i, (x, y) in enumerate(zip(dst, ref)) if not torch.equal(x, y)]
    assert not bad, f"pairs {bad[:5]} differ from torch's copy"
    with torch.no_grad():  # the tables hold addresses, not values: a second launch copies the new values
        for s in src:
            s.mul_(-0.5)
    cc.launch()
    checked_copy_reference(ref, src)
    assert not cc.refused() and _same(dst, ref)


def check_refuses_non_finite(device, bad_value, where):
    shapes = [(7, 9), (4097,), (3, 1000), (1,)]
    src, dst = _pairs(device, shapes, [(F32, BF16), (BF16, F32)])
    cc = CheckedCopy(dst, src, block=256)
    cc.launch()
    before = [d.clone() for d in dst]
    with torch.no_grad():
        for s in src:
            s.add_(1)
        src[where].view(-1)[-1] = bad_value  # the last element: the last, partial tile of the tensor
    cc.launch()
    assert cc.refused()
    assert not checked_copy_reference([d.clone() for d in dst], src)
    assert _same(dst, before), "a refused copy changed a destination"
    with torch.no_grad():
        src[where].view(-1)[-1] = 0.0
    cc.launch()  # the flag is reset on every launch
    assert not cc.refused() and _same(dst, [s.to(d.dtype) for s, d in zip(src, dst)])


SHAPES = [(3, 5), (100,), (4097,), (8, 769), (1, 1), (0, 4), (33, 64), (2, 3, 5)]
PAIRS = [(F32, BF16), (F32, F32), (BF16, BF16), (BF16, F32), (F16, BF16), (F32, F16), (F16, F16)]

INTERPRETER_CASES = {
    "parity-mixed-dtypes": (check_parity, {"shapes": SHAPES, "pairs": PAIRS, "block": 256}),
    "parity-one-tile-per-tensor": (check_parity, {"shapes": SHAPES, "pairs": [(F32, BF16)], "block": 8192}),
    "refuses-nan": (check_refuses_non_finite, {"bad_value": float("nan"), "where": 1}),
    "refuses-inf-bf16": (check_refuses_non_finite, {"bad_value": float("-inf"), "where": 3}),
}


@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_validation_names_the_pair():
    a, b = torch.zeros(3), torch.zeros(4)
    with pytest.raises(ValueError, match="pair 0 needs contiguous tensors of one shape"):
        CheckedCopy([a], [b])
    with pytest.raises(ValueError, match="pair 1 has torch.int64"):
        CheckedCopy([a, a], [a, torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="pair 0 needs contiguous"):
        CheckedCopy([torch.zeros(3, 4).t()], [torch.zeros(4, 3)])
    with pytest.raises(ValueError, match="0 destinations for 0 sources"):
        CheckedCopy([], [])


def test_reference_is_all_or_nothing():
    src = [torch.ones(3), torch.tensor([1.0, float("nan")])]
    dst = [torch.zeros(3), torch.zeros(2)]
    assert not checked_copy_reference(dst, src) and not any(d.any() for d in dst)
    src[1][1] = 2.0
    assert checked_copy_reference(dst, src) and torch.equal(dst[1], src[1])


# ---- GPU -----------------------------------------------------------------------------------------------------
@gpu_test
@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_gpu_cases(case):
    fn, kw = INTERPRETER_CASES[case]
    fn("cuda", **kw)


def _k3m_rank8_shapes():
    """The 514 LoRA tensors of a rank-8 adapter on every k3_m target (shapes only; no model is built)."""
    from miles_k3.model import K3Config, K3ForCausalLM
    from miles_k3.model.lora import ALLOWED_TARGETS, LoRAConfig, apply_lora, lora_parameters

    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.from_name("k3_m"), expert_format="mxfp4")
    apply_lora(model, LoRAConfig(rank=8, alpha=16.0, targets=list(ALLOWED_TARGETS)))
    return [tuple(p.shape) for p in lora_parameters(model).values()]


@gpu_test
def test_gpu_adapter_sized_copy_is_exact_and_three_launches():
    shapes = _k3m_rank8_shapes()
    assert len(shapes) == 514
    src, dst = _pairs("cuda", shapes, [(F32, BF16)])
    ref = [d.clone() for d in dst]
    cc = CheckedCopy(dst, src)
    kernels = cuda_kernels(cc.launch)
    assert len(kernels) == 3, kernels  # flag memset, check, copy: one dtype pair
    checked_copy_reference(ref, src)
    assert not cc.refused() and _same(dst, ref)
    assert cc.groups[0].hint == 16  # allocator-aligned tensors: vectorised tile accesses


@gpu_test
def test_gpu_graph_replay_copies_current_values_and_refuses_nan():
    src, dst = _pairs("cuda", SHAPES, [(F32, BF16), (BF16, F32)])
    cc = CheckedCopy(dst, src)
    graph, _ = capture(cc.launch)
    for step in range(3):
        with torch.no_grad():
            for s in src:
                s.add_(step + 1)
        graph.replay()
        assert not cc.refused() and _same(dst, [s.to(d.dtype) for s, d in zip(src, dst)]), step
    before = [d.clone() for d in dst]
    with torch.no_grad():
        src[2][17] = float("nan")
        for s in src:
            s.add_(1)
    graph.replay()
    assert cc.refused() and _same(dst, before)


if __name__ == "__main__":  # the interpreter subprocess of `interpreter_results`
    print_results(INTERPRETER_CASES)
