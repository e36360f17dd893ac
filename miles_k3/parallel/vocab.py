"""Reductions over a vocabulary split across a tensor-parallel group (`comm.VocabShard`: rank r holds rows
[r V/tp, (r + 1) V/tp) of the logits): `vocab_argmax`, the greedy token of logits that stay split.

Legend: B batch rows, T positions, V vocabulary (this rank's shard of it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from miles_k3.parallel.comm import VocabShard


def vocab_argmax(logits_BTV: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
    """The argmax over the whole vocabulary, int64 [B, T] of global ids, of logits split over `shard`'s group
    (None, or a shard without a group: the whole vocabulary is here), as torch.argmax of the whole logits picks
    it: the largest value, the first index among equal ones. Each rank's own argmax and its value are gathered over
    the group ([B, T] each, not the logits) and the first rank holding the largest value wins (the shards are in
    rank order). Every rank of the group calls it and gets the same ids."""
    index_BT = logits_BTV.argmax(-1)
    if shard is None or shard.group is None:
        return index_BT
    value_BT = logits_BTV.gather(-1, index_BT.unsqueeze(-1)).squeeze(-1).float()
    values = [torch.empty_like(value_BT) for _ in range(dist.get_world_size(shard.group))]
    indices = [torch.empty_like(index_BT) for _ in values]
    dist.all_gather(values, value_BT.contiguous(), group=shard.group)
    dist.all_gather(indices, (index_BT + shard.start).contiguous(), group=shard.group)
    best_1BT = torch.stack(values).argmax(0, keepdim=True)  # the first rank with the largest value
    return torch.stack(indices).gather(0, best_1BT).squeeze(0)
