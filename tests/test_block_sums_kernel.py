"""The block16 checksum's block sums in Triton (`miles_k3.kernels.block_sums`) against the torch reference
(`miles_k3.weight_sync.protocol.block_sums_reference`): bit-identical (integer sums).

CPU: the cases run once under the Triton interpreter (one subprocess). GPU (`python -m pytest -m gpu
tests/test_block_sums_kernel.py`): the same cases on CUDA, a 240 MB payload (a rank-32 k3_m adapter), and the
`block_sums` dispatch takes the kernel for CUDA payloads.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import gpu_test, print_results

from miles_k3.kernels.block_sums import block_sums_triton
from miles_k3.weight_sync.protocol import ALIGN, block_sums, block_sums_reference


def _payload(device, nbytes, seed=0, extreme=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if extreme:  # every word 0xFFFF in the first block, 0x8000 (negative as int16) in the second
        p[:ALIGN] = 255
        p[ALIGN:2 * ALIGN].view(torch.int16).fill_(-32768)
    return p.to(device)


def check_parity(device, blocks, extreme=False):
    p = _payload(device, blocks * ALIGN, seed=blocks, extreme=extreme)
    got, ref = block_sums_triton(p, ALIGN), block_sums_reference(p)
    assert got.shape == (blocks, 2) and got.dtype == torch.int64
    assert torch.equal(got, ref), (got - ref).abs().max()
    if extreme:
        words = ALIGN // 2
        assert got[0].tolist() == [65535 * words, 65535 * words * (words + 1) // 2]


def check_detects_one_word(device):
    p = _payload(device, 64 * ALIGN)
    before = block_sums_triton(p, ALIGN)
    p[37 * ALIGN + 100] ^= 1  # one bit of one word
    after = block_sums_triton(p, ALIGN)
    changed = (before != after).any(1).nonzero().flatten().tolist()
    assert changed == [37], changed


INTERPRETER_CASES = {
    "one-block": (check_parity, {"blocks": 1}),
    "partial-program": (check_parity, {"blocks": 13}),
    "extreme-words": (check_parity, {"blocks": 2, "extreme": True}),
    "many": (check_parity, {"blocks": 300}),
    "detects-one-word": (check_detects_one_word, {}),
}


@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_bad_payloads_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 512"):
        block_sums_triton(torch.zeros(513, dtype=torch.uint8), ALIGN)
    with pytest.raises(ValueError, match="contiguous 1-d uint8"):
        block_sums_triton(torch.zeros(512, dtype=torch.int16), ALIGN)
    with pytest.raises(ValueError, match="not a multiple of 512"):
        block_sums(torch.zeros(100, dtype=torch.uint8))
    assert block_sums_triton(torch.zeros(0, dtype=torch.uint8), ALIGN).shape == (0, 2)


@gpu_test
@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_gpu_cases(case):
    fn, kw = INTERPRETER_CASES[case]
    fn("cuda", **kw)


@gpu_test
def test_gpu_adapter_sized_payload_and_dispatch(monkeypatch):
    import miles_k3.kernels.block_sums as kb

    p = torch.randint(0, 256, (238_505_984,), dtype=torch.uint8, device="cuda")  # rank-32 k3_m adapter bytes
    calls = []
    real = kb.block_sums_triton
    monkeypatch.setattr(kb, "block_sums_triton", lambda *a: calls.append(1) or real(*a))
    got = block_sums(p)
    assert calls == [1]
    assert torch.equal(got, block_sums_reference(p))


if __name__ == "__main__":  # the interpreter subprocess of `interpreter_results`
    print_results(INTERPRETER_CASES)
