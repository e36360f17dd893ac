"""CPU tests of the MXFP4 format (`miles_k3.kernels.mxfp4`): the codec and the pure-torch decode.

Decoded values are compared as bit patterns (fp32 -> int32, bf16 -> int16) wherever -0.0 or NaN matter, so a sign
or NaN mistake fails. Expectations are written independently of the code under test: E2M1 values from the
sign/exponent/mantissa formula with Python floats, powers of two with math.ldexp.
"""
from __future__ import annotations

import math

import pytest
import torch

from miles_k3.kernels import mxfp4 as kmx
from miles_k3.kernels.mxfp4 import (
    E2M1_VALUES,
    GROUP_SIZE,
    SCALE_RULES,
    dequantize_mxfp4,
    dequantize_mxfp4_reference,
    dequantize_mxfp4_triton,
    mxfp4_nbytes,
    quantize_mxfp4,
    relative_rms_error,
)

NAN = float("nan")


def e2m1(code: int) -> float:
    """E2M1 code -> value from its fields: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return math.copysign(mag, sign)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    same = bits(got) == bits(expected)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} differ; first at " \
                             f"{(~same).nonzero()[0].tolist()}: got {got.flatten()[(~same).flatten()][:4].tolist()}, " \
                             f"expected {expected.flatten()[(~same).flatten()][:4].tolist()}"


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 with NaN as 0x7FC0, the bits the decoders emit (torch's CPU cast makes NaN 0xFFFF)."""
    return t.to(torch.bfloat16).masked_fill_(t.isnan(), NAN)


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> E2M1 codes [..., K] (low nibble first)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def pack_codes(codes: list[int]) -> torch.Tensor:
    return torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)], dtype=torch.uint8)


# ---------------------------------------------------------------- decode: hand vectors and the exhaustive table

def test_e2m1_table_matches_the_field_formula():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert [e2m1(c) for c in range(16)] == expected
    assert_same_bits(E2M1_VALUES, torch.tensor(expected))
    assert math.copysign(1.0, E2M1_VALUES[8].item()) == -1.0  # code 8 is -0.0


def test_hand_computed_blocks():
    # block 0, scale 127 (x1): bytes 0x21 -> [0.5, 1.0], 0x8F -> [-6, -0], 0x07 -> [6, 0], 0xA3 -> [1.5, -1]
    b0 = [0x21, 0x8F, 0x07, 0xA3] + [0x00] * 12
    v0 = [0.5, 1.0, -6.0, -0.0, 6.0, 0.0, 1.5, -1.0] + [0.0] * 24
    # block 1, scale 128 (x2): 0x6D -> [-3 * 2, 4 * 2], 0x54 -> [2 * 2, 3 * 2]
    b1 = [0x6D, 0x54] + [0x11] * 14
    v1 = [-6.0, 8.0, 4.0, 6.0] + [1.0] * 28
    # block 2, scale 0xFF: all NaN whatever the nibbles
    b2 = [0x00, 0x88, 0x77] + [0x12] * 13
    v2 = [NAN] * 32
    # block 3, scale 0 (x 2^-127): 0x71 -> [0.5 * 2^-127 = 2^-128 (fp32 subnormal), 6 * 2^-127]
    b3 = [0x71, 0x98] + [0x00] * 14
    v3 = [math.ldexp(1, -128), math.ldexp(6, -127), -0.0, -math.ldexp(1, -128)] + [0.0] * 28
    packed = torch.tensor([b0 + b1, b2 + b3], dtype=torch.uint8)  # [2 rows, 32 bytes] = 2 blocks per row
    scale = torch.tensor([[127, 128], [255, 0]], dtype=torch.uint8)
    expected = torch.tensor([v0 + v1, v2 + v3], dtype=torch.float32)
    assert_same_bits(dequantize_mxfp4_reference(packed, scale, torch.float32), expected)
    assert_same_bits(dequantize_mxfp4(packed, scale, torch.float32), expected)
    # bf16: the same values (2^-128 and 6 * 2^-127 are bf16 subnormal / normal, exact)
    assert_same_bits(dequantize_mxfp4(packed, scale, torch.bfloat16), to_bf16(expected))
    assert bits(dequantize_mxfp4(packed, scale, torch.bfloat16))[1, 0].item() == 0x7FC0  # NaN block bits


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 130, 252])
def test_exhaustive_byte_table(scale_byte):
    """Every byte value 0..255, in order, decodes to (E2M1[low nibble], E2M1[high nibble]) * 2^(s - 127)."""
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)  # 16 rows of one block each
    scale = torch.full((16, 1), scale_byte, dtype=torch.uint8)
    expected = []
    for b in range(256):
        expected += [math.ldexp(e2m1(b & 15), scale_byte - 127), math.ldexp(e2m1(b >> 4), scale_byte - 127)]
    expected = torch.tensor(expected, dtype=torch.float32).view(16, 32)
    assert_same_bits(dequantize_mxfp4_reference(packed, scale, torch.float32), expected)
    assert_same_bits(dequantize_mxfp4_reference(packed, scale, torch.bfloat16), expected.to(torch.bfloat16))


