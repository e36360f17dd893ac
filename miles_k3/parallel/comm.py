"""Autograd-aware collectives of the sharded model, Megatron's conventions: inside a tensor-parallel region every
rank holds the same (replicated) activations outside it and a shard inside it, and the loss computed after it is
the same on every rank of the group.

* `copy_to(x, group)`: enter a region: identity forward; backward sums the input gradient over the group (each
  rank's shard contributed a part of it).
* `reduce_from(x, group)`: leave a row-parallel region: forward sums the partial outputs; backward identity.
* `split_to(x, group, dim)`: take this rank's slice of a replicated tensor (forward) / all-gather gradients.
* `gather_from(x, group, dim)`: all-gather slices into the replicated tensor (forward) / take this rank's slice of
  the gradient (backward). Slices may be uneven (`sizes`).
* `all_to_all(x, out_splits, in_splits, group)`: rows to other ranks (expert dispatch); backward sends the
  gradients back the way they came.

A group of None (one process, or a degree of 1) makes every function the identity. `VocabShard` records the
vocabulary rows a rank's embedding and logits hold (vocab-parallel embedding, loss and sampling).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows [start, end) of `size` that this rank's embedding, lm_head and logits hold."""

    start: int
    end: int
    size: int
    """The whole vocabulary (V)."""
    group: object
    """The TP process group the vocabulary is split over."""


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _even_gather(x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """All-gather slices of `sizes[r]` along `dim` (padded to the largest: gloo gathers equal shapes)."""
    n = max(sizes)
    x = x.movedim(dim, 0)
    if x.shape[0] < n:
        x = torch.cat([x, x.new_zeros((n - x.shape[0], *x.shape[1:]))])
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]).movedim(0, dim)


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        r = dist.get_rank(group)
        start = sum(sizes[:r])
        return x.narrow(dim, start, sizes[r]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _even_gather(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _even_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        r = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, sum(ctx.sizes[:r]), ctx.sizes[r]).contiguous(), None, None, None


def split_sizes(n: int, parts: int) -> list[int]:
    """n split into `parts` near-equal sizes, the larger first (torch.tensor_split's rule)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFrom.apply(x, group)


def split_to(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """This rank's slice (split_sizes of x.shape[dim]) of a tensor replicated over `group`."""
    n = group_size(group)
    return x if n == 1 else _SplitTo.apply(x, group, dim, split_sizes(x.shape[dim], n))


def gather_from(x: torch.Tensor, group, dim: int = 0, total: int | None = None) -> torch.Tensor:
    """The replicated whole of slices laid out by split_sizes(total, group size) (`total`: the whole's length
    along `dim`; default: this slice's length times the group size)."""
    n = group_size(group)
    if n == 1:
        return x
    total = x.shape[dim] * n if total is None else total
    return _GatherFrom.apply(x, group, dim, split_sizes(total, n))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows x[sum(in_splits[:r]) : ...] go to rank r of `group`; returns the rows received (out_splits[r] from
    rank r). Differentiable: backward sends each row's gradient back to the rank it came from."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts[r]: rows this rank sends to rank r -> rows it receives from each rank (the splits of all_to_all)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_reduce_(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce without autograd (gradients, metrics, verdicts)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x
