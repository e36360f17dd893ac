"""Which ranks' gradients of a trainable (LoRA) parameter are summed after backward, and the summing itself.

Every trainable parameter's gradient is summed over the groups `grad_groups(p)` names (ParallelContext group
names). The default is ("dp",): DP replicas see different samples. The sharding code marks the exceptions
(`mark_grad_groups`): a tensor-parallel layer's replicated LoRA half (A under a column-parallel base, B under a
row-parallel one) gets only its own shard's contribution on each rank, so ("dp", "tp"); routed-expert LoRA and
the latent projections of the MoE's routed path (tokens split over tp) are summed over the ranks that hold the
same copy (("expert_replica",), resp. ("dp", "tp")). Losses are normalised by global totals, so the sums give
the gradient of the one global loss.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from miles_k3.parallel.comm import all_reduce_
from miles_k3.parallel.mesh import ParallelContext

GRAD_GROUPS_ATTR = "_miles_k3_grad_groups"
DEFAULT_GROUPS = ("dp",)


def mark_grad_groups(param: torch.Tensor, *groups: str) -> None:
    setattr(param, GRAD_GROUPS_ATTR, tuple(groups))


def grad_groups(param: torch.Tensor) -> tuple[str, ...]:
    return getattr(param, GRAD_GROUPS_ATTR, DEFAULT_GROUPS)


@torch.no_grad()
def reduce_gradients(params, ctx: ParallelContext) -> None:
    """Sum the gradients of `params` (an iterable of tensors) over their groups, one flat all-reduce per (group,
    dtype) bucket. A trainable tensor without a gradient on this rank (nothing reached it here, but maybe on a
    peer) takes part as zeros, so every rank's buckets line up; frozen ones are skipped. No-op in one process."""
    if not ctx.distributed:
        return
    buckets: dict[tuple[str, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            if not p.requires_grad:
                continue
            p.grad = torch.zeros_like(p)
        for name in grad_groups(p):
            if ctx.size(name) > 1:
                buckets[(name, p.grad.dtype)].append(p.grad)
    for (name, _), grads in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_(flat, ctx.group(name))
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


SHARDED_ATTR = "_miles_k3_sharded_over"


def mark_sharded(param: torch.Tensor, *groups: str, dim: int = 0) -> None:
    """`param` is one shard, along `dim`, of a tensor split over `groups` (e.g. ("tp",) for a column-parallel LoRA B,
    ("ep",) for routed-expert LoRA): its squares are summed over those groups for the global gradient norm, and
    `whole` concatenates the groups' shards along `dim` in group-rank order."""
    setattr(param, SHARDED_ATTR, (tuple(groups), dim))


def sharded_over(param: torch.Tensor) -> tuple[str, ...]:
    return getattr(param, SHARDED_ATTR, ((), 0))[0]


@torch.no_grad()
def whole(param: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The unsharded tensor of which `param` is this rank's shard (itself when not sharded), on every rank of
    its groups: a collective, called by all of them together (the PEFT adapter of a sharded run)."""
    import torch.distributed as dist

    groups, dim = getattr(param, SHARDED_ATTR, ((), 0))
    t = param.detach()
    for name in groups:
        if ctx.size(name) > 1:
            parts = [torch.empty_like(t) for _ in range(ctx.size(name))]
            dist.all_gather(parts, t.contiguous(), group=ctx.group(name))
            t = torch.cat(parts, dim=dim)
    return t


@torch.no_grad()
def global_grad_norm(params, ctx: ParallelContext) -> torch.Tensor:
    """The L2 norm of the whole (unsharded) gradient, the same on every rank: `torch.nn.utils.get_total_norm` of
    each set of tensors sharded over the same groups, those norms' squares summed over the groups (one all-reduce
    each), then the norm of the sets' norms; replicated tensors count once. Call after `reduce_gradients`. A scalar
    in the gradients' dtype. One rank (or nothing sharded over a group of more than one): the sets' norm is
    get_total_norm's of all the gradients, as `torch.nn.utils.clip_grad_norm_` computes it."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    sets: dict[tuple[str, ...], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        sets[tuple(name for name in sharded_over(p) if ctx.size(name) > 1)].append(p.grad)
    norms = []
    for groups, grads in sorted(sets.items()):
        norm = torch.nn.utils.get_total_norm(grads)
        if groups:
            sq = norm.float().square()
            for name in groups:
                all_reduce_(sq, ctx.group(name))
            norm = sq.sqrt()
        norms.append(norm)
    return norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm([n.float() for n in norms])