def test_large_scale_bytes_overflow_to_inf_in_both_dtypes():
    # 6 * 2^127 and 2 * 2^127 exceed fp32/bf16 range -> +-Inf; 1.5 * 2^127 is finite; s=253: 4 * 2^126 = 2^128 -> Inf
    packed = torch.tensor([[0x37, 0xF4] + [0] * 14, [0x67, 0x05] + [0] * 14], dtype=torch.uint8)
    scale = torch.tensor([[254], [253]], dtype=torch.uint8)
    inf = float("inf")
    expected = torch.tensor([[inf, 1.5 * 2.0 ** 127, inf, -inf] + [0.0] * 28,
                             [inf, inf, 3.0 * 2.0 ** 126, 0.0] + [0.0] * 28], dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_bits(dequantize_mxfp4_reference(packed, scale, dtype), expected.to(dtype))


def test_bf16_decode_equals_fp32_decode_for_all_scale_bytes():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (256, 64), generator=g, dtype=torch.uint8)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 4)  # every scale byte, incl. 0 and 255
    f32 = dequantize_mxfp4(packed, scale, torch.float32)
    b16 = dequantize_mxfp4(packed, scale, torch.bfloat16)
    assert_same_bits(b16.float(), f32)  # bf16 -> fp32 is exact, so equal bits mean bf16 lost nothing
    assert f32.isnan().sum().item() == 4 * 32  # only the 0xFF row


def test_leading_dims_and_chunking(monkeypatch):
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (3, 5, 64), generator=g, dtype=torch.uint8)  # [E, out, K/2], K = 128
    scale = torch.randint(100, 150, (3, 5, 4), generator=g, dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scale, torch.float32)
    assert out.shape == (3, 5, 128)
    for e in range(3):
        assert_same_bits(out[e], dequantize_mxfp4(packed[e], scale[e], torch.float32))
    assert_same_bits(out.view(15, 128), dequantize_mxfp4(packed.view(15, 64), scale.view(15, 4), torch.float32))
    # row chunks of the reference (tiny chunk: 1 row) and of the quantizer (64 elements: 1 row at K = 128)
    monkeypatch.setattr(kmx, "_REF_CHUNK_BYTES", 16)
    assert_same_bits(dequantize_mxfp4(packed, scale, torch.float32), out)
    w = torch.randn(3, 5, 128, generator=g)
    p_full, s_full = quantize_mxfp4(w)
    monkeypatch.setattr(kmx, "_CHUNK_ELEMS", 64)
    p_chunk, s_chunk = quantize_mxfp4(w)
    assert torch.equal(p_full, p_chunk) and torch.equal(s_full, s_chunk)
    assert p_full.shape == (3, 5, 64) and s_full.shape == (3, 5, 4)
    for e in range(3):
        pe, se = quantize_mxfp4(w[e])
        assert torch.equal(pe, p_full[e]) and torch.equal(se, s_full[e])
    wide = torch.randn(5, 256, generator=g)  # a strided (non-contiguous) view quantizes like its copy
    for view in (wide[:, 64:192], wide.t().contiguous().t()[:, :128]):
        pv, sv = quantize_mxfp4(view)
        pc, sc = quantize_mxfp4(view.contiguous())
        assert torch.equal(pv, pc) and torch.equal(sv, sc)


def test_empty_inputs():
    out = dequantize_mxfp4(torch.empty(0, 16, dtype=torch.uint8), torch.empty(0, 1, dtype=torch.uint8))
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    p, s = quantize_mxfp4(torch.empty(4, 0))
    assert p.shape == (4, 0) and s.shape == (4, 0)


# ---------------------------------------------------------------- quantize: hand cases

