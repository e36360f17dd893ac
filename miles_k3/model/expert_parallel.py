"""The expert-parallel (EP) runtime of K3's routed experts: each rank of an EP group (`ep` consecutive ranks) holds
num_experts / ep of every MoE layer's routed experts, in their native storage (bf16 Parameters or MXFP4 uint8
buffers) with their per-expert LoRA slices; the router stays replicated and picks among all E experts. Which
experts a rank holds is planned by `parallelize.py` (on the meta device, before any weight exists).

In each LatentMoE forward the rank takes its share of the tokens
(the MoE input is replicated over tp: `split_to`), routes them, projects them to the latent width, and sends every
(token, slot) row to the rank owning its expert (rows sorted by global expert id, i.e. by destination rank then
expert): one count exchange, one dispatch all-to-all of the latent rows, the SiTU-GLU experts on the owner (rows
grouped by local expert, the existing grouped path with its MXFP4 backends and expert LoRA), one combine
all-to-all back, and the fp32 weighted sum over the K slots in the single-process (token, slot) order
(`combine_slots`); the routed result is all-gathered over tp again. The owner rebuilds each received row's local
expert from the exchanged per-expert counts, so no expert ids travel. Autograd runs back through both
all-to-alls: every rank of an EP group makes the same collectives, zero-token ranks included.

Gradient sums (`miles_k3.parallel.grads`, marked by `parallelize.py`): an owner's expert LoRA already has the gradient of every token its EP group routed to
it, and EP groups see disjoint tokens (each rank its own dp sample and tp slice), so expert LoRA is summed over the
expert-replica group (the ranks holding the same experts) and is an "ep" shard for the norm. The routed path's
replicated projections (routed_expert_down_proj / up_proj) see only this rank's tp slice of its dp sample:
summed over dp and tp.

Legend: N tokens, S this rank's share, K slots per token, M = S*K routed rows, R rows received, P ranks of the EP
group, X experts held per rank, E = P*X experts (all), L latent width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_k3.model.config import K3Config
from miles_k3.model.experts import RoutedExperts, combine_slots, sync_free_active
from miles_k3.parallel import comm


@dataclass(frozen=True)
class ExpertParallel:
    """The sharded routed path of one LatentMoE: tokens split over `tp_group`, experts over `ep_group` (`ep_size`
    ranks; None: experts whole, only the token split remains)."""

    tp_group: object
    ep_group: object
    ep_size: int

    def local_tokens(self, x_ND: torch.Tensor) -> torch.Tensor:
        """This tp rank's rows (split_sizes of N) of the tp-replicated MoE input."""
        return comm.split_to(x_ND, self.tp_group, 0)

    def all_tokens(self, y_SD: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The routed result of all N tokens, replicated over tp again."""
        return comm.gather_from(y_SD, self.tp_group, 0, num_tokens)

    def run_experts(self, experts: RoutedExperts, z_SL: torch.Tensor, ids_SK: torch.Tensor,
                    w_SK: torch.Tensor) -> torch.Tensor:
        """u [S, L] = sum_k w[s, k] * E_{ids[s, k]}(z[s]) over experts held across the EP group (global ids)."""
        if self.ep_group is None:
            return experts(z_SL, ids_SK, w_SK)
        return dispatch_combine(experts, z_SL, ids_SK, w_SK, self.ep_group, self.ep_size)


def dispatch_combine(experts: RoutedExperts, z_SL: torch.Tensor, ids_SK: torch.Tensor, w_SK: torch.Tensor,
                     group, ep_size: int) -> torch.Tensor:
    """The expert-parallel RoutedExperts.forward: every (token, slot) row goes to the rank of `group` owning its
    expert and comes back, weighted in fp32 in (token, slot) order. One host sync (the row counts): refused
    under `sync_free_experts()`."""
    if sync_free_active():
        raise RuntimeError(f"expert parallelism (parallel.ep={ep_size}) sizes its all-to-all from host-side row "
                           "counts and cannot run in a sync-free (CUDA-graph captured) decode step; decode "
                           "eagerly when parallel.ep > 1 (engine.decode=eager)")
    top_k, per_rank = ids_SK.shape[1], experts.num_experts
    flat_ids = ids_SK.reshape(-1)
    order_M = torch.argsort(flat_ids, stable=True)  # by global expert: by destination rank, then expert
    sent_E = torch.bincount(flat_ids, minlength=ep_size * per_rank)  # rows per global expert
    got_E = comm.exchange_counts(sent_E, group)  # block s: rows from rank s for each of this rank's X experts
    got_PX = got_E.view(ep_size, per_rank)
    sizes = torch.cat([sent_E.view(ep_size, per_rank).sum(1), got_PX.sum(1), got_PX.sum(0)]).tolist()
    send, recv, counts = sizes[:ep_size], sizes[ep_size: 2 * ep_size], sizes[2 * ep_size:]
    z_RL = comm.all_to_all(z_SL[order_M // top_k], recv, send, group)
    # Received rows are in (source rank, local expert) order: group them by expert for the grouped matmuls.
    local_R = torch.repeat_interleave(torch.arange(per_rank, device=got_E.device).repeat(ep_size), got_E,
                                      output_size=sum(recv))
    perm_R = torch.argsort(local_R, stable=True)
    y_grouped = experts.grouped_glu(z_RL[perm_R], counts)
    y_RL = torch.empty_like(y_grouped).index_copy_(0, perm_R, y_grouped)
    y_ML = comm.all_to_all(y_RL, send, recv, group)
    return combine_slots(y_ML, order_M, w_SK, z_SL.dtype)


def alltoall_bytes_per_token(cfg: K3Config, dtype_bytes: int) -> dict[str, int]:
    """All-to-all payload one token puts on one MoE layer, in bytes, for activations of `dtype_bytes`: its K
    latent rows (routed_expert_hidden_size values each) go to their experts' ranks ("dispatch") and come back
    ("combine"); backward sends the gradients of both the other way ("backward": combine's, then dispatch's).
    Counted whole: rows whose expert is on the token's own rank are a local copy, so under balanced routing
    (ep - 1) / ep of this crosses the wire. The per-layer count exchange (E int64 per rank) is independent of
    the tokens and not included."""
    rows = cfg.num_experts_per_token * cfg.routed_expert_hidden_size * dtype_bytes
    return {"dispatch": rows, "combine": rows, "forward": 2 * rows, "backward": 2 * rows}
