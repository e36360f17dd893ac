"""Forwards in lockstep across DP replicas, for expert parallelism whose EP groups span replicas.

A forward of the expert-parallel model is a collective of its EP group: every MoE layer exchanges row counts and
runs two all-to-alls (`expert_parallel.dispatch_combine`), and the k-th all-to-all of one rank pairs with the k-th
of every other rank of the group, whatever forward each belongs to (a prefill chunk, a decode step, a training
micro-batch: all run the same MoE layers in the same order). When an EP group lies inside one TP group
(parallel.tp % parallel.ep == 0) its ranks hold the same requests and samples and make the same forwards by
construction. When it spans DP replicas, the replicas hold different prompts, samples and micro-batch counts, so
the ranks agree on every forward:

* the engine (`RolloutEngine`): before each of its forwards a rank votes "busy" (a max all-reduce of one number
  over the world); a rank whose `generate` call has run out of work votes "idle" and, while some rank is still
  busy, runs an idle forward (one token, output dropped: its part of the other ranks' all-to-alls), until every
  rank votes idle in the same round and all return together. So every rank must call `generate` the same number
  of times, in the same order (a rank with no prompts calls it with none): the rollouts and the eval do.
* the trainer (`trainer.step`): each loop over micro-batches runs the same number of iterations on every rank
  (`steps`: the max over the world); a rank past its own micro-batches runs an idle micro-step of one token
  whose loss is zero, so its forwards, reference forwards and backward pair with the others'. A gradient of zero
  changes no gradient.

The vote is over the world, not the EP group: a TP group may straddle two EP groups (e.g. tp=2, ep=3), and its
ranks must still make the same forwards; over the world every rank runs a forward (real or idle) in every round.
Cost: one all-reduce of one number per engine forward, and the idle forwards of ranks that finished first (the
slowest replica sets the pace, as it does for the step anyway).
"""
from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import max_over


def spans_replicas(ctx: ParallelContext) -> bool:
    """An EP group holds ranks of more than one DP replica (EP groups are ep consecutive ranks, replicas tp
    consecutive ranks): parallel.tp % parallel.ep != 0."""
    return ctx.ep_size > 1 and ctx.tp_size % ctx.ep_size != 0


class Lockstep:
    """The forwards of one rank kept in step with every other rank's (see the module docstring); inactive (every
    method a no-op, no collective) unless the run's EP groups span DP replicas.

    A forward carries an adapter (an engine's LoRA adapter, `AdapterBank.index`): the rows a rank sends to another
    rank's experts meet that rank's expert LoRA, so the ranks of a round must serve the same adapter (an idle rank
    binds it for its idle forward); busy ranks serving different adapters in one round is an error on every rank."""

    def __init__(self, ctx: ParallelContext = SINGLE):
        self.active = spans_replicas(ctx)
        self.idle_forwards = 0  # idle forwards this rank ran (for tests and logs)

    def busy(self, adapter: int = 0) -> None:
        """Before one of this rank's own forwards, serving `adapter`: vote busy (the others run an idle forward
        beside it, with the same adapter)."""
        if self.active:
            self._agreed(adapter + 1)

    def drain(self, idle_forward: Callable[[int], None]) -> int:
        """This rank has no more forwards of its own: `idle_forward(adapter)` once per round in which another rank
        is still busy (with that round's adapter), until all are idle; returns how many it ran."""
        ran = 0
        while self.active:
            vote = self._agreed(0)
            if not vote:
                break
            idle_forward(vote - 1)
            ran += 1
        self.idle_forwards += ran
        return ran

    def steps(self, n: int) -> int:
        """Iterations of a loop of `n` forwards on this rank: the max of the ranks' n (n itself when inactive)."""
        if not self.active:
            return n
        return int(max_over([float(n)], dist.group.WORLD)[0])

    def _agreed(self, mine: int) -> int:
        """One round's vote (0: idle, a + 1: busy serving adapter a): the busy ranks' vote, 0 when all are idle.
        One max all-reduce of (vote, -vote) gives the largest and the smallest busy vote."""
        hi, neg_lo = max_over([float(mine), -float(mine) if mine else -float(2**52)], dist.group.WORLD)
        if hi and hi != -neg_lo:
            raise RuntimeError(f"lockstep: ranks are serving different LoRA adapters in one forward (adapter "
                               f"numbers {int(-neg_lo) - 1} and {int(hi) - 1}): under expert parallelism across DP "
                               "replicas every engine forward serves one adapter on all ranks; generate with the "
                               "same adapter on every rank at a time")
        return int(hi)