def _up(x: float) -> float:  # the next fp32 value above / below x
    return torch.nextafter(torch.tensor(x), torch.tensor(math.inf)).item()


def _down(x: float) -> float:
    return torch.nextafter(torch.tensor(x), torch.tensor(-math.inf)).item()


def test_ties_to_even_and_sign():
    # amax 6 -> floor X = 2^(2 - 2) = 1 and ceil X = 2^ceil(log2(1)) = 1: q = V exactly
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,  # ties
            -0.25, -0.75, -1.25, -5.0, -0.0, 0.1, -0.1, 0.0,  # negatives; small ones keep their sign (-0)
            _up(0.25), _down(0.75), _up(1.25), _down(5.0),
            0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 2.9, 3.2, 4.9, 5.5, 0.74, 0.76]
    expected = [0, 2, 2, 4, 4, 6, 6, 7,
                8, 10, 10, 14, 8, 0, 8, 0,
                1, 1, 3, 6,
                1, 2, 3, 4, 5, 6, 5, 5, 6, 7, 1, 2]
    w = torch.tensor(vals, dtype=torch.float32)[None]
    for rule in SCALE_RULES:
        packed, scale = quantize_mxfp4(w, rule)
        assert scale.tolist() == [[127]], rule
        assert codes_of(packed)[0].tolist() == expected, rule
        assert torch.equal(packed[0], pack_codes(expected))  # low nibble = even element


def test_floor_saturates_and_ceil_does_not():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([7.5, -7.9, 2.0, 0.3])
    p, s = quantize_mxfp4(w, "floor")  # floor(log2 7.9) - 2 = 0 -> X = 1: 7.5 and -7.9 clip to +-6
    assert s.item() == 127
    assert dequantize_mxfp4(p, s, torch.float32)[0, :4].tolist() == [6.0, -6.0, 2.0, 0.5]
    p, s = quantize_mxfp4(w, "ceil")  # ceil(log2(7.9 / 6)) = 1 -> X = 2: 3.75 -> 4, -3.95 -> -4, 1, 0.15 -> 0
    assert s.item() == 128
    assert dequantize_mxfp4(p, s, torch.float32)[0, :4].tolist() == [8.0, -8.0, 2.0, 0.0]


