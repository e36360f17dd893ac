"""Fused unfiltered sampler: one Triton launch that does log-softmax, keyed exponential-race noise and argmax.

It is the fast path of `miles_k3.rollout.sampling.sample` for batches in which no row filters (no top-k, top-p
or min-p; greedy rows never filter). Per row b, with z_v = float32(logits[b, v]) / T_b (IEEE division; T_b = 1
for greedy rows):

    lse_b    = log(sum_v exp(z_v))                          (online max / sum-exp over V)
    score_v  = z_v                                          greedy rows
    score_v  = z_v - log(E_v),  E_v = -log(u_v)             sampled rows (u_v: the 23-bit keyed uniform)
    id_b     = the lowest v of maximal score_v               (a NaN score counts as the maximum, as in torch)
    logprob  = z[id_b] - lse_b

E_v is the keyed noise `keyed_exp_noise`, defined here in torch (its one definition: the torch path of
`miles_k3.rollout.sampling.sample` draws it too), an integer hash -> uniform -> -log(u). The kernel does
both parts of that hash, the per-row one (`noise_row_keys`: key and position -> (k_b, mix32(k_b ^
0x85EBCA6B))) and the per-token one (`exp_noise_from_row_keys`), in uint32 arithmetic, whose wrap-around
equals the int64-with-0xFFFFFFFF-mask arithmetic of the torch code, so the 23-bit integer behind u_v is
bit-identical. (The per-row part runs in the kernel rather than in torch on the host: on the host it is ~50
tiny torch ops, ~0.1-0.2 ms a step, several times the kernel itself.) u_v = (float32(h >> 9) + 0.5) * 2^-23 is
the same fp32 add and (exact) multiply, and `tl.log` lowers to libdevice `__nv_logf`, the `logf` torch's CUDA
`log` uses, so E_v and log(E_v) are the same fp32 values as torch's on the same GPU (test_gpu_noise_bits,
H200, Triton 3.6). `/` in Triton is the approximate `div.full.f32`, so z uses `tl.div_rn` (IEEE, like torch's
division). u_v lies in [2^-24, 1 - 2^-24] (exact fp32 midpoints): E_v is never 0 or infinite.

Ties: the kernel does not use `tl.argmax`. Each lane j keeps its best (score, id) over ids j, j + BLOCK_V, ...
with a strict `>` (the first of equal scores stays), and the lanes are merged by taking the smallest id among
those at the maximum, so the lowest id wins like `torch.argmax`; a NaN score is taken over anything not NaN.

Difference from the torch path, stated precisely: torch ranks sampled rows by fl(fl(z - lse) - log E) and
greedy rows by fl(z - lse), with torch's own lse; the kernel ranks by fl(z - log E) and z. Subtracting a
common lse is order-preserving in exact arithmetic and fp32 subtraction is monotone, so the two argmaxes can
differ only when the top two scores are within a few ulp of each other (a rounding near-tie; for continuous
noise this has probability of order 1e-7 per row), never otherwise. Logprobs differ by the lse rounding (order
1e-6 at V = 32768, since `tl.exp` is the approximate ex2-based exp). Exact ties (same score) go to the lowest
id in both. A temperature so small that it is 0 in fp32 makes the row greedy here (the torch path divides by 0
there).

Reference: `sample_unfiltered_reference` (pure torch, any device) restates the torch path of `sample` for
these inputs. This module imports torch and triton only; launching the kernel needs CUDA (or
`TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from miles_k3.kernels.noise import keyed_exp_noise

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_BLOCK_V = 2048  # vocabulary entries per loop iteration of a program (one program per row)
_NUM_WARPS = 8


def _check_inputs(fn: str, logits_BV: torch.Tensor, temperature_B: torch.Tensor, keys_B: torch.Tensor,
                  positions_B: torch.Tensor) -> None:
    """Validate dtypes, shapes and devices (no value checks: those would synchronise with the GPU)."""
    if not isinstance(logits_BV, torch.Tensor) or logits_BV.dim() != 2 or logits_BV.dtype not in LOGIT_DTYPES:
        raise ValueError(f"{fn}: logits_BV must be a 2-d float32/bfloat16/float16 tensor [B, V], got "
                         f"{getattr(logits_BV, 'dtype', type(logits_BV))} of shape "
                         f"{tuple(getattr(logits_BV, 'shape', ()))}")
    B, V = logits_BV.shape
    if V < 1:
        raise ValueError(f"{fn}: the vocabulary (logits_BV.shape[1]) must be >= 1, got shape {(B, V)}")
    want = {"temperature_B": (temperature_B, torch.float32, (B,)), "keys_B": (keys_B, torch.int64, (B,)),
            "positions_B": (positions_B, torch.int64, (B,))}
    for name, (t, dtype, shape) in want.items():
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {name} must be a {dtype} tensor of shape {shape} (B={B} logits rows), "
                             f"got {getattr(t, 'dtype', type(t))} of shape {tuple(getattr(t, 'shape', ()))}")
        if t.device != logits_BV.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but logits_BV is on {logits_BV.device}; "
                             "move every input to the logits' device")


# The keyed noise's one definition is pure torch (`noise.py`, importable without Triton); its twins are below.
# ---- reference and kernel ----------------------------------------------------------------------------------
def sample_unfiltered_reference(logits_BV: torch.Tensor, temperature_B: torch.Tensor, keys_B: torch.Tensor,
                                positions_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `sample_unfiltered` on any device (same arguments and results): exactly the
    torch path of `miles_k3.rollout.sampling.sample` when no row filters."""
    _check_inputs("sample_unfiltered_reference", logits_BV, temperature_B, keys_B, positions_B)
    greedy_B = temperature_B == 0
    z_BV = logits_BV.float() / torch.where(greedy_B, 1.0, temperature_B)[:, None]
    logp_BV = torch.log_softmax(z_BV, dim=-1)
    noise_BV = keyed_exp_noise(keys_B, positions_B, logits_BV.shape[1])
    ids_B = torch.where(greedy_B[:, None], logp_BV, logp_BV - torch.log(noise_BV)).argmax(dim=-1)
    return ids_B, logp_BV.gather(1, ids_B[:, None]).squeeze(1)


