"""Per-token log-probs and entropies of logits, the inputs of the policy loss (`trainer.losses.policy_loss`), both
from one chunked pass over the logits (`token_logprobs_and_entropy`).

Memory is the point: the logits [B, T, V] of a long batch are the largest tensor of a train step, so the float32
copy exists one chunk of positions at a time, in forward and in backward, and autograd saves only the logits
themselves and [B, T] statistics. Vocab-parallel with one code path for one rank and many: the logits may be
split by vocabulary rows over the ranks of a tensor-parallel group (`vocab_shard`; None is the one-rank shard).

Legend: B sequences (rows), T token positions, V vocabulary, C the positions of one chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from miles_k3.parallel.comm import VocabShard, all_reduce_

CHUNK = 256  # token positions per chunk in token_logprobs_and_entropy

def token_logprobs_and_entropy(logits_BTV: Tensor, tokens_BT: Tensor, chunk_size: int = CHUNK,
                               vocab_shard: VocabShard | None = None, with_entropy: bool = True
                               ) -> tuple[Tensor, Tensor | None]:
    """(log softmax(logits)[token], entropy of softmax(logits)) per position, both from one pass over the logits:
    float32 [B, T] each (float64 for float64 logits), differentiable wrt logits_BTV; the entropy is None when not
    `with_entropy` (then no entropy term is computed at all).

    Works `chunk_size` positions at a time in forward and backward, so the float32 copy of the logits exists one
    chunk ([B, chunk_size, V]) at a time; autograd saves only the logits themselves and [B, T] statistics.
    tokens_BT: integer ids in [0, V), NOT checked here (that would cost a device sync per micro-batch): `pack`
    checks them when it lays out the batch; an id outside the vocabulary gives garbage or a device-side error.
    Entropy -sum_v p_v log p_v is stable (-inf logits allowed: they add 0).

    One code path for one and many ranks: `vocab_shard` (the model's `vocab_shard` under tensor parallelism) says
    which vocabulary rows [start, end) of V logits_BTV holds; None is the one-rank shard, every row here and no
    group. The softmax is over all V (per chunk the max and the sums are all-reduced over the shard's group, the
    target's logit comes from the rank holding it), every rank of the group returns the same [B, T], and the
    gradient is this rank's slice of the whole vocabulary's (backward needs no communication). Every rank of the
    group must call it with the same tokens, chunk_size and with_entropy."""
    _check_logits(logits_BTV, chunk_size)
    _check_tokens(tokens_BT, logits_BTV.shape[:2])
    if vocab_shard is None:
        v = logits_BTV.shape[2]
        vocab_shard = VocabShard(0, v, v, None)
    _check_vocab_shard(logits_BTV, vocab_shard)
    out = _LogprobsEntropy.apply(logits_BTV, tokens_BT.long(), chunk_size, vocab_shard, bool(with_entropy))
    return (out[0], out[1]) if with_entropy else (out, None)


def token_logprobs(logits_BTV: Tensor, tokens_BT: Tensor, chunk_size: int = CHUNK,
                   vocab_shard: VocabShard | None = None) -> Tensor:
    """The log-probs alone: `token_logprobs_and_entropy(..., with_entropy=False)[0]` (float32 [B, T])."""
    return token_logprobs_and_entropy(logits_BTV, tokens_BT, chunk_size, vocab_shard, with_entropy=False)[0]


def _compute_dtype(logits_BTV: Tensor) -> torch.dtype:
    return torch.float64 if logits_BTV.dtype == torch.float64 else torch.float32


def _chunks(t: int, chunk_size: int) -> list[slice]:
    return [slice(s, min(s + chunk_size, t)) for s in range(0, t, chunk_size)]


def _global_max(z_BCV: Tensor, group) -> Tensor:
    """max_v z over the whole vocabulary [B, C] (all-reduced); 0 where it is not finite (an all -inf row), as
    torch.logsumexp shifts."""
    m_BC = z_BCV.amax(dim=-1)
    all_reduce_(m_BC, group, dist.ReduceOp.MAX)
    return torch.where(torch.isfinite(m_BC), m_BC, torch.zeros((), dtype=m_BC.dtype, device=m_BC.device))


class _LogprobsEntropy(torch.autograd.Function):
    """Log-prob of the target and entropy over vocabulary rows split across a group (a group of one: the whole
    vocabulary). With m the global max, e_v = exp(z_v - m), s = sum_v e_v and w = sum_v e_v (z_v - m), both summed
    over the group with the target's logit z_y (0 on ranks not holding y) in one collective:
      lse = m + log s,  logp = z_y - lse,  H = log s - w / s.
    Backward (local, log p_v = z_v - lse): d logp / dz_v = onehot(y)_v - p_v, dH / dz_v = -p_v (log p_v + H)."""

    @staticmethod
    def forward(ctx, logits_BTV: Tensor, tokens_BT: Tensor, chunk_size: int, shard: VocabShard,
                with_entropy: bool):
        dt = _compute_dtype(logits_BTV)
        b, t, n = logits_BTV.shape
        local_BT = tokens_BT - shard.start
        inside_BT = (local_BT >= 0) & (local_BT < n)
        local_BT = local_BT.clamp(0, n - 1)
        logp_BT = torch.empty(b, t, dtype=dt, device=logits_BTV.device)
        lse_BT = torch.empty_like(logp_BT)
        ent_BT = torch.empty_like(logp_BT) if with_entropy else None
        zero = torch.zeros((), dtype=dt, device=logits_BTV.device)
        for c in _chunks(t, chunk_size):
            z_BCV = logits_BTV[:, c].to(dt)
            m_BC = _global_max(z_BCV, shard.group)
            shifted_BCV = z_BCV - m_BC[..., None]
            e_BCV = torch.exp(shifted_BCV)
            target_BC = z_BCV.gather(-1, local_BT[:, c, None])[..., 0].masked_fill(~inside_BT[:, c], 0)
            sums = [e_BCV.sum(dim=-1), target_BC]
            if with_entropy:
                sums.append(torch.where(e_BCV > 0, e_BCV * shifted_BCV, zero).sum(dim=-1))
            sums_KBC = torch.stack(sums)
            all_reduce_(sums_KBC, shard.group)  # one collective for every sum of the chunk
            log_s_BC = sums_KBC[0].log()
            lse_BT[:, c] = m_BC + log_s_BC
            logp_BT[:, c] = sums_KBC[1] - lse_BT[:, c]
            if with_entropy:
                ent_BT[:, c] = log_s_BC - sums_KBC[2] / sums_KBC[0]
        ctx.save_for_backward(logits_BTV, local_BT, inside_BT, lse_BT, ent_BT)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return (logp_BT, ent_BT) if with_entropy else logp_BT

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp_BT: Tensor | None, grad_ent_BT: Tensor | None = None):
        logits_BTV, local_BT, inside_BT, lse_BT, ent_BT = ctx.saved_tensors
        if grad_lp_BT is None and grad_ent_BT is None:
            return None, None, None, None, None
        dt = lse_BT.dtype
        grad_BTV = torch.empty_like(logits_BTV)
        for c in _chunks(logits_BTV.shape[1], ctx.chunk_size):
            logp_BCV = logits_BTV[:, c].to(dt) - lse_BT[:, c, None]
            g_BCV = None
            if grad_ent_BT is not None:
                g_BCV = -_p_times(logp_BCV, logp_BCV + ent_BT[:, c, None]) * grad_ent_BT[:, c, None].to(dt)
            if grad_lp_BT is not None:
                g_BC1 = grad_lp_BT[:, c, None].to(dt)
                g_lp_BCV = torch.exp(logp_BCV) * -g_BC1
                g_lp_BCV.scatter_add_(-1, local_BT[:, c, None], g_BC1 * inside_BT[:, c, None])
                g_BCV = g_lp_BCV if g_BCV is None else g_BCV + g_lp_BCV
            grad_BTV[:, c] = g_BCV
        return grad_BTV, None, None, None, None


def _p_times(logp_BCV: Tensor, x_BCV: Tensor) -> Tensor:
    """exp(logp) * x, 0 where the probability is 0 (so a -inf logit gives 0, not 0 * inf = NaN)."""
    p_BCV = torch.exp(logp_BCV)
    return torch.where(p_BCV > 0, p_BCV * x_BCV, torch.zeros((), dtype=p_BCV.dtype, device=p_BCV.device))


def _check_logits(logits_BTV: Tensor, chunk_size: int) -> None:
    if not isinstance(logits_BTV, Tensor) or logits_BTV.dim() != 3 or not logits_BTV.is_floating_point():
        got = f"{tuple(logits_BTV.shape)} {logits_BTV.dtype}" if isinstance(logits_BTV, Tensor) else "no tensor"
        raise ValueError(f"logits_BTV: must be a floating 3-D tensor [B, T, V], got {got}")
    if logits_BTV.shape[2] == 0:
        raise ValueError("logits_BTV: the vocabulary dimension is empty")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be an int >= 1, got {chunk_size!r}")


def _check_vocab_shard(logits_BTV: Tensor, shard: VocabShard) -> None:
    if logits_BTV.shape[2] != shard.end - shard.start:
        raise ValueError(f"logits_BTV: {logits_BTV.shape[2]} vocabulary rows, but vocab_shard holds rows "
                         f"[{shard.start}, {shard.end}) of {shard.size}; pass the model's own vocab_shard")


def _check_tokens(tokens_BT: Tensor, shape_BT: tuple[int, int]) -> None:
    """Shape and dtype only: the ids' range is `pack`'s check (here it would be a device sync)."""
    if not isinstance(tokens_BT, Tensor) or tuple(tokens_BT.shape) != tuple(shape_BT):
        got = tuple(tokens_BT.shape) if isinstance(tokens_BT, Tensor) else type(tokens_BT).__name__
        raise ValueError(f"tokens_BT: must have shape {tuple(shape_BT)}, got {got}")
    if tokens_BT.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"tokens_BT: must be an integer dtype, got {tokens_BT.dtype}")
