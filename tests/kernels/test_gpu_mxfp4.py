"""MXFP4 Triton dequant kernel against the pure-torch reference, bit for bit, and the quantizer on CUDA against the
CPU (CUDA only).

Run on a GPU: `python -m pytest -m gpu tests/kernels/test_gpu_mxfp4.py`. Outputs are compared as int16 / int32 bit
patterns, so NaN blocks (scale 0xFF), -0.0 nibbles, subnormal products (scale 0) and overflow to Inf (scale 253,
254) must all match exactly. Every case forces scale bytes 0, 1, 253, 254 and 255 into the random scales.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from miles_k3.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from miles_k3.model.build import ModelConfig, build_model
from miles_k3.model.weight_writer import save_weights
from miles_k3.quantize import quantize_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton MXFP4 kernel)")]

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
SHAPES = [(1, 32), (7, 64), (3, 96, 320), (3072, 3584)]  # last: a K3 expert w1/w3, packed [3072, 1792]


def _random(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed uint8 [..., K/2] and scale uint8 [..., K/32] on CUDA, special scale bytes included."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    packed = torch.randint(0, 256, (*lead, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (*lead, k // 32), generator=g, dtype=torch.uint8)
    flat = scale.view(-1)
    special = torch.tensor([0, 255, 1, 254, 253, 127], dtype=torch.uint8)
    n = min(flat.numel(), special.numel())
    flat[:n] = special[:n]
    if flat.numel() > 64:
        flat[::61] = 255
        flat[5::67] = 0
    return packed.cuda(), scale.cuda()


def _assert_bitwise(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    diff = got.view(BITS[got.dtype]) != ref.view(BITS[ref.dtype])
    assert not bool(diff.any()), f"{int(diff.sum())} of {diff.numel()} outputs differ in bits"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_dequant_bitwise_equals_reference(shape, dtype):
    from miles_k3.kernels.mxfp4 import dequantize_mxfp4_reference, dequantize_mxfp4_triton

    packed, scale = _random(shape, seed=sum(shape))
    got = dequantize_mxfp4_triton(packed, scale, dtype)
    torch.cuda.synchronize()
    assert got.shape == shape and got.is_cuda
    _assert_bitwise(got, dequantize_mxfp4_reference(packed, scale, dtype))  # reference on CUDA
    _assert_bitwise(got.cpu(), dequantize_mxfp4_reference(packed.cpu(), scale.cpu(), dtype))  # and on CPU
    assert bool(got.isnan().any()) == bool((scale == 255).any()) and bool((got.view(BITS[dtype]) < 0).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_dequant_into_out_buffer(dtype):
    from miles_k3.kernels.mxfp4 import dequantize_mxfp4_reference, dequantize_mxfp4_triton

    packed, scale = _random((4, 96, 320), seed=11)
    out = torch.full((4, 96, 320), 123.0, dtype=dtype, device="cuda")
    ret = dequantize_mxfp4_triton(packed, scale, dtype, out=out)
    assert ret is out
    _assert_bitwise(out, dequantize_mxfp4_reference(packed, scale, dtype))
    # a slice of a larger buffer (contiguous): only that slice is written
    big = torch.full((6, 96, 320), 7.0, dtype=dtype, device="cuda")
    dequantize_mxfp4_triton(packed, scale, dtype, out=big[1:5])
    _assert_bitwise(big[1:5], out)
    assert bool((big[0] == 7).all()) and bool((big[5] == 7).all())
    with pytest.raises(ValueError, match="out must be"):
        dequantize_mxfp4_triton(packed, scale, dtype, out=torch.empty(4, 96, 321, dtype=dtype, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_mxfp4_triton(packed.transpose(0, 1), scale.transpose(0, 1), dtype)


def test_codec_on_cuda_matches_cpu():
    """quantize_mxfp4 on CUDA gives the bytes it gives on CPU; dequantize_mxfp4 on CUDA (Triton) the same bits."""
    w = torch.randn(3, 256, 1024, generator=torch.Generator().manual_seed(0))
    w[0, 0, :32] = float("nan")
    for rule in ("floor", "ceil"):
        p_cpu, s_cpu = quantize_mxfp4(w, rule)
        p, s = quantize_mxfp4(w.cuda(), rule)
        assert torch.equal(p.cpu(), p_cpu) and torch.equal(s.cpu(), s_cpu), rule
        for dtype in (torch.bfloat16, torch.float32):
            _assert_bitwise(dequantize_mxfp4(p, s, dtype).cpu(), dequantize_mxfp4(p_cpu, s_cpu, dtype))


def test_quantizing_a_checkpoint_on_cuda_writes_the_bytes_the_cpu_writes(tmp_path):
    """quantize_checkpoint(device=cuda) (what SFT's quantize=true does on a GPU) writes every tensor with the
    bytes of the CPU's run."""
    model = build_model(ModelConfig(name="k3_tiny", experts="bf16", dtype="bf16"), torch.device("cpu"),
                        torch.bfloat16, seed=0)
    src = save_weights(model, tmp_path / "bf16", small_tokenizer=True)
    runs = []
    for device in (None, torch.device("cuda")):
        dst = quantize_checkpoint(src, tmp_path / str(device), device=device)
        tensors = {}
        for file in sorted(dst.glob("*.safetensors")):
            tensors.update(load_file(file))
        runs.append(tensors)
    on_cpu, on_cuda = runs
    assert on_cpu.keys() == on_cuda.keys() and any(n.endswith(".weight_packed") for n in on_cpu)
    for name, t in on_cpu.items():
        assert torch.equal(on_cuda[name], t), name
