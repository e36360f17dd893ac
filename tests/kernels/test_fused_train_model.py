"""A whole model's training step through the fused training kernels (`fused.situ_glu_train`,
`fused_norm_train.rms_norm_train`, `fused_attn_res_train.attn_res_mix_train`) against the same step through the
torch references: loss and every parameter's gradient, with activation checkpointing, and with the norms and the
AttnRes pseudo-queries frozen (a LoRA run's shape: the activations need gradients, those weights do not).

CPU: `k3_nano` (fp32) under the Triton interpreter, in one subprocess (`layers._fused_eligible` is made to accept
CPU tensors there, so the same dispatch as on CUDA runs the kernels). GPU (`python -m pytest -m gpu
tests/kernels/test_fused_train_model.py`): the same on CUDA, in fp32 and bf16.

Criteria. The kernels differ from the references by fp32 rounding only (their own tests bound it per element), so
in fp32 the loss agrees to 1e-5 relative and each gradient to 1e-4 of its norm: four layers of ~1e-6 relative
differences, amplified by no more than the backward's condition (measured on CPU: below 1e-5). In bf16 a
one-ulp difference in an activation moves the rest of the step by bf16 rounding: 3e-2 of each gradient's norm.
Checkpointing recomputes the same kernels on the same inputs, so on the CPU it gives the same bits; freezing weights
only drops the kernels' weight-gradient outputs, so every other gradient keeps its bits too.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import gpu_test, interpreted

from miles_k3.model import layers
from miles_k3.model.build import ModelConfig, build_model

_FROZEN = ("norm", "attn_res_proj")  # RMSNorm weights and the AttnRes pseudo-queries (names containing these)


def _step(device: str, dtype: torch.dtype, reference: bool, checkpointing: bool = False,
          frozen: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    """Loss and gradients of one next-token step of k3_nano (seed 0) on fixed tokens; the fused training functions
    that ran (recorded by name)."""
    from miles_k3.kernels import fused, fused_attn_res_train, fused_norm_train

    ran: list[str] = []
    wrapped = [(fused, "situ_glu_train"), (fused_norm_train, "rms_norm_train"),
               (fused_attn_res_train, "attn_res_mix_train")]
    saved = [getattr(m, n) for m, n in wrapped]
    for (m, n), f in zip(wrapped, saved):
        setattr(m, n, lambda *a, _f=f, _n=n, **k: ran.append(_n) or _f(*a, **k))
    try:
        model = build_model(ModelConfig(name="k3_nano", experts="bf16", dtype="fp32" if dtype == torch.float32
                                        else "bf16"), torch.device(device), dtype, seed=0)
        for name, p in model.named_parameters():
            p.requires_grad_(not (frozen and any(f in name for f in _FROZEN)))
        model.activation_checkpointing = checkpointing
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7)).to(device)
        with layers.reference_kernels(reference):
            logits = model(ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))
            loss.backward()
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach().float().cpu(), grads, ran
    finally:
        for (m, n), f in zip(wrapped, saved):
            setattr(m, n, f)


def _close(got: dict, want: dict, rel: float, what: str) -> float:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    worst = 0.0
    for n, w in want.items():
        err = (got[n] - w).norm().item() / max(w.norm().item(), 1e-30)
        assert err <= rel, f"{what}: gradient of {n} off by {err:.2e} of its norm (allowed {rel:.0e})"
        worst = max(worst, err)
    return worst


def check_model_step(device: str, dtype: torch.dtype = torch.float32) -> None:
    loss_r, grads_r, ran_r = _step(device, dtype, reference=True)
    loss_f, grads_f, ran_f = _step(device, dtype, reference=False)
    assert not ran_r, ran_r
    assert {"situ_glu_train", "rms_norm_train", "attn_res_mix_train"} <= set(ran_f), sorted(set(ran_f))
    rel = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(loss_f, loss_r, rtol=rel / 10, atol=0)
    worst = _close(grads_f, grads_r, rel, "fused vs reference")
    print(f"{device} {dtype}: loss {loss_f.item():.6f} vs {loss_r.item():.6f}; worst gradient {worst:.2e} of its norm")

    loss_c, grads_c, _ = _step(device, dtype, reference=False, checkpointing=True)
    loss_z, grads_z, ran_z = _step(device, dtype, reference=False, frozen=True)
    assert {"rms_norm_train", "attn_res_mix_train"} <= set(ran_z), sorted(set(ran_z))
    assert not any(any(f in n for f in _FROZEN) for n in grads_z), "frozen weights got gradients"
    if device == "cpu":  # the same kernels on the same inputs: the same bits
        assert torch.equal(loss_c, loss_f) and all(torch.equal(grads_c[n], g) for n, g in grads_f.items())
        assert torch.equal(loss_z, loss_f) and all(torch.equal(g, grads_f[n]) for n, g in grads_z.items())
    else:  # GPU libraries may reduce in another order from run to run (fla's backward)
        _close(grads_c, grads_f, rel, "checkpointing")
        _close(grads_z, {n: grads_f[n] for n in grads_z}, rel, "frozen norms")


# ---- CPU: under the Triton interpreter --------------------------------------------------------------------------
_CODE = """
from miles_k3.model import layers
from test_fused_train_model import check_model_step
layers._fused_eligible = lambda x, *t: layers.fused_kernels_active() and all(
    u.dtype in layers._FUSED_DTYPES for u in (x, *t))  # as on CUDA, for CPU tensors
check_model_step("cpu")
"""


@pytest.mark.slow
def test_model_step_under_interpreter():
    out = interpreted(_CODE)
    assert "cpu torch.float32: loss" in out, out


# ---- GPU ----------------------------------------------------------------------------------------------------------
@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_model_step(dtype):
    check_model_step("cuda", dtype)
