"""MXFP4, the format of the K3 routed experts: quantize (pure torch), decode (a pure-torch reference and a Triton
kernel bitwise equal to it), and byte counts.

Format (OCP Microscaling v1.0, as stored by compressed-tensors `mxfp4-pack-quantized` in the Kimi K3 checkpoint):
a weight W [..., K] (K a multiple of 32) is cut along its last dim into blocks of 32 elements; each block has one
E8M0 scale byte s (value X = 2^(s - 127), 0 <= s <= 254; s = 0xFF marks a NaN block) and 32 FP4 E2M1 codes (1 sign,
2 exponent, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0), and element i decodes to
X * E2M1(code_i). Storage: `packed` uint8 [..., K/2] with element 2j in the LOW nibble of byte j and element 2j+1 in
the HIGH nibble, and `scale` uint8 [..., K/32]: 4.25 bits per value. Scale 0 means 2^-127 (not zero). Decoding to
bf16 or fp32 is exact (E2M1 has one mantissa bit; bf16 holds 2^-133 ... 2^127); products of 2^128 and more (scale
bytes 253, 254 with codes >= 4 / 2) overflow to +-Inf in both dtypes, the same way in both implementations.

Encoder choices (all fixed, so tests can pin them): elements are V/X rounded to the nearest E2M1 value, ties to
the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), |V/X| > 6 saturates to 6;
the sign is always kept, so a small negative (and -0.0) encodes as code 8 (-0), like torchao and triton_kernels.
A block containing NaN or +-Inf gets scale 0xFF and all-zero nibbles. A block whose amax is below 2^-126 (all
zeros included) gets scale 0 (X = 2^-127). Scale exponents are clamped to the E8M0 range [-127, 127].

This module imports torch only; triton is imported, and the Triton kernel defined, on the first
`dequantize_mxfp4_triton` call (launching it needs CUDA, or `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import math
import os

import torch

# E2M1 code -> value. Codes 0..7: 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6; codes 8..15: their negatives (8 = -0.0).
# A CPU fp32 tensor: index it with int64 codes, or `.to(dtype, device)` a copy first. Do not modify it in place.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)

GROUP_SIZE = 32  # elements per E8M0 scale
SCALE_RULES = ("floor", "ceil")
OUT_DTYPES = (torch.bfloat16, torch.float32)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_CHUNK_ELEMS = 1 << 22  # elements per row chunk of quantize_mxfp4 (~4 fp32-sized temporaries of this size)
_REF_CHUNK_BYTES = 1 << 22  # packed bytes per row chunk in the reference (bounds its int32 index temporary)
_BLOCK_G = 128  # scale groups (32 outputs each) per Triton program
_NUM_WARPS = 4


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


def _check_inputs(fn: str, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> int:
    """Validate dtypes and shapes; return K (elements per row)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"{fn}: packed must be a uint8 tensor [..., K/2], got "
                         f"{getattr(packed, 'dtype', type(packed))}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise ValueError(f"{fn}: scale must be a uint8 tensor [..., K/32] (E8M0 exponents), got "
                         f"{getattr(scale, 'dtype', type(scale))}")
    if packed.dim() < 1:
        raise ValueError(f"{fn}: packed must have at least one dim [..., K/2], got a 0-d tensor")
    n_groups = packed.shape[-1] // (GROUP_SIZE // 2)
    if packed.shape[-1] % (GROUP_SIZE // 2):
        raise ValueError(f"{fn}: packed's last dim ({packed.shape[-1]}) must be a multiple of 16 "
                         f"(K/2 with K a multiple of 32), got packed shape {tuple(packed.shape)}")
    expected = (*packed.shape[:-1], n_groups)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{fn}: scale must have shape {expected} ([..., K/32] for packed {tuple(packed.shape)}), "
                         f"got {tuple(scale.shape)}")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{fn}: dtype must be torch.bfloat16 or torch.float32 (exact decode), got {dtype}; "
                         "decode to one of those and cast")
    if packed.device != scale.device:
        raise ValueError(f"{fn}: packed ({packed.device}) and scale ({scale.device}) must be on the same device")
    return packed.shape[-1] * 2