def test_scale_rule_definitions_on_random_blocks():
    """Per block: floor puts amax/X in [4, 8); ceil puts it in (3, 6] (X the smallest power of two with 6X >= amax)
    and every element's error is at most X (half the widest E2M1 gap, 4 -> 6); floor violates that bound on the
    blocks it clips. Magnitudes span 2^-30 .. 2^30, and amax sits exactly on 6 * 2^k in some blocks."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32 * 16, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    blocks = w.view(64, 16, 32)
    blocks[::4, 0] = 0.0  # block 0 of every 4th row: amax exactly 6 * 2^k
    blocks[::4, 0, 5] = 6.0 * torch.exp2(torch.randint(-20, 20, (16,), generator=g).float())
    amax = blocks.abs().amax(-1).double()
    for rule in SCALE_RULES:
        p, s = quantize_mxfp4(w, rule)
        x = torch.exp2(s.double() - 127)
        ratio = amax / x
        err = (dequantize_mxfp4(p, s, torch.float32).double() - w.double()).abs().view(64, 16, 32).amax(-1)
        if rule == "floor":
            assert bool(((ratio >= 4) & (ratio < 8)).all())
            assert bool((err[ratio > 7] > x[ratio > 7]).all()) and bool((ratio > 7).any())  # clipped blocks
        else:
            assert bool(((ratio > 3) & (ratio <= 6)).all())
            assert bool((ratio[::4, 0] == 6).all())  # amax = 6 * 2^k gets X = 2^k, not 2^(k+1)
            assert bool((err <= x).all())


def test_nan_and_inf_blocks():
    w = torch.ones(2, 96)
    w[0, 3] = NAN
    w[0, 40] = float("inf")
    w[1, 70] = -float("inf")
    for rule in SCALE_RULES:
        p, s = quantize_mxfp4(w, rule)
        assert s.tolist() == [[255, 255, 125], [125, 125, 255]]  # ones: floor 2^(0-2) = ceil 2^ceil(log2(1/6))
        assert codes_of(p)[0, :64].eq(0).all() and codes_of(p)[1, 64:].eq(0).all()  # NaN blocks: nibbles 0
        d = dequantize_mxfp4(p, s, torch.float32)
        assert d[0, :64].isnan().all() and d[1, 64:].isnan().all()
        assert torch.equal(d[0, 64:], torch.ones(32)) and torch.equal(d[1, :64], torch.ones(64))


def test_zero_and_tiny_blocks():
    w = torch.zeros(1, 128)
    w[0, 32:64] = -0.0
    w[0, 64] = 1e-40  # fp32 subnormal: X = 2^-127 (clamped), 1e-40 / 2^-127 ~ 0.017 -> 0
    w[0, 96] = 1.0
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [[0, 0, 0, 125]]
    assert codes_of(p)[0, 32:64].eq(8).all()  # -0.0 keeps its sign
    d = dequantize_mxfp4(p, s, torch.float32)
    assert_same_bits(d[0, :96], w[0, :96].clone().fill_(0.0).index_fill_(0, torch.arange(32, 64), -0.0))
    assert d[0, 96].item() == 1.0


# ---------------------------------------------------------------- round trips

def _random_valid(rows: int, k: int, seed: int, max_scale: int = 252) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes, scale bytes 0..max_scale (finite decode) plus some 0xFF blocks."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, max_scale + 1, (rows, k // 32), generator=g, dtype=torch.uint8)
    scale[::7, 0] = 255
    scale[1, :] = 0
    return packed, scale


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_decode_requantize_decode_is_exact(rule):
    packed, scale = _random_valid(64, 256, seed=4)
    d = dequantize_mxfp4(packed, scale, torch.float32)
    d2 = dequantize_mxfp4(*quantize_mxfp4(d, rule), torch.float32)
    assert_same_bits(d2, d)  # -0 stays -0 (sign kept), NaN blocks decode to the same NaN bits
    d2b = dequantize_mxfp4(*quantize_mxfp4(to_bf16(d), rule), torch.bfloat16)
    assert_same_bits(d2b, to_bf16(d))


def test_floor_reencoding_reproduces_the_bytes():
    """FLOOR idempotence: re-encoding a decoded tensor gives the same scale bytes and the same packed bytes, compared
    exactly (the encoder keeps the sign of zeros, so -0 nibbles (code 8) come back as code 8; no +-0 folding is
    needed). Holds for blocks whose largest code is 4 or 6; random blocks are forced to contain one. NaN blocks
    keep scale 0xFF but their nibbles become 0, so they are compared on the scale only."""
    packed, scale = _random_valid(64, 256, seed=5)
    codes = codes_of(packed).view(64, 8, 32)
    codes[..., 9] = torch.randint(6, 8, (64, 8), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    codes = codes.view(64, 256)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    p2, s2 = quantize_mxfp4(dequantize_mxfp4(packed, scale, torch.float32), "floor")
    assert torch.equal(s2, scale)
    finite = (scale != 255).repeat_interleave(16, dim=1)
    assert torch.equal(p2[finite], packed[finite])
    assert bool(p2[~finite].eq(0).all()) and bool((~finite).any())


def test_ceil_reencoding_keeps_values_but_not_always_bytes():
    w = torch.zeros(1, 32)
    w[0, 0] = 3.0  # ceil: X = 2^ceil(log2(0.5)) = 0.5 -> code 7 (6 * 0.5), scale 126
    p, s = quantize_mxfp4(w, "ceil")
    assert s.item() == 126 and codes_of(p)[0, 0].item() == 7
    p_in = pack_codes([5] + [0] * 31)[None]  # 3.0 at scale 127: a valid encoding ceil would not produce
    d = dequantize_mxfp4(p_in, torch.tensor([[127]], dtype=torch.uint8), torch.float32)
    p2, s2 = quantize_mxfp4(d, "ceil")
    assert s2.item() == 126 and torch.equal(dequantize_mxfp4(p2, s2, torch.float32), d)


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_representable_values_round_trip_exactly(rule):
    """E2M1 values times a per-block power of two 2^-100 .. 2^100 are reproduced bit for bit (fp32 and bf16)."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (32, 4, 32), generator=g)
    exps = torch.randint(-100, 101, (32, 4, 1), generator=g).double()
    w = (E2M1_VALUES[codes].double() * torch.exp2(exps)).float().view(32, 128)
    for dtype in (torch.float32, torch.bfloat16):
        wd = w.to(dtype)
        assert_same_bits(dequantize_mxfp4(*quantize_mxfp4(wd, rule), dtype), wd)


