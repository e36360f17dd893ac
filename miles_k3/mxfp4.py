"""MXFP4 codec (pure torch): quantize float weights to packed FP4 E2M1 + E8M0 block scales, and decode them.

Format (OCP Microscaling v1.0, as stored by compressed-tensors `mxfp4-pack-quantized` in the Kimi K3 checkpoint):
a weight W [..., K] (K a multiple of 32) is cut along its last dim into blocks of 32 elements; each block has one
E8M0 scale byte s (value X = 2^(s - 127), 0 <= s <= 254; s = 0xFF marks a NaN block) and 32 FP4 E2M1 codes (1 sign,
2 exponent, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0), and element i decodes to
X * E2M1(code_i). Storage: `packed` uint8 [..., K/2] with element 2j in the LOW nibble of byte j and element 2j+1 in
the HIGH nibble, and `scale` uint8 [..., K/32]: 4.25 bits per value. Decoding to bf16 or fp32 is exact.

Encoder choices (all fixed, so tests can pin them): elements are V/X rounded to the nearest E2M1 value, ties to
the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), |V/X| > 6 saturates to 6;
the sign is always kept, so a small negative (and -0.0) encodes as code 8 (-0), like torchao and triton_kernels.
A block containing NaN or +-Inf gets scale 0xFF and all-zero nibbles. A block whose amax is below 2^-126 (all
zeros included) gets scale 0 (X = 2^-127). Scale exponents are clamped to the E8M0 range [-127, 127].
"""
from __future__ import annotations

import math

import torch

GROUP_SIZE = 32  # = miles_k3.kernels.mxfp4.GROUP_SIZE; not imported from there (that would import triton)
SCALE_RULES = ("floor", "ceil")

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_CHUNK_ELEMS = 1 << 22  # elements per row chunk of quantize_mxfp4 (~4 fp32-sized temporaries of this size)