def _block_pow2(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^(s - 127) per scale byte, built exactly from float64 bits (s = 0 -> 2^-127, an fp32/bf16 subnormal;
    s = 255 -> 2^128 = Inf in fp32/bf16, masked to NaN by the caller)."""
    return ((scale.to(torch.int64) + (1023 - 127)) << 52).view(torch.float64).to(dtype)


def dequantize_mxfp4_reference(packed: torch.Tensor, scale: torch.Tensor,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pure-torch MXFP4 decode on any device.

    packed uint8 [..., K/2], scale uint8 [..., K/32] -> [..., K] in `dtype` (torch.bfloat16 or torch.float32).
    Each byte is looked up in a 256-entry (low, high) pair table in `dtype` straight into the output (which also
    interleaves the nibbles), then multiplied in place by the block's power of two; 0xFF blocks are filled with
    NaN (bits 0x7FC00000 / 0x7FC0). Works in row chunks: besides the output, the only large temporary is an int32
    index of at most 4 MiB of packed bytes.
    """
    k = _check_inputs("dequantize_mxfp4_reference", packed, scale, dtype)
    lead = packed.shape[:-1]
    n_groups = k // GROUP_SIZE
    out = torch.empty(*lead, k, dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    p2 = packed.reshape(-1, k // 2)
    s2 = scale.reshape(-1, n_groups)
    o2 = out.view(-1, k)
    lut = E2M1_VALUES.to(device=packed.device, dtype=dtype)
    codes = torch.arange(256, device=packed.device)
    pair = torch.stack([lut[codes & 15], lut[codes >> 4]], dim=1)  # [256, 2]: (low nibble, high nibble)
    rows = p2.shape[0]
    step = max(1, _REF_CHUNK_BYTES // max(1, k // 2))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blk = o2[r0:r1]
        torch.index_select(pair, 0, p2[r0:r1].reshape(-1).to(torch.int32), out=blk.view(-1, 2))
        sc = s2[r0:r1]
        vals = blk.view(r1 - r0, n_groups, GROUP_SIZE)
        vals.mul_(_block_pow2(sc, dtype).unsqueeze(-1))
        vals.masked_fill_((sc == 255).unsqueeze(-1), float("nan"))
    return out


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode packed uint8 [..., K/2] + scale uint8 [..., K/32] to [..., K] in `dtype` (bf16 or fp32; exact).

    CUDA tensors use the Triton kernel (`dequantize_mxfp4_triton`, made contiguous first), other devices the
    pure-torch reference; both give the same bits.
    """
    _check_inputs("dequantize_mxfp4", packed, scale, dtype)
    if packed.is_cuda:
        return dequantize_mxfp4_triton(packed.contiguous(), scale.contiguous(), dtype)
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


# ---- the Triton kernel, defined on first use ---------------------------------------------------------------
_mxfp4_dequant_kernel = None  # the @triton.jit kernel once _define_kernel() ran


def _define_kernel():
    """Import triton and define the decode kernel and its helper as module globals (Triton resolves the names a
    kernel uses, `tl` and the helper, in its module's globals). Idempotent; returns the kernel."""
    global triton, tl, _e2m1_times_pow2_fp32_bits, _mxfp4_dequant_kernel
    if _mxfp4_dequant_kernel is not None:
        return _mxfp4_dequant_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _e2m1_times_pow2_fp32_bits(code, s):
        """fp32 bit pattern (int32) of E2M1_VALUES[code] * 2^(s - 127), built with integer ops only (no float
        multiply, so no flush-to-zero or approximate exp2 can change a bit). code: int32 0..15; s: int32 0..254."""
        mag = code & 7
        e_field = mag >> 1
        # value = (1 + mant/2) * 2^e_rel for codes 1..7; code 1 (0.5, the E2M1 subnormal) is 1.0 * 2^-1
        mant = tl.where(e_field > 0, mag & 1, 0)
        e_rel = tl.where(e_field > 0, e_field - 1, -1)
        b = s + e_rel  # biased fp32 exponent of the product, -1 ..= 256
        normal = (b << 23) | (mant << 22)
        # b in {-1, 0}: fp32 subnormal, bits = value / 2^-149 = (2 + mant) << (b + 21)
        subnormal = tl.where(b == 0, (2 + mant) << 21, (2 + mant) << 20)
        bits = tl.where(b > 0, normal, subnormal)
        bits = tl.where(b >= 255, 0x7F800000, bits)  # >= 2^128: Inf, as an IEEE multiply rounds it
        bits = tl.where(mag == 0, 0, bits)
        return bits | ((code >> 3) << 31)  # sign bit (code 8 -> -0.0)


    @triton.jit
    def _mxfp4_dequant_kernel(packed_ptr, scale_ptr, out_ptr, n_groups, BLOCK_G: tl.constexpr,
                              OUT_BF16: tl.constexpr):
        """One program decodes BLOCK_G consecutive scale groups of the flattened tensor: 16*BLOCK_G packed bytes ->
        32*BLOCK_G outputs, written as raw bits (out_ptr is an int16 view for bf16, an int32 view for fp32)."""
        pid = tl.program_id(0).to(tl.int64)
        first = pid * BLOCK_G
        packed_ptr += first * 16
        scale_ptr += first
        out_ptr += first * 32
        g = tl.arange(0, BLOCK_G)
        gmask = g < (n_groups - first)
        s = tl.load(scale_ptr + g, mask=gmask, other=0).to(tl.int32)[:, None]  # [BLOCK_G, 1]
        byte = tl.load(packed_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], mask=gmask[:, None],
                       other=0).to(tl.int32)  # [BLOCK_G, 16]
        lo = _e2m1_times_pow2_fp32_bits(byte & 15, s)  # element 2j: low nibble
        hi = _e2m1_times_pow2_fp32_bits(byte >> 4, s)  # element 2j+1: high nibble
        bits = tl.interleave(lo, hi)  # [BLOCK_G, 32]
        bits = tl.where(s == 255, 0x7FC00000, bits)  # NaN block: the canonical quiet NaN, like masked_fill(nan)
        offs = g[:, None] * 32 + tl.arange(0, 32)[None, :]
        if OUT_BF16:
            # every product is exact in bf16, so its bits are the top half of the fp32 bits (truncating cast)
            tl.store(out_ptr + offs, (bits >> 16).to(tl.int16), mask=gmask[:, None])
        else:
            tl.store(out_ptr + offs, bits, mask=gmask[:, None])

    return _mxfp4_dequant_kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dequantize_mxfp4_triton(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton MXFP4 decode, bitwise equal to `dequantize_mxfp4_reference` (NaN blocks, scale 0, -0 included).

    packed uint8 [..., K/2], scale uint8 [..., K/32], both contiguous CUDA tensors on one device (any device
    under TRITON_INTERPRET=1) -> [..., K] in `dtype` (torch.bfloat16 or torch.float32). Leading dims are
    flattened. `out`, if given, must be a contiguous [..., K] tensor of `dtype` on the same device; it is filled
    and returned.
    """
    fn = "dequantize_mxfp4_triton"
    k = _check_inputs(fn, packed, scale, dtype)
    if not _interpreting() and not packed.is_cuda:
        raise ValueError(f"{fn}: packed and scale must be CUDA tensors, got {packed.device}; "
                         "use dequantize_mxfp4_reference on other devices")
    if not packed.is_contiguous() or not scale.is_contiguous():
        raise ValueError(f"{fn}: packed and scale must be contiguous "
                         f"(packed {packed.is_contiguous()}, scale {scale.is_contiguous()}); call .contiguous()")
    shape = (*packed.shape[:-1], k)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    elif (tuple(out.shape) != shape or out.dtype != dtype or out.device != packed.device
          or not out.is_contiguous()):
        raise ValueError(f"{fn}: out must be a contiguous {dtype} tensor of shape {shape} on {packed.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})")
    n_groups = scale.numel()
    if n_groups == 0:
        return out
    bits = out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    kernel = _define_kernel()
    grid = (triton.cdiv(n_groups, _BLOCK_G),)
    if packed.is_cuda:
        with torch.cuda.device(packed.device):
            kernel[grid](packed, scale, bits, n_groups, BLOCK_G=_BLOCK_G,
                                        OUT_BF16=dtype == torch.bfloat16, num_warps=_NUM_WARPS)
    else:
        kernel[grid](packed, scale, bits, n_groups, BLOCK_G=_BLOCK_G,
                                    OUT_BF16=dtype == torch.bfloat16, num_warps=_NUM_WARPS)
    return out