@triton.jit
def _mix32(x):
    """`_mix32_int64` on uint32 (shifts are logical, products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x31848BAB
    return x ^ (x >> 16)


@triton.jit
def _noise_row_keys(key, pos):
    """`noise_row_keys` of one row: int64 scalars key, position -> uint32 (k, kx).
    Casting int64 to uint32 keeps the low 32 bits (`& 0xFFFFFFFF`); `>> 32` on int64 is arithmetic in both."""
    k = _mix32(key.to(tl.uint32)) ^ _mix32((key >> 32).to(tl.uint32) ^ 0x9E3779B9)
    k = _mix32(k ^ pos.to(tl.uint32))
    return k, _mix32(k ^ 0x85EBCA6B)


@triton.jit
def _isnan(x):
    return x != x  # noqa: PLR0124 (the portable NaN test inside a Triton kernel)


@triton.jit
def _log_exp_noise(k, kx, ids):
    """log(E) of token ids `ids` (int32) for one row's keys k, kx (uint32 scalars from `_noise_row_keys`): the
    per-token part of `exp_noise_from_row_keys`, then log, as fp32 (u in [2^-24, 1 - 2^-24]: E > 0, finite)."""
    h = _mix32(k + ids.to(tl.uint32) * 0x9E3779B1)
    h = _mix32(h ^ kx)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return tl.log(-tl.log(u))


@triton.jit
def _sample_unfiltered_kernel(logits_ptr, stride_row, temp_ptr, keys_ptr, pos_ptr, ids_ptr, logp_ptr, V,
                              BLOCK_V: tl.constexpr):
    """One program per row; loops over V in BLOCK_V chunks keeping per-lane state (lane j sees ids j,
    j + BLOCK_V, ... in increasing order), so the loop has no cross-lane reductions; lanes merge at the end.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    temp = tl.load(temp_ptr + row)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp)
    k, kx = _noise_row_keys(tl.load(keys_ptr + row), tl.load(pos_ptr + row))

    lane = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: best score so far ...
    best_id = lane  # ... and its id (a lane of all -inf scores keeps its first id, like torch)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: running max of z ...
    s = tl.zeros([BLOCK_V], tl.float32)  # ... and sum of exp(z - m)
    for start in range(0, V, BLOCK_V):
        ids = start + lane
        mask = ids < V
        x = tl.load(row_ptr + ids, mask=mask, other=float("-inf")).to(tl.float32)
        z = tl.div_rn(x, temp)  # IEEE division like torch's x / T (a plain `/` is div.full, 2 ulp)

        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf) = NaN
        s = s * tl.exp(m - m_safe) + tl.exp(z - m_safe)
        m = m_new

        log_e = _log_exp_noise(k, kx, ids)
        score = tl.where(greedy, z, z - log_e)
        score = tl.where(mask, score, float("-inf"))
        # strict > keeps the lowest id of a lane's ties; a NaN score (a NaN logit) beats everything
        # and is never replaced, as torch.argmax treats NaN as the maximum
        take = (score > best) | (_isnan(score) & ~_isnan(best))
        best = tl.where(take, score, best)
        best_id = tl.where(take, ids, best_id)

    # merge lanes: NaN lanes first (torch's argmax order), else lanes at the max; lowest id among them
    is_nan = _isnan(best)
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
    cand = tl.where(any_nan, is_nan, best == top)
    tok = tl.min(tl.where(cand, best_id, V), axis=0)
    tok = tl.minimum(tok, V - 1)  # always < V already (lane 0 is a candidate when top is -inf); for safety

    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    lse = big_safe + tl.log(tl.sum(s * tl.exp(m - big_safe), axis=0))
    z_tok = tl.div_rn(tl.load(row_ptr + tok).to(tl.float32), temp)
    tl.store(ids_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, z_tok - lse)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def sample_unfiltered(logits_BV: torch.Tensor, temperature_B: torch.Tensor, keys_B: torch.Tensor,
                      positions_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with no filtering, in one Triton launch (module docstring for the math).

    logits_BV: [B, V] float32 / bfloat16 / float16 with unit stride along V (rows may be strided), CUDA (any
    device under TRITON_INTERPRET=1); temperature_B: float32 [B], 0 = greedy (argmax of the raw logits,
    logprob at temperature 1), else the row's temperature (> 0); keys_B / positions_B: int64 [B], the noise
    key (a request's seed) and position (its output index) of `keyed_exp_noise`. All on one device. Returns
    (token ids int64 [B], logprob of each token float32 [B]) on that device, like
    `miles_k3.rollout.sampling.sample`.
    """
    fn = "sample_unfiltered"
    _check_inputs(fn, logits_BV, temperature_B, keys_B, positions_B)
    if not _interpreting() and not logits_BV.is_cuda:
        raise ValueError(f"{fn}: inputs must be CUDA tensors, got {logits_BV.device}; use "
                         "sample_unfiltered_reference (or miles_k3.rollout.sampling.sample) on other devices")
    if logits_BV.stride(1) != 1:
        logits_BV = logits_BV.contiguous()
    B, V = logits_BV.shape
    dev = logits_BV.device
    ids_B = torch.empty(B, dtype=torch.int64, device=dev)
    logp_B = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return ids_B, logp_B
    args = (logits_BV, logits_BV.stride(0), temperature_B.contiguous(), keys_B.contiguous(),
            positions_B.contiguous(), ids_B, logp_B, V)
    block = min(_BLOCK_V, triton.next_power_of_2(V))
    if logits_BV.is_cuda:
        with torch.cuda.device(dev):
            _sample_unfiltered_kernel[(B,)](*args, BLOCK_V=block, num_warps=_NUM_WARPS)
    else:
        _sample_unfiltered_kernel[(B,)](*args, BLOCK_V=block, num_warps=_NUM_WARPS)
    return ids_B, logp_B
