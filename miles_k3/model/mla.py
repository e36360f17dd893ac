"""K3 MLA (multi-head latent attention, no RoPE, sigmoid output gate), named as in the published checkpoint.

Two forms over the same weights:
* naive ("MHA mode", training and prefill): per-head keys/values are expanded from the latent with kv_b_proj and
  attended with SDPA (causal; past latents from a state are prepended per request);
* absorbed ("MQA mode", decode): W_UK is folded into the query and W_UV applied after attention, so attention runs
  directly over the cached 512+64 latent per token, exactly MQA with 576-dim keys and 512-dim values.

Tensor parallelism (`miles_k3.model.parallelize`): query heads are split over the `tp_group` ranks
(`num_heads` is this rank's count) and the single latent KV is replicated, as in SGLang. q_a_proj and
kv_a_proj_with_mqa (with their norms) run on every rank; their outputs (the q latent, the kv latent) and x before
g_proj enter the head-split projections through `copy_to`; o_proj takes this rank's head columns and its
partial outputs are summed by `reduce_from`. Both forms, so the cache (the latents) is the same on every rank.

Legend: B batch, T new tokens, S latent positions, H heads, R kv_lora_rank, P rope dims (unrotated: K3 is NoPE),
N nope dims, V value dims, L = R + P (cache width per token).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.layers import RMSNorm
from miles_k3.model.lora import effective_weight
from miles_k3.model.state import MLALayerState
from miles_k3.parallel.comm import copy_to, reduce_from


class MLAAttention(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.rank = h, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = (self.nope + self.rope) ** -0.5
        self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)  # as SGLang's K3 (deepseek_v2 MLA)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, h * self.v_dim, bias=False) if cfg.mla_use_output_gate else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        self.tp_group = None
        """The tensor-parallel group the query heads are split over (None: all heads here)."""
        self.fused_projections = None
        """The rollout engine's `FusedProjections` over q_a, kv_a and g (None: each linear on its own); read by the
        decode step on the engine's paged pool only."""

    # ---- pieces shared by both forms ---------------------------------------------------------------
    def cache_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Latent cache per token for this layer: (kv_lora_rank + rope dims) values (bf16 by default)."""
        return (self.rank + self.rope) * bytes_per_value

    def empty_state(self, batch: int, device, dtype) -> MLALayerState:
        """No latents yet: what a request holds before its first token."""
        return MLALayerState(torch.zeros(batch, 0, self.rank + self.rope, device=device, dtype=dtype))

    def _queries(self, x_BTD: torch.Tensor, qa_BTR: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope, q_rope) [B, T, H, *]; `qa_BTR`: q_a_proj x when computed already."""
        qa_BTR = self.q_a_proj(x_BTD) if qa_BTR is None else qa_BTR
        q = self.q_b_proj(copy_to(self.q_a_layernorm(qa_BTR), self.tp_group))
        q_BTHQ = q.view(*x_BTD.shape[:2], self.num_heads, self.nope + self.rope)
        return q_BTHQ[..., : self.nope], q_BTHQ[..., self.nope:]

    def _latents(self, x_BTD: torch.Tensor, c_kr: torch.Tensor | None = None) -> torch.Tensor:
        """The new latents [B, T, L] (replicated over TP; they enter every rank's heads through `copy_to`);
        `c_kr`: kv_a_proj_with_mqa x when computed already."""
        c_kr = self.kv_a_proj_with_mqa(x_BTD) if c_kr is None else c_kr
        c, k_r = c_kr[..., : self.rank], c_kr[..., self.rank:]
        return copy_to(torch.cat([self.kv_a_layernorm(c), k_r], dim=-1), self.tp_group)

    def _output(self, o_BTHV: torch.Tensor, x_BTD: torch.Tensor, gate_BTP: torch.Tensor | None = None
                ) -> torch.Tensor:
        """o_proj(o * sigmoid(g_proj x)) (`gate_BTP`: g_proj x when computed already)."""
        o = o_BTHV.reshape(*x_BTD.shape[:2], -1)
        if self.g_proj is not None:
            gate_BTP = self.g_proj(copy_to(x_BTD, self.tp_group)) if gate_BTP is None else gate_BTP
            o = o * torch.sigmoid(gate_BTP)
        return reduce_from(self.o_proj(o), self.tp_group)

    # ---- naive form -------------------------------------------------------------------------------
    def forward(self, x_BTD: torch.Tensor, state: MLALayerState | None = None,
                past_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, MLALayerState]:
        """Full-sequence attention over `state`'s first `past_lens[b]` latents plus the T new tokens.

        Returns the output [B, T, D] and the state with the new latents written at positions past_lens + t.
        """
        q_nope, q_rope = self._queries(x_BTD)
        new_BTL = self._latents(x_BTD)
        if state is None:
            latent_BSL, mask = new_BTL, None
        else:
            latent_BSL = write_latents(state.latent_BSL, past_lens, new_BTL)
            mask = _prefix_causal_mask(past_lens, x_BTD.shape[1], latent_BSL.shape[1])
        b, s = latent_BSL.shape[:2]
        kv = self.kv_b_proj(latent_BSL[..., : self.rank]).view(b, s, self.num_heads, self.nope + self.v_dim)
        k_rope = latent_BSL[..., self.rank:].unsqueeze(2).expand(b, s, self.num_heads, self.rope)
        k = torch.cat([kv[..., : self.nope], k_rope], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), kv[..., self.nope:].transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return self._output(o.transpose(1, 2), x_BTD), MLALayerState(latent_BSL)

    # ---- absorbed form ----------------------------------------------------------------------------
    def step(self, x_B1D: torch.Tensor, state: MLALayerState, past_lens: torch.Tensor
             ) -> tuple[torch.Tensor, MLALayerState]:
        """One decode token per request, attending over the cached latents (absorbed form). A contiguous
        `state` grows as needed (reads past_lens on the host); a paged `state` (table_BT set: the engine's
        static / graph step, no host sync) is updated in place and returned as is."""
        if state.table_BT is not None:
            return self._paged_step(x_B1D, state, past_lens)
        q_nope, q_rope = self._queries(x_B1D)
        latent_BSL = write_latents(state.latent_BSL, past_lens, self._latents(x_B1D))
        valid_BS = torch.arange(latent_BSL.shape[1], device=x_B1D.device) <= past_lens[:, None]
        o_BHV = self.absorbed_attention(q_nope[:, 0], q_rope[:, 0], latent_BSL, valid_BS)
        return self._output(o_BHV.unsqueeze(1), x_B1D), MLALayerState(latent_BSL)

    def _paged_step(self, x_B1D: torch.Tensor, state: MLALayerState, past_lens: torch.Tensor
                    ) -> tuple[torch.Tensor, MLALayerState]:
        """Decode over the paged pool: write the new latent at position past_lens[b] of its page, then attend
        over positions 0..past_lens[b] with the paged kernel (no gathered copy of the latents)."""
        from miles_k3.kernels.paged_mla import paged_latent_attention

        group = self.fused_projections
        qa = c_kr = gate = None
        if group is not None and group.serves(x_B1D):  # q_a, kv_a and g in one GEMM (+ 2 for adapters)
            qa, c_kr, *rest = group(x_B1D)
            gate = rest[0] if rest else None
        q_nope, q_rope = self._queries(x_B1D, qa)
        pool_GZL, table_BT = state.latent_BSL, state.table_BT
        rows_B = paged_rows(table_BT, past_lens, pool_GZL.shape[1]) if state.rows_B is None else state.rows_B
        attend_B = past_lens + 1 if state.attend_B is None else state.attend_B
        flat_pool = pool_GZL.view(-1, pool_GZL.shape[-1])
        flat_pool.index_copy_(0, rows_B, self._latents(x_B1D, c_kr)[:, 0].to(pool_GZL.dtype))
        w_uk_HNR, w_uv_HVR = self._absorbed_weights()
        q_lat_BHR = torch.einsum("bhn,hnr->bhr", q_nope[:, 0], w_uk_HNR)
        o_lat_BHR = paged_latent_attention(q_lat_BHR, q_rope[:, 0], pool_GZL, table_BT, attend_B, self.scale)
        o_BHV = torch.einsum("bhr,hvr->bhv", o_lat_BHR.to(x_B1D.dtype), w_uv_HVR)
        return self._output(o_BHV.unsqueeze(1), x_B1D, gate), state

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, N, R] and W_UV [H, V, R]: slices of kv_b_proj's effective weight (with its LoRA delta)."""
        w_HXR = effective_weight(self.kv_b_proj).view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w_HXR[:, : self.nope], w_HXR[:, self.nope:]

    def absorbed_attention(self, q_nope_BHN: torch.Tensor, q_rope_BHP: torch.Tensor,
                           latent_BSL: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        """MQA over latents: q_lat = W_UK^T q_nope; softmax (fp32) over valid positions; o = W_UV (p . c).

        Returns o [B, H, V] in the latent dtype. The eager engine gathers `latent_BSL` from its pages and calls
        this; its static / graph step attends over the pages directly (`_paged_step`).
        W_UK and W_UV are slices of kv_b_proj's effective weight (merged with its LoRA delta, if adapted).
        """
        w_uk_HNR, w_uv_HVR = self._absorbed_weights()
        c_BSR, kr_BSP = latent_BSL[..., : self.rank], latent_BSL[..., self.rank:]
        q_lat_BHR = torch.einsum("bhn,hnr->bhr", q_nope_BHN, w_uk_HNR)
        scores_BHS = (torch.einsum("bhr,bsr->bhs", q_lat_BHR, c_BSR)
                      + torch.einsum("bhp,bsp->bhs", q_rope_BHP, kr_BSP)).float() * self.scale
        scores_BHS = scores_BHS.masked_fill(~valid_BS[:, None, :], float("-inf"))
        p_BHS = torch.softmax(scores_BHS, dim=-1).to(latent_BSL.dtype)
        o_lat_BHR = torch.einsum("bhs,bsr->bhr", p_BHS, c_BSR)
        return torch.einsum("bhr,hvr->bhv", o_lat_BHR, w_uv_HVR)


def write_latents(past_BSL: torch.Tensor, past_lens: torch.Tensor, new_BTL: torch.Tensor) -> torch.Tensor:
    """A new latent tensor with `new_BTL[b, t]` at position past_lens[b] + t (capacity grown as needed, which
    reads past_lens on the host)."""
    b, t, width = new_BTL.shape
    latent = past_BSL
    need = int(past_lens.max()) + t if b else t
    if latent.shape[1] < need:
        latent = F.pad(latent, (0, 0, 0, need - latent.shape[1]))
    pos_BT = past_lens[:, None] + torch.arange(t, device=new_BTL.device)
    return latent.scatter(1, pos_BT.unsqueeze(-1).expand(b, t, width), new_BTL.to(latent.dtype))


def _prefix_causal_mask(past_lens: torch.Tensor, t: int, s: int) -> torch.Tensor:
    """[B, 1, T, S] bool: query t of request b sees positions j <= past_lens[b] + t."""
    j = torch.arange(s, device=past_lens.device)
    limit_BT = past_lens[:, None] + torch.arange(t, device=past_lens.device)
    return (j[None, None, :] <= limit_BT[:, :, None]).unsqueeze(1)


def paged_rows(table_BT: torch.Tensor, positions_B: torch.Tensor, page_size: int) -> torch.Tensor:
    """The flat pool row [B] of position positions_B[b] of request b: row positions % Z of page
    table_BT[b, positions // Z], i.e. page * Z + positions % Z."""
    page_B = table_BT.gather(1, (positions_B // page_size)[:, None])[:, 0]
    return page_B * page_size + positions_B % page_size
