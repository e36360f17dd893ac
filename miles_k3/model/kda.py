"""K3 KDA (Kimi Delta Attention) layer, named as in the published checkpoint (`self_attn.*` of KDA layers).

Per token: q/k/v projections -> causal depthwise short conv (state: the last W-1 inputs) -> SiLU; L2-normalised
q/k (in the backend); decay gate g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)) in fp32;
beta = sigmoid(b_proj x); the delta-rule recurrence (fla-core: kernels on CUDA, references or our torch chunked
form on CPU, chosen by `KDABackend`); per-head RMSNorm gated by sigmoid(g_proj x); o_proj.

Tensor parallelism (`miles_k3.model.parallelize`): heads are split over the `tp_group` ranks, so
`num_heads` is this rank's count and the states hold this rank's heads. x enters the column projections
(q/k/v/g, b_proj, f_b_proj) through `copy_to`; f_a_proj (D -> K) is replicated and its output enters f_b_proj
through `copy_to`; o_proj takes this rank's head columns and its partial outputs are summed by `reduce_from`.
With `tp_group` None (one process) every one of these is the identity.

Right padding: positions t >= seq_lens[b] get g = 0 and beta = 0, which leaves the recurrent state untouched, so
the returned state is the state after each request's last real token.

Legend: B batch, T tokens, D hidden, H heads, K = V head dim, C = 3 * H * K (q|k|v channels), W conv taps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.kda_ops import KDABackend, lowerbound_gate
from miles_k3.model.layers import to_dtype, use_fused_kernels
from miles_k3.model.state import KDALayerState
from miles_k3.parallel.comm import copy_to, reduce_from

# The gated output norm's eps is fixed, not rms_norm_eps: SGLang's Kimi K3 (the release-day implementation) builds
# it with its constructor default 1e-5 whatever the config says (equal for every shipped config, all 1e-5).
OUTPUT_NORM_EPS = 1e-5

class KDAAttention(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        lac = cfg.linear_attn_config
        d = cfg.hidden_size
        self.num_heads, self.head_dim, self.conv_size = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        self.lower_bound = float(lac.gate_lower_bound)
        p = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(d, p, bias=False)
        self.k_proj = nn.Linear(d, p, bias=False)
        self.v_proj = nn.Linear(d, p, bias=False)
        self.q_conv1d = nn.Conv1d(p, p, self.conv_size, groups=p, bias=False)
        self.k_conv1d = nn.Conv1d(p, p, self.conv_size, groups=p, bias=False)
        self.v_conv1d = nn.Conv1d(p, p, self.conv_size, groups=p, bias=False)
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, p, bias=False)
        # One decay rate per head (the checkpoint pads A_log to a multiple of 128 entries; the loader unpads).
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(p))
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        self.g_proj = nn.Linear(d, p, bias=False)
        self.o_norm = _HeadNormWeight(self.head_dim)
        self.o_proj = nn.Linear(p, d, bias=False)
        self.norm_eps = OUTPUT_NORM_EPS
        self.tp_group = None
        """The tensor-parallel group the heads are split over (None: all heads here)."""
        self.fused_projections = None
        """The rollout engine's `FusedProjections` over q|k|v, g, b and f_a (None: each linear on its own); read by
        the decode step on the engine's pools only."""

    def state_bytes_per_request(self, tp: int = 1) -> int:
        """Recurrent state of this layer per request on the busiest of `tp` ranks: ceil(H/tp) x K x V fp32
        values, H this module's heads (heads are sharded across ranks; with tp > H they are replicated)."""
        return -(-self.num_heads // tp) * self.head_dim * self.head_dim * 4

    def empty_state(self, batch: int, device, dtype) -> KDALayerState:
        """Zero state: what a request holds before its first token."""
        c = 3 * self.num_heads * self.head_dim
        return KDALayerState(
            torch.zeros(batch, c, self.conv_size - 1, device=device, dtype=dtype),
            torch.zeros(batch, self.num_heads, self.head_dim, self.head_dim, device=device, dtype=torch.float32))

    def forward(self, x_BTD: torch.Tensor, backend: KDABackend, state: KDALayerState | None = None,
                seq_lens: torch.Tensor | None = None, decode: bool = False) -> tuple[torch.Tensor, KDALayerState]:
        """Full sequence (or one decode token with `decode=True`, which needs `state`).

        A pooled `state` (`KDALayerState.slots_B` set; decode only) is updated in place and returned as is.

        `seq_lens` [B] counts the real (left-aligned) tokens among the T; None means all T are real.
        Returns y [B, T, D] and the state after each request's last real token.
        """
        b, t, _ = x_BTD.shape
        if state is None:
            state = self.empty_state(b, x_BTD.device, x_BTD.dtype)
        if state.slots_B is not None:
            if not (decode and seq_lens is None):
                raise ValueError("a pooled KDA state (slots_B set) is only for decode steps (decode=True, no "
                                 "seq_lens)")
            return self._pooled_step(x_BTD, backend, state), state
        x_col = copy_to(x_BTD, self.tp_group)  # the input of the head-split (column) projections
        qkv_BTC, conv_BCW = self._short_conv(x_col, state.conv_BCW, seq_lens)
        shape = (b, t, self.num_heads, self.head_dim)
        q, k, v = (z.reshape(shape) for z in qkv_BTC.chunk(3, dim=-1))
        g_BTHK = lowerbound_gate(self._decay(x_BTD).view(shape), self.A_log, self.dt_bias, self.lower_bound)
        beta_BTH = torch.sigmoid(self.b_proj(x_col).float())
        if seq_lens is not None:
            real_BT = torch.arange(t, device=x_BTD.device) < seq_lens[:, None]
            g_BTHK = g_BTHK * real_BT[:, :, None, None]
            beta_BTH = beta_BTH * real_BT[:, :, None]
        if decode:
            o_BTHV, rec = backend.decode(q, k, v, g_BTHK, beta_BTH, state.recurrent_BHKV)
        else:
            o_BTHV, rec = backend.prefill(q, k, v, g_BTHK, beta_BTH, initial_state=state.recurrent_BHKV,
                                          output_final_state=True)
        return self._gated_output(o_BTHV, x_col), KDALayerState(conv_BCW, rec)

    def _pooled_step(self, x_B1D: torch.Tensor, backend: KDABackend, state: KDALayerState) -> torch.Tensor:
        """One decode token on the engine's pools: each request's conv window row is read and shifted in place,
        its recurrent row updated in place by `backend.decode_into`, which also applies the decay gate and beta's
        sigmoid (fla: inside its kernel) to the raw projections. On CUDA without autograd the short conv and the
        gated head norm are one fused kernel each (`miles_k3.kernels.kda_decode`); otherwise the torch code.
        q, k, v come out of one copy, each dense."""
        b = x_B1D.shape[0]
        x_col = copy_to(x_B1D, self.tp_group)
        group = self.fused_projections
        if group is not None and group.serves(x_col):  # q|k|v, g, b, f_a in one GEMM (+ 2 for adapters)
            qkv_B1C, gate_B1P, beta_B1H, fa_B1R = group(x_col)
        else:
            qkv_B1C, gate_B1P, beta_B1H, fa_B1R = self._qkv(x_col), None, self.b_proj(x_col), None
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        fused = use_fused_kernels(x_B1D, *convs, self.o_norm.weight)
        if fused:
            from miles_k3.kernels.kda_decode import short_conv_step
            act_B1C = short_conv_step(qkv_B1C[:, 0], state.conv_BCW, state.slots_B, convs)[:, None]
        else:
            act_B1C, conv_BCW = self._short_conv(x_col, state.conv_BCW[state.slots_B], None, qkv_B1C)
            state.conv_BCW.index_copy_(0, state.slots_B, conv_BCW.to(state.conv_BCW.dtype))
        qkv = act_B1C.view(b, 1, 3, self.num_heads, self.head_dim).permute(2, 0, 1, 3, 4).contiguous()
        f_B1HK = self._decay(x_B1D, fa_B1R).view(b, 1, self.num_heads, self.head_dim)
        o_B1HV = backend.decode_into(*qkv.unbind(0), f_B1HK, beta_B1H, self.A_log, self.dt_bias,
                                     self.lower_bound, state.recurrent_BHKV, state.slots_B)
        if gate_B1P is None:
            gate_B1P = self.g_proj(x_col)
        if fused:
            from miles_k3.kernels.kda_decode import gated_head_norm
            o_B1P = gated_head_norm(o_B1HV, gate_B1P, self.o_norm.weight, self.norm_eps, x_B1D.dtype)
            return reduce_from(self.o_proj(o_B1P), self.tp_group)
        return self._gated_output(o_B1HV, x_col, gate_B1P)

    def _decay(self, x_BTD: torch.Tensor, fa_BTR: torch.Tensor | None = None) -> torch.Tensor:
        """The raw decay-gate logits f_b(f_a(x)) [B, T, H*K] of this rank's heads (`fa_BTR`: f_a x when computed
        already). f_a is replicated: its output enters the head-split f_b through `copy_to`, so f_a (and its
        adapter) gets the whole gradient."""
        fa_BTR = self.f_a_proj(x_BTD) if fa_BTR is None else fa_BTR
        return self.f_b_proj(copy_to(fa_BTR, self.tp_group))

    def _qkv(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """The q|k|v projections before the short conv, [B, T, C]."""
        return torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], dim=-1)

    def _short_conv(self, x_BTD: torch.Tensor, conv_BCW: torch.Tensor, seq_lens: torch.Tensor | None,
                    qkv_BTC: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """SiLU(causal depthwise conv) of the q|k|v projections (`qkv_BTC` when computed already), continuing from
        the carried window.

        Returns the activations [B, T, C] (input dtype) and the new window: the last W-1 real inputs.
        """
        if qkv_BTC is None:
            qkv_BTC = self._qkv(x_BTD)
        seq_BCX = torch.cat([to_dtype(conv_BCW, qkv_BTC.dtype), qkv_BTC.transpose(1, 2)], dim=2)  # X = W-1+T
        weight = to_dtype(torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]), torch.float32)
        act_BCT = F.silu(F.conv1d(seq_BCX.float(), weight, groups=weight.shape[0]))
        w1 = self.conv_size - 1
        t = x_BTD.shape[1]
        if seq_lens is None:
            new_BCW = seq_BCX[:, :, t:]
        else:  # window ends at the last real token: positions seq_lens .. seq_lens + W - 2 of seq_BCX
            idx_BW = seq_lens[:, None] + torch.arange(w1, device=x_BTD.device)
            new_BCW = seq_BCX.gather(2, idx_BW[:, None, :].expand(-1, seq_BCX.shape[1], -1))
        return act_BCT.transpose(1, 2).to(x_BTD.dtype), new_BCW

    def _gated_output(self, o_BTHV: torch.Tensor, x_BTD: torch.Tensor, gate_BTP: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """o_proj( RMSNorm(o_h) * o_norm.weight * sigmoid(g_proj x)_h ), norm and gate in fp32 (`gate_BTP`: g_proj x
        when computed already); under TP `x_BTD` is the column projections' input and the rows' partial o_proj
        outputs are summed."""
        o = o_BTHV.float()
        weight = to_dtype(self.o_norm.weight, torch.float32)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * weight
        gate = torch.sigmoid((self.g_proj(x_BTD) if gate_BTP is None else gate_BTP).float()).view_as(o)
        y_BTD = self.o_proj((o * gate).reshape(*x_BTD.shape[:2], -1).to(x_BTD.dtype))
        return reduce_from(y_BTD, self.tp_group)


class _HeadNormWeight(nn.Module):
    """Holds `o_norm.weight` [K] (fp32 in the checkpoint), shared by all heads; applied in `_gated_output`."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
