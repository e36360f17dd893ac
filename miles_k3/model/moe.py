"""Stable LatentMoE with SiTU-GLU experts (K3 layers 1..L-1), named as in the published checkpoint.

`block_sparse_moe.gate` routes on the full hidden state (fp32 sigmoid, `e_score_correction_bias` for selection
only, top-k, renormalisation); the routed path runs in the latent: `routed_expert_down_proj` (D -> Dl), the
experts `experts.{e}.w1/w3/w2` (gate/up/down), the latent RMSNorm `routed_expert_norm`, `routed_expert_up_proj`
(Dl -> D); the shared experts are one SiTU MLP on the full width. The experts (bf16 or frozen MXFP4) are in
`experts.py`. Under expert parallelism (`parallelize.py` sets `expert_parallel`; the runtime is
`expert_parallel.py`) the routed path runs on this rank's share of the tokens and its rows travel to the ranks that
hold their experts.

Legend: N tokens (flattened B*T), S this rank's share of them (all N unless expert-parallel), D hidden, L (Dl)
latent width, E experts, K experts per token, I expert width.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.experts import RoutedExperts
from miles_k3.model.layers import RMSNorm, SiTUMLP, to_dtype, use_fused_kernels

if TYPE_CHECKING:
    from miles_k3.model.expert_parallel import ExpertParallel

ROUTER_KERNEL_MAX_WEIGHT = 2**20  # gate weights up to this many elements use the fused router kernel


class TopKRouter(nn.Module):
    """`gate`: sigmoid scores s = sigma(W x) in fp32; select top-k of s + bias; weights s_sel / sum(s_sel)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, scaling: float):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # Selection-only bias (aux-loss-free balancing). It is set by a balancing rule, never by gradients.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [N, K] int64, routing weights [N, K] fp32).

        On CUDA when no gradient is needed (and not under `reference_kernels()`), for gate weights of at most
        ROUTER_KERNEL_MAX_WEIGHT elements, one Triton launch (`miles_k3.kernels.router.topk_route`): the same
        set of ids (up to near-ties of the biased scores) and the same weights up to fp32 rounding, ids in
        descending biased-score order; otherwise this torch code (`topk_route_reference` is a copy of it).
        The kernel reads the whole gate weight once per 16 tokens on one SM: right for small gates (k3_m:
        64 x 768), slower than cuBLAS for K3's 896 x 7168, which keeps the torch path."""
        if (self.weight.numel() <= ROUTER_KERNEL_MAX_WEIGHT
                and use_fused_kernels(x_ND, self.weight, self.e_score_correction_bias)):
            from miles_k3.kernels.router import topk_route
            return topk_route(x_ND, self.weight, self.e_score_correction_bias, self.top_k, self.renormalize,
                              self.scaling)
        scores_NE = self.scores(x_ND)
        ids_NK = self.select(scores_NE)
        return ids_NK, self.weights(scores_NE, ids_NK)

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        """sigma(W x) [N, E], fp32."""
        return torch.sigmoid(x_ND.float() @ self.weight.float().t())

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """The top-k experts of scores + the selection bias: ids [N, K] int64."""
        biased_NE = scores_NE.detach() + to_dtype(self.e_score_correction_bias, torch.float32)
        return torch.topk(biased_NE, self.top_k, dim=-1, sorted=False).indices

    def weights(self, scores_NE: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
        """The routing weights [N, K] fp32 of experts ids_NK: their scores (renormalised), times the scaling."""
        w_NK = scores_NE.gather(-1, ids_NK)
        if self.renormalize:
            w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
        return w_NK * self.scaling


class LatentMoE(nn.Module):
    """`block_sparse_moe`: y = up(RMSNorm(sum_k p_k E_k(down(x)))) + shared(x)."""

    def __init__(self, cfg: K3Config, expert_format: str = "bf16"):
        super().__init__()
        d, dl = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = TopKRouter(d, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_renormalize,
                               cfg.routed_scaling_factor)
        self.routed_expert_down_proj = nn.Linear(d, dl, bias=False)
        self.experts = RoutedExperts(cfg.num_experts, dl, cfg.moe_intermediate_size,
                                     cfg.activation_situ_beta, cfg.activation_situ_linear_beta, expert_format)
        self.routed_expert_norm = RMSNorm(dl, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(dl, d, bias=False)
        self.shared_experts = None
        if cfg.num_shared_experts:
            self.shared_experts = SiTUMLP(d, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                          cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.expert_parallel: ExpertParallel | None = None
        """Set by `parallelize` (ep > 1): the routed path's token split (tp) and expert placement (ep)."""
        self.moe_index = 0
        """This layer's place among the model's MoE layers (set by K3Model): its column of recorded routes."""
        self.routing: tuple | None = None
        """(Recorder, replay or None) while `miles_k3.model.routing` records or replays routes, else None."""
        self.fused_projections = None
        """The rollout engine's `FusedProjections` over the routed down projection and the shared expert's gate and
        up (None: each linear on its own); read in decode steps (one token per request, x [B, 1, D])."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """y [B, T, D] = routed(x) + shared(x). Under expert parallelism every rank of the EP group must call
        this together (one dispatch and one combine all-to-all), with its own tokens (B = 0 included)."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        ep = self.expert_parallel
        x_SD = x_ND if ep is None else ep.local_tokens(x_ND)
        ids_SK, w_SK = self.gate(x_SD) if self.routing is None else self._route(x_SD, x_ND.shape[0])
        group, shared_gu = self.fused_projections, None
        if group is not None and group.serves(x_BTD):
            z_SL, *shared_gu = group(x_ND)  # routed down, shared gate and up in one GEMM (+ 2 for adapters)
        else:
            z_SL = self.routed_expert_down_proj(x_SD)
        u_SL = self.experts(z_SL, ids_SK, w_SK) if ep is None else ep.run_experts(self.experts, z_SL, ids_SK, w_SK)
        if self.routed_expert_norm is not None:
            u_SL = self.routed_expert_norm(u_SL)
        y_SD = self.routed_expert_up_proj(u_SL)
        y_ND = y_SD if ep is None else ep.all_tokens(y_SD, x_ND.shape[0])
        if self.shared_experts is not None:
            y_ND = y_ND + (self.shared_experts(x_ND) if shared_gu is None else self.shared_experts.down(*shared_gu))
        return y_ND.view_as(x_BTD)

    def _route(self, x_SD: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing while recording or replaying (`miles_k3.model.routing`): this layer's own top-k is recorded
        (all N tokens: gathered over tp); replaying, the replayed ids (this rank's share) are used instead, with
        weights from this forward's scores at them."""
        recorder, replay = self.routing
        ep = self.expert_parallel
        if replay is None:  # the gate as it routes (its fused kernel where it applies), the ids recorded
            own_SK, w_SK = self.gate(x_SD)
            ids_SK = own_SK
        else:
            scores_SE = self.gate.scores(x_SD)
            own_SK = self.gate.select(scores_SE)
            ids_NK = replay.ids(self.moe_index, num_tokens).to(x_SD.device)
            ids_SK = ids_NK if ep is None else ep.local_tokens(ids_NK)
            # a token without a route (-1: a padding position) keeps the forward's own top-k
            ids_SK = torch.where((ids_SK < 0).any(-1, keepdim=True), own_SK, ids_SK)
            w_SK = self.gate.weights(scores_SE, ids_SK)
        recorder.record(self.moe_index, own_SK if ep is None else ep.all_tokens(own_SK, num_tokens))
        return ids_SK, w_SK
