"""Reductions of plain Python numbers over a group of ranks: the training loop's global totals (loss normalisers,
sample counts), its decisions (every rank skips an update, or none does) and its metrics (rank 0 logs the global
values). `group` is a ParallelContext group (`ctx.dp_group`) or `WORLD`; None is a group of one, for which every
function returns its input as it is (one process: no tensor made, no number changed).

Collectives carry float64 tensors on the group's device (the current CUDA device under NCCL, else the CPU), so
integer counts up to 2^53 add exactly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from miles_k3.parallel.comm import all_reduce_, group_size


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def _reduce(values: list[float], group, op) -> list[float]:
    if group_size(group) == 1:
        return list(values)
    x = torch.tensor(values, dtype=torch.float64, device=_device(group))
    return all_reduce_(x, group, op).tolist()


def sum_over(values: list[float], group) -> list[float]:
    """Each value summed over the group's ranks (every rank passes the same number of values)."""
    return _reduce(values, group, dist.ReduceOp.SUM)


def max_over(values: list[float], group) -> list[float]:
    return _reduce(values, group, dist.ReduceOp.MAX)


def all_ranks(flag: bool, group) -> bool:
    """True on every rank when `flag` is true on every rank of the group (the same answer everywhere)."""
    return bool(_reduce([float(flag)], group, dist.ReduceOp.MIN)[0])


def gather(obj, group) -> list:
    """Every rank's `obj` (picklable), in group-rank order; [obj] for a group of one."""
    if group_size(group) == 1:
        return [obj]
    out = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj, group):
    """Rank 0's `obj` (picklable) on every rank of the group (the group's first rank, for WORLD rank 0)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def ranks_where(flag: bool, group) -> list[int]:
    """The group ranks (for WORLD: the global ranks) on which `flag` is true, the same list on every rank."""
    if group_size(group) == 1:
        return [0] if flag else []
    marks = [0.0] * group_size(group)
    marks[dist.get_rank(group)] = float(flag)
    return [r for r, m in enumerate(sum_over(marks, group)) if m]


def world_of(ctx):
    """The WORLD group of a distributed run's context `ctx` (a ParallelContext), None in one process and for a
    context without process groups (`ParallelContext.layout`: planning and sizing one rank of a mesh)."""
    return dist.group.WORLD if ctx.distributed and ctx.mesh is not None else None