# ---------------------------------------------------------------- error on Gaussian weights

def test_relative_rms_error_on_gaussian_weights():
    """Reference (mxfp4-and-lora.md 5.1): 0.1150 floor, 0.1154 ceil; 29.6 % of Gaussian blocks clip under floor."""
    w = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0))
    errs = {rule: relative_rms_error(w, rule) for rule in SCALE_RULES}
    print(f"MXFP4 relative RMS error, 256x4096 N(0,1), seed 0: floor {errs['floor']:.5f}, ceil {errs['ceil']:.5f}")
    # measured: floor 0.11490, ceil 0.11548
    assert 0.112 < errs["floor"] < 0.118 and 0.112 < errs["ceil"] < 0.118, errs
    p, s = quantize_mxfp4(w, "floor")
    amax = w.view(256, 128, 32).abs().amax(-1)
    clipped = (amax / torch.exp2(s.float() - 127) > 6).float().mean().item()
    zeros = (codes_of(p) & 7).eq(0).float().mean().item()
    print(f"floor: {clipped:.3f} of blocks clip their max, {zeros:.3f} of weights round to zero")
    assert 0.27 < clipped < 0.32 and 0.08 < zeros < 0.12


# ---------------------------------------------------------------- sizes and argument checks

def test_nbytes():
    assert mxfp4_nbytes(3072, 3584) == 3072 * 1792 + 3072 * 112
    assert 2 * mxfp4_nbytes(3072, 3584) + mxfp4_nbytes(3584, 3072) == 17_547_264  # one K3 routed expert
    p, s = quantize_mxfp4(torch.randn(96, 320))
    assert p.numel() + s.numel() == mxfp4_nbytes(96, 320)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_nbytes(8, 48)


def test_bad_arguments_raise_useful_errors():
    p = torch.zeros(4, 16, dtype=torch.uint8)
    s = torch.zeros(4, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"K=48 .*\(4, 48\).*multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_mxfp4(torch.zeros(4, 32), "nearest")
    with pytest.raises(ValueError, match="float tensor"):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed must be a uint8"):
        dequantize_mxfp4(p.to(torch.int8), s)
    with pytest.raises(ValueError, match="scale must be a uint8 tensor"):
        dequantize_mxfp4(p, s.to(torch.int32))
    with pytest.raises(ValueError, match=r"scale must have shape \(4, 1\).*got \(4, 2\)"):
        dequantize_mxfp4(p, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scale must have shape \(4, 1\).*got \(2, 1\)"):
        dequantize_mxfp4(p, torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        dequantize_mxfp4(torch.zeros(4, 8, dtype=torch.uint8), s)
    with pytest.raises(ValueError, match="bfloat16 or torch.float32"):
        dequantize_mxfp4(p, s, torch.float16)
    with pytest.raises(ValueError, match=r"scale must have shape \(4, 1\)"):
        dequantize_mxfp4_reference(p, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed must be a uint8"):
        dequantize_mxfp4_reference(p.float(), s)
    assert GROUP_SIZE == 32


def test_triton_entry_point_rejects_cpu_tensors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        dequantize_mxfp4_triton(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


def test_module_import_leaves_triton_out_and_the_interpreted_kernel_decodes_hand_worked_bytes():
    """Importing the format module imports no triton (the model imports it on CPU-only machines); the Triton
    kernel is defined on first use and, under the interpreter, decodes bytes worked out by hand: byte 0x92 =
    codes (low 2 -> 1.0, high 9 -> -0.5) at scale 128 (x2) -> 2.0, -1.0; a 0xFF block is NaN; scale 0 keeps
    code 7 (6.0) as 6 * 2^-127."""
    from kernel_testing import interpreted

    out = interpreted(
        "import sys, torch\n"
        "import miles_k3.kernels.mxfp4 as m\n"
        "assert 'triton' not in sys.modules\n"
        "p = torch.zeros(3, 16, dtype=torch.uint8); p[0, 0] = 0x92; p[2, 0] = 0x07\n"
        "s = torch.tensor([[128], [255], [0]], dtype=torch.uint8)\n"
        "o = m.dequantize_mxfp4_triton(p, s, torch.float32)\n"
        "print(o[0, :3].tolist(), o[1].isnan().all().item(), o[2, 0].item() == 6 * 2.0 ** -127)\n", timeout=300)
    assert out.strip().splitlines()[-1] == "[2.0, -1.0, 0.0] True True"
