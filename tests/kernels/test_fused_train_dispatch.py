"""Which function `layers.RMSNorm` and `layers.attn_res_mix` call: with autograd on CUDA the differentiable fused
functions (`fused_norm_train.rms_norm_train`, `fused_attn_res_train.attn_res_mix_train`), without it the inference
kernels (`fused.rms_norm`, `fused.attn_res_mix`), and the torch references under `reference_kernels()` either way.
CUDA is simulated (`_fused_eligible` made to answer as it does on CUDA, keeping the reference switch); the kernels
are replaced by recorders that return the reference's values, so no kernel launches."""
from __future__ import annotations

import torch
from torch import nn

from miles_k3.kernels import fused, fused_attn_res_train, fused_norm_train
from miles_k3.model import layers
from miles_k3.model.layers import (
    RMSNorm,
    _attn_res_mix_torch,
    _rms_norm_torch,
    attn_res_mix,
    reference_kernels,
)


def _simulate_cuda(monkeypatch, calls: list[str]) -> None:
    def norm(name):
        return lambda x, w, eps, out_dtype=None: calls.append(name) or _rms_norm_torch(x, w, eps, out_dtype)

    def mix(name):
        return lambda srcs, nw, pw, eps: calls.append(name) or _attn_res_mix_torch(srcs, nw, pw, eps)

    monkeypatch.setattr(fused, "rms_norm", norm("rms_norm"))
    monkeypatch.setattr(fused_norm_train, "rms_norm_train", norm("rms_norm_train"))
    monkeypatch.setattr(fused, "attn_res_mix", mix("attn_res_mix"))
    monkeypatch.setattr(fused_attn_res_train, "attn_res_mix_train", mix("attn_res_mix_train"))
    monkeypatch.setattr(layers, "_fused_eligible", lambda *t: layers.fused_kernels_active())


def test_rms_norm_dispatch(monkeypatch):
    calls: list[str] = []
    _simulate_cuda(monkeypatch, calls)
    norm = RMSNorm(8, 1e-6)  # its weight requires grad (a full-parameter run)
    x = torch.randn(3, 8)
    norm(x)  # the weight needs a gradient
    norm(x.clone().requires_grad_())
    with torch.no_grad():
        norm(x)
    norm.weight.requires_grad_(False)  # LoRA: frozen norm weight, the activations still need gradients
    norm(x.clone().requires_grad_())
    norm(x)  # nothing needs a gradient
    assert calls == ["rms_norm_train", "rms_norm_train", "rms_norm", "rms_norm_train", "rms_norm"]
    with reference_kernels():
        norm(x.clone().requires_grad_())
        with torch.no_grad():
            norm(x)
    assert len(calls) == 5


def test_attn_res_mix_dispatch(monkeypatch):
    calls: list[str] = []
    _simulate_cuda(monkeypatch, calls)
    norm, proj = RMSNorm(8, 1e-6), nn.Linear(8, 1, bias=False)
    for p in (*norm.parameters(), *proj.parameters()):
        p.requires_grad_(False)
    srcs = [torch.randn(2, 3, 8) for _ in range(3)]
    attn_res_mix(srcs, norm, proj)  # nothing needs a gradient
    attn_res_mix(srcs[:2] + [srcs[2].clone().requires_grad_()], norm, proj)  # the partial sum does
    attn_res_mix([srcs[0].clone().requires_grad_()] + srcs[1:], norm, proj)  # a completed block does
    proj.weight.requires_grad_(True)
    attn_res_mix(srcs, norm, proj)  # the pseudo-query does
    with torch.no_grad():
        attn_res_mix(srcs, norm, proj)
    assert calls == ["attn_res_mix", "attn_res_mix_train", "attn_res_mix_train", "attn_res_mix_train",
                     "attn_res_mix"]
    with reference_kernels():
        attn_res_mix(srcs, norm, proj)
    assert len(calls) == 5
