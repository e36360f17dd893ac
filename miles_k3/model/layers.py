"""Small K3 building blocks: RMSNorm, the SiTU activation and its GLU MLP, and the Block-AttnRes depth mixer.

Legend for tensor suffixes: B batch, T tokens, D hidden size, N number of residual sources, I MLP width.
Precision rules (K3 reference): RMSNorm variances, SiTU nonlinearities and AttnRes mixing run in fp32; results
are cast back to the activation dtype.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 variance; the weight multiplies after casting back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight.to(x.dtype)


def situ_gate(g: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU gate branch, fp32: beta * tanh(g / beta) * sigmoid(g). Soft-capped SiLU, range (-0.27, beta)."""
    g = g.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def situ_up(u: torch.Tensor, linear_beta: float | None) -> torch.Tensor:
    """SiTU up branch, fp32: linear_beta * tanh(u / linear_beta); identity when linear_beta is None."""
    u = u.float()
    return u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU(g, u) = situ_gate(g) * situ_up(u), computed in fp32 and returned in gate's dtype."""
    return (situ_gate(gate, beta) * situ_up(up, linear_beta)).to(gate.dtype)


class SiTUMLP(nn.Module):
    """Gated MLP `down(SiTU-GLU(gate(x), up(x)))`: the dense layer 0 (`mlp`) and the shared experts."""

    def __init__(self, hidden: int, inter: int, beta: float, linear_beta: float | None):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h = situ_glu(self.gate_proj(x_BTD), self.up_proj(x_BTD), self.beta, self.linear_beta)
        return self.down_proj(h)


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Block-AttnRes depth mixer over residual sources (completed blocks + the current partial sum).

    k_i = v_i / sqrt(mean(v_i^2) + eps); score_i = <norm.weight * proj.weight, k_i>; alpha = softmax_i(score);
    out = sum_i alpha_i v_i. All in fp32; returns the input dtype. `sources`: N tensors [..., D];
    `proj.weight` is the pseudo-query [1, D] and `norm.weight` the RMS weight gamma [D].
    """
    v_NBTD = torch.stack(sources).float()
    query_D = (norm.weight.float() * proj.weight.float()[0])
    k_NBTD = v_NBTD * torch.rsqrt(v_NBTD.pow(2).mean(-1, keepdim=True) + norm.eps)
    alpha_NBT = torch.softmax(k_NBTD @ query_D, dim=0)
    return (alpha_NBT.unsqueeze(-1) * v_NBTD).sum(0).to(sources[-1].dtype)