def _rtne_bounds(device: torch.device) -> torch.Tensor:
    """Decision points between consecutive E2M1 magnitudes for torch.bucketize (right=False counts boundaries
    strictly below |q|). A midpoint whose upper neighbour has the even code (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4) is
    replaced by the next fp32 value below it, so that the tie itself counts and goes up; the other midpoints
    (0.25, 1.25, 2.5, 5) stay, so their ties go down to the even code."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
    tie_up = torch.tensor([False, True, False, True, False, True, False])
    below = torch.nextafter(mids, torch.zeros_like(mids))
    return torch.where(tie_up, below, mids).to(device)


def quantize_mxfp4(w: torch.Tensor, scale_rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [..., K] (bf16/fp16/fp32/fp64, K % 32 == 0) to MXFP4, computing in fp32.

    Returns (packed uint8 [..., K/2], scale uint8 [..., K/32]) on w's device. Scale rules (amax = max |V| of a
    block, exponents computed exactly from frexp, never from a rounded log2):
      * "floor" (OCP; what compressed-tensors writes): X = 2^(floor(log2(amax)) - 2); amax/X lies in [4, 8), so the
        block max clips to 6 when amax/X > 6.
      * "ceil": X = 2^ceil(log2(amax / 6)), the smallest power of two with 6 X >= amax: never clips.
    Works over row chunks of about 4M elements, so the fp32 temporaries are bounded by the chunk, not by w (a
    non-contiguous w is first copied by reshape in its own dtype).
    """
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"quantize_mxfp4: scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if not isinstance(w, torch.Tensor) or w.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"quantize_mxfp4: w must be a float tensor (bf16/fp16/fp32/fp64), got "
                         f"{getattr(w, 'dtype', type(w))}")
    if w.dim() < 1:
        raise ValueError("quantize_mxfp4: w must have at least one dim [..., K], got a 0-d tensor")
    k = w.shape[-1]
    if k % GROUP_SIZE:
        padded = -(-k // GROUP_SIZE) * GROUP_SIZE
        raise ValueError(f"quantize_mxfp4: the last dim K={k} of w {tuple(w.shape)} must be a multiple of "
                         f"{GROUP_SIZE} (one E8M0 scale per {GROUP_SIZE} elements); zero-pad it to {padded} or "
                         "quantize the weight with the blocked dim last")
    n_groups = k // GROUP_SIZE
    lead = w.shape[:-1]
    packed = torch.empty(*lead, k // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(*lead, n_groups, dtype=torch.uint8, device=w.device)
    if w.numel() == 0:
        return packed, scale
    w2 = w.reshape(-1, k)
    p2 = packed.view(-1, k // 2)
    s2 = scale.view(-1, n_groups)
    bounds = _rtne_bounds(w.device)
    step = max(1, _CHUNK_ELEMS // k)
    for r0 in range(0, w2.shape[0], step):
        r1 = min(w2.shape[0], r0 + step)
        x = w2[r0:r1].to(torch.float32).view(r1 - r0, n_groups, GROUP_SIZE)  # may alias w: never written
        amax = torch.maximum(x.amax(-1), -x.amin(-1))  # NaN propagates
        finite = torch.isfinite(amax)
        mant, ex = torch.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1)
        if scale_rule == "floor":
            e = ex - 3  # floor(log2(amax)) = ex - 1
        else:  # smallest e with 6 * 2^e >= mant * 2^ex: e - ex = -3 if mant <= 0.75 (mant/6 <= 1/8), else -2
            e = ex - 2 - (mant <= 0.75).to(ex.dtype)
        tiny = ~(amax >= 2.0 ** -126)  # zeros, fp32 subnormals (and NaN, handled by `finite`): exponent -127
        e = torch.where(tiny, -127, e).clamp_(-127, 127)
        s2[r0:r1] = torch.where(finite, e + 127, 255).to(torch.uint8)
        inv = ((1023 - e.to(torch.int64)) << 52).view(torch.float64).to(torch.float32)  # 2^-e, exact
        q = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # contiguous even when x is a strided view
        torch.mul(x, inv.unsqueeze(-1), out=q)  # exact: scaling by a power of two (no overflow: amax/X < 8)
        q.masked_fill_(~finite.unsqueeze(-1), 0.0)
        neg = torch.signbit(q)
        codes = torch.bucketize(q.abs_(), bounds, out_int32=True).to(torch.uint8)
        codes.add_(neg.to(torch.uint8), alpha=8)
        codes = codes.view(r1 - r0, k)
        torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=p2[r0:r1])
    return packed, scale


def _check_packed_scale(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() < 1:
        raise ValueError(f"dequantize_mxfp4: packed must be a uint8 tensor [..., K/2] (two E2M1 codes per byte), "
                         f"got {getattr(packed, 'dtype', type(packed))} {tuple(getattr(packed, 'shape', ()))}")
    if packed.shape[-1] % (GROUP_SIZE // 2):
        raise ValueError(f"dequantize_mxfp4: packed {tuple(packed.shape)} must have a last dim K/2 that is a multiple "
                         f"of {GROUP_SIZE // 2} (K a multiple of {GROUP_SIZE})")
    expected = (*packed.shape[:-1], packed.shape[-1] * 2 // GROUP_SIZE)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: scale must be a uint8 tensor {expected} ([..., K/32] E8M0 exponents "
                         f"for packed {tuple(packed.shape)}), got {getattr(scale, 'dtype', type(scale))}")
    if tuple(scale.shape) != expected:
        raise ValueError(f"dequantize_mxfp4: scale must have shape {expected} ([..., K/32] for packed "
                         f"{tuple(packed.shape)}, same leading dims), got {tuple(scale.shape)}")
    if packed.device != scale.device:
        raise ValueError(f"dequantize_mxfp4: packed is on {packed.device} but scale on {scale.device}")


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode packed uint8 [..., K/2] + scale uint8 [..., K/32] to [..., K] in `dtype` (bf16 or fp32; exact).

    CUDA tensors use the Triton kernel (`miles_k3.kernels.mxfp4.dequantize_mxfp4_triton`, made contiguous first),
    other devices the pure-torch reference; both give the same bits. The kernels module (and triton) is imported
    on first use.
    """
    _check_packed_scale(packed, scale)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dequantize_mxfp4: dtype must be torch.bfloat16 or torch.float32 (exact decode), got "
                         f"{dtype}; decode to one of those and cast")
    if packed.is_cuda:
        from miles_k3.kernels.mxfp4 import dequantize_mxfp4_triton
        return dequantize_mxfp4_triton(packed.contiguous(), scale.contiguous(), dtype)
    from miles_k3.kernels.mxfp4 import dequantize_mxfp4_reference
    return dequantize_mxfp4_reference(packed, scale, dtype)


def mxfp4_nbytes(out_features: int, in_features: int) -> int:
    """Bytes of one MXFP4 [out, in] weight: packed (out * in / 2) + scales (out * in / 32); in % 32 == 0."""
    if in_features % GROUP_SIZE:
        raise ValueError(f"mxfp4_nbytes: in_features={in_features} must be a multiple of {GROUP_SIZE}")
    return out_features * in_features // 2 + out_features * in_features // GROUP_SIZE


def relative_rms_error(w: torch.Tensor, scale_rule: str = "floor") -> float:
    """||dequant(quantize(w)) - w|| / ||w|| (fp32 decode, fp64 sums) for a finite, non-zero w [..., K]."""
    packed, scale = quantize_mxfp4(w, scale_rule)
    err = (dequantize_mxfp4(packed, scale, torch.float32).double() - w.double()).pow(2).sum()
    return math.sqrt(err.item() / w.double().pow(2).sum().item())
