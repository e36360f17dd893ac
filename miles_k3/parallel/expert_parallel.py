"""Expert parallelism (EP) of K3's routed experts: each rank of an EP group (`ep` consecutive ranks) holds
num_experts / ep of every MoE layer's routed experts, in their native storage (bf16 Parameters or MXFP4 uint8
buffers) with their per-expert LoRA slices; the router stays replicated and picks among all E experts.

`shard_experts_ep` slices a full model in place. In each LatentMoE forward the rank takes its share of the tokens
(the MoE input is replicated over tp: `split_to`), routes them, projects them to the latent width, and sends every
(token, slot) row to the rank owning its expert (rows sorted by global expert id, i.e. by destination rank then
expert): one count exchange, one dispatch all-to-all of the latent rows, the SiTU-GLU experts on the owner (rows
grouped by local expert, the existing grouped path with its MXFP4 backends and expert LoRA), one combine
all-to-all back, and the fp32 weighted sum over the K slots in the single-process (token, slot) order
(`combine_slots`); the routed result is all-gathered over tp again. The owner rebuilds each received row's local
expert from the exchanged per-expert counts, so no expert ids travel. Autograd runs back through both
all-to-alls: every rank of an EP group makes the same collectives, zero-token ranks included.

Gradient sums (`grads.py`): an owner's expert LoRA already has the gradient of every token its EP group routed to
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
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.experts import RoutedExperts, combine_slots, sync_free_active
from miles_k3.model.lora import LoRALinear
from miles_k3.model.moe import LatentMoE
from miles_k3.parallel import comm
from miles_k3.parallel.config import ParallelConfigError, divisors
from miles_k3.parallel.grads import mark_grad_groups, mark_sharded
from miles_k3.parallel.mesh import ParallelContext


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


def shard_experts_ep(model: nn.Module, ctx: ParallelContext) -> None:
    """In place, on a full model after `apply_lora` (and before an optimizer holds its adapters): every
    RoutedExperts keeps the experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) and their LoRA slices, every LatentMoE
    runs its routed path on its tp share of the tokens with all-to-all dispatch over `ctx.ep_group`, and the
    adapters are marked for `reduce_gradients` / `global_grad_norm`. With ep = 1 the experts stay whole and only
    the token split over tp remains. Raises ParallelConfigError (parallel.ep) when ep does not divide
    num_experts, ValueError on a model already sharded."""
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if any(m.expert_parallel is not None for m in moes):
        raise ValueError("shard_experts_ep: this model's routed experts are already sharded; shard a freshly "
                         "built full model once")
    for num_experts in {m.experts.num_experts for m in moes}:
        if num_experts % ctx.ep_size:
            raise ParallelConfigError(f"parallel.ep: {ctx.ep_size} does not divide the model's num_experts = "
                                      f"{num_experts}; use an ep among {divisors(num_experts)} that also divides "
                                      f"dp x tp = {ctx.world_size}")
    for moe in moes:
        per_rank = moe.experts.num_experts // ctx.ep_size
        first = ctx.ep_rank * per_rank
        moe.experts.keep_experts(first, per_rank)
        for lora in (moe.experts.lora or {}).values():
            _keep_lora_experts(lora, first, per_rank)
        for proj in (moe.routed_expert_down_proj, moe.routed_expert_up_proj):
            if isinstance(proj, LoRALinear):  # replicated, but fed only this rank's tp slice of the tokens
                mark_grad_groups(proj.lora_A.weight, "dp", "tp")
                mark_grad_groups(proj.lora_B.weight, "dp", "tp")
        moe.expert_parallel = ExpertParallel(ctx.tp_group, ctx.ep_group, ctx.ep_size)


def _keep_lora_experts(lora: nn.Module, first: int, count: int) -> None:
    """An ExpertLoRA's lora_A [E, r, In] / lora_B [E, Out, r] cut to experts first .. first + count - 1 (the same
    Parameters, holding a copy of the slice), summed over expert replicas, sharded over ep."""
    for p in (lora.lora_A, lora.lora_B):
        p.data = p.data[first: first + count].clone()
        mark_grad_groups(p, "expert_replica")
        mark_sharded(p, "ep")


def adopt_ep_layout(twin: nn.Module, model: nn.Module) -> None:
    """Give `twin`, built for the full shapes but holding `model`'s expert tensors (the rollout engine's
    `share_base` twin), the EP layout `shard_experts_ep` gave `model`: held expert ids and the dispatch. Call it
    before attaching the twin's adapters (they are then sized for the held experts). Nothing is sliced; the
    storage shapes are checked. A no-op for a model without EP."""
    sources = {path: m for path, m in model.named_modules() if isinstance(m, LatentMoE)}
    for path, moe in twin.named_modules():
        if isinstance(moe, LatentMoE) and sources[path].expert_parallel is not None:
            held = sources[path].experts
            moe.experts.set_held_experts(held.expert_offset, held.num_experts)
            moe.expert_parallel = sources[path].expert_parallel


def alltoall_bytes_per_token(cfg: K3Config, dtype_bytes: int) -> dict[str, int]:
    """All-to-all payload one token puts on one MoE layer, in bytes, for activations of `dtype_bytes`: its K
    latent rows (routed_expert_hidden_size values each) go to their experts' ranks ("dispatch") and come back
    ("combine"); backward sends the gradients of both the other way ("backward": combine's, then dispatch's).
    Counted whole: rows whose expert is on the token's own rank are a local copy, so under balanced routing
    (ep - 1) / ep of this crosses the wire. The per-layer count exchange (E int64 per rank) is independent of
    the tokens and not included."""
    rows = cfg.num_experts_per_token * cfg.routed_expert_hidden_size * dtype_bytes
    return {"dispatch": rows, "combine": rows, "forward": 2 * rows, "backward": 2 * rows}
