"""The sampler's keyed noise, pure torch (no Triton: the rollout engine imports it on any machine): Exp(1)
variates that are a pure function of (key, position, token id). This is the one definition; the Triton sampling
kernel (`sampling.py`) has a twin of each part, tested bit for bit against these.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32_int64(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding values in [0, 2^32); every
    product stays below 2^63, so it is exact on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 16)


def noise_row_keys(keys_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
    """The per-row part of `keyed_exp_noise`: int64 [B, 2] holding (k, mix32(k ^ 0x85EBCA6B)) per row,
    values in [0, 2^32), where k mixes both 32-bit halves of the key with the position. keys_B / positions_B:
    int64 [B] on any device (the result is on theirs). The kernel has a Triton twin of this
    (`_noise_row_keys`) and of `exp_noise_from_row_keys` (`_log_exp_noise`), tested bit for bit against
    them."""
    k_B = _mix32_int64(keys_B & _M32) ^ _mix32_int64(((keys_B >> 32) & _M32) ^ 0x9E3779B9)
    k_B = _mix32_int64(k_B ^ (positions_B & _M32))
    return torch.stack([k_B, _mix32_int64(k_B ^ 0x85EBCA6B)], dim=1)


def exp_noise_from_row_keys(row_keys_B2: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [B, V] Exp(1) variates of token ids 0..V-1 from `noise_row_keys` (the per-token part of
    `keyed_exp_noise`): a hash of (row key, token id) -> a 23-bit uniform u in (0, 1) -> -log(u)."""
    k_B, kx_B = row_keys_B2.unbind(1)
    v_V = torch.arange(vocab, device=row_keys_B2.device, dtype=torch.int64)
    h_BV = _mix32_int64((k_B[:, None] + v_V[None, :] * 0x9E3779B1) & _M32)
    h_BV = _mix32_int64(h_BV ^ kx_B[:, None])
    # 23-bit uniforms on the midpoints (i + 0.5) / 2^23: in [2^-24, 1 - 2^-24], all exact in fp32, so u is
    # never 0 or 1 (a 24-bit midpoint grid rounds its top point up to 1.0: E = 0 would force that token).
    u_BV = ((h_BV >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(u_BV)


def keyed_exp_noise(keys_B: torch.Tensor, positions_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [B, V] Exp(1) variates that are a pure function of (key, position, token id): counter-based, so a
    whole batch draws in a few kernels, with no generator state, and a row never depends on the others.
    keys_B: int64 [B] (e.g. a request's seed), positions_B: int64 [B] (its output index). 23-bit uniforms.
    This is the reference definition (`miles_k3.rollout.sampling` re-exports it); the kernel reproduces it bit
    for bit."""
    return exp_noise_from_row_keys(noise_row_keys(keys_B, positions_B), vocab)
