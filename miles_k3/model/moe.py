"""Stable LatentMoE with SiTU-GLU experts (K3 layers 1..L-1), named as in the published checkpoint.

`block_sparse_moe.gate` routes on the full hidden state (fp32 sigmoid, `e_score_correction_bias` for selection
only, top-k, renormalisation); the routed path runs in the latent: `routed_expert_down_proj` (D -> Dl), the
experts `experts.{e}.w1/w3/w2` (gate/up/down), the latent RMSNorm `routed_expert_norm`, `routed_expert_up_proj`
(Dl -> D); the shared experts are one SiTU MLP on the full width.

Legend: N tokens (flattened B*T), D hidden, Dl latent width, E experts, K experts per token, I expert width.
"""
from __future__ import annotations

import torch
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.layers import RMSNorm, SiTUMLP, situ_glu


class TopKRouter(nn.Module):
    """`gate`: sigmoid scores s = sigma(W x) in fp32; select top-k of s + bias; weights s_sel / sum(s_sel)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, scaling: float):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # Selection-only bias (aux-loss-free balancing). It is set by a balancing rule, never by gradients.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [N, K] int64, routing weights [N, K] fp32)."""
        scores_NE = torch.sigmoid(x_ND.float() @ self.weight.float().t())
        biased_NE = scores_NE.detach() + self.e_score_correction_bias.float()
        ids_NK = torch.topk(biased_NE, self.top_k, dim=-1, sorted=False).indices
        w_NK = scores_NE.gather(-1, ids_NK)
        if self.renormalize:
            w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
        return ids_NK, w_NK * self.scaling


class RoutedExperts(nn.Module):
    """E SiTU-GLU experts stored stacked for grouped compute: w1, w3 [E, I, Dl] and w2 [E, Dl, I].

    The state dict exposes the checkpoint's per-expert names `{e}.w1.weight`, `{e}.w2.weight`,
    `{e}.w3.weight`, so checkpoint keys load without a renaming table.
    """

    PROJS = ("w1", "w2", "w3")

    def __init__(self, num_experts: int, latent: int, inter: int, beta: float, linear_beta: float | None):
        super().__init__()
        self.num_experts, self.beta, self.linear_beta = num_experts, beta, linear_beta
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, latent))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, latent))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, inter))

    def forward(self, z_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        """u = sum_k w[n,k] * E_{ids[n,k]}(z[n]); expert outputs rounded to z's dtype, weighted in fp32."""
        n_tok, top_k = ids_NK.shape
        if n_tok == 0:
            return torch.zeros_like(z_ND)
        flat_ids = ids_NK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        outs = []
        for e, z_e in enumerate(torch.split(z_ND[token_of], counts)):
            if z_e.shape[0]:
                h = situ_glu(z_e @ self.w1[e].t(), z_e @ self.w3[e].t(), self.beta, self.linear_beta)
                outs.append(h @ self.w2[e].t())
        y = torch.cat(outs).float() * w_NK.reshape(-1)[order].unsqueeze(-1)
        u_ND = torch.zeros(n_tok, z_ND.shape[-1], dtype=torch.float32, device=z_ND.device)
        return u_ND.index_add_(0, token_of, y).to(z_ND.dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self.PROJS:
            stacked = getattr(self, name)
            for e in range(self.num_experts):
                destination[f"{prefix}{e}.{name}.weight"] = stacked[e] if keep_vars else stacked[e].detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        expected = set()
        for name in self.PROJS:
            stacked = getattr(self, name)
            for e in range(self.num_experts):
                key = f"{prefix}{e}.{name}.weight"
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                elif state_dict[key].shape != stacked.shape[1:]:
                    error_msgs.append(f"size mismatch for {key}: checkpoint {tuple(state_dict[key].shape)}, "
                                      f"model {tuple(stacked.shape[1:])}")
                else:
                    with torch.no_grad():
                        stacked[e].copy_(state_dict[key])
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)


class LatentMoE(nn.Module):
    """`block_sparse_moe`: y = up(RMSNorm(sum_k p_k E_k(down(x)))) + shared(x)."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        d, dl = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = TopKRouter(d, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_renormalize,
                               cfg.routed_scaling_factor)
        self.routed_expert_down_proj = nn.Linear(d, dl, bias=False)
        self.experts = RoutedExperts(cfg.num_experts, dl, cfg.moe_intermediate_size,
                                     cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.routed_expert_norm = RMSNorm(dl, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(dl, d, bias=False)
        self.shared_experts = None
        if cfg.num_shared_experts:
            self.shared_experts = SiTUMLP(d, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                          cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        ids_NK, w_NK = self.gate(x_ND)
        u_ND = self.experts(self.routed_expert_down_proj(x_ND), ids_NK, w_NK)
        if self.routed_expert_norm is not None:
            u_ND = self.routed_expert_norm(u_ND)
        y_ND = self.routed_expert_up_proj(u_ND)
        if self.shared_experts is not None:
            y_ND = y_ND + self.shared_experts(x_ND)
        return y_ND.view_as(x_BTD)
