"""`kernels:` (`miles_k3.model.kernel_config`): the train / eval / sft configs' kernel switches, validated with the
config, set once when the run starts (`apply_kernels`) and logged with the reason; the environment variables they
replaced are not read (a set one is warned about). GPU (`python -m pytest -m gpu
tests/model/test_kernel_config.py`): the config's choice decides which kernels a CUDA forward calls."""
import logging
import os
import subprocess
import sys

import pytest
import torch
from kernel_testing import gpu_test

from miles_k3.config import ConfigFieldError, compose_config
from miles_k3.model import experts, layers
from miles_k3.model.kernel_config import KernelsConfig, apply_kernels


@pytest.fixture(autouse=True)
def _process_defaults():
    """apply_kernels sets process-wide switches: every test leaves them as a fresh process has them."""
    yield
    experts.set_mxfp4_experts_backend("auto")
    layers.set_reference_kernels(False)


def test_defaults_are_auto_and_fused():
    for app in ("train", "eval", "sft"):
        cfg = compose_config(app, ["device=cpu"])
        assert (cfg.kernels.mxfp4_experts, cfg.kernels.reference) == ("auto", False), app
    assert layers.fused_kernels_active() and experts._mxfp4_forced == "auto"  # a process starts with the defaults


@pytest.mark.parametrize("app", ["train", "eval", "sft"])
def test_bad_values_fail_naming_the_field(app):
    with pytest.raises(ConfigFieldError, match=r"^kernels.mxfp4_experts: 'fast' is not one of auto, torch, triton$"):
        compose_config(app, ["kernels.mxfp4_experts=fast"])
    with pytest.raises(ConfigFieldError, match=r"^kernels.mxfp4_experts: triton is a CUDA kernel and device=cpu .* "
                                               r"use kernels.mxfp4_experts=auto \(torch on the CPU\) or torch$"):
        compose_config(app, ["device=cpu", "kernels.mxfp4_experts=triton"])
    cfg = compose_config(app, ["device=cpu", "kernels.mxfp4_experts=torch", "kernels.reference=true"])
    assert (cfg.kernels.mxfp4_experts, cfg.kernels.reference) == ("torch", True)


def test_triton_experts_on_auto_need_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigFieldError, match=r"^kernels.mxfp4_experts: triton is a CUDA kernel and device=auto"):
        compose_config("train", ["device=auto", "kernels.mxfp4_experts=triton"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert compose_config("train", ["device=auto", "kernels.mxfp4_experts=triton"]).kernels.mxfp4_experts == "triton"


def test_kernels_are_refused_where_no_k3_forward_runs():
    sglang = ["engine.backend=sglang", "model.path=null", "model.hf_path=/ckpt/qwen3"]
    assert compose_config("eval", sglang).kernels == KernelsConfig()  # the defaults are fine
    with pytest.raises(ConfigFieldError, match=r"^kernels.reference: does nothing here \(engine.backend=sglang: "
                                               r"SGLang generates with its own kernels.*remove the kernels: overrides"):
        compose_config("eval", [*sglang, "kernels.reference=true"])
    with pytest.raises(ConfigFieldError, match=r"^kernels.mxfp4_experts: does nothing here \(model.hf_path: "):
        compose_config("train", [*sglang, "kernels.mxfp4_experts=torch"])


def test_apply_logs_each_choice_once_with_its_reason(caplog):
    caplog.set_level(logging.INFO, logger="miles_k3.model.kernel_config")
    apply_kernels(KernelsConfig(mxfp4_experts="torch", reference=True), torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == [
        "mxfp4 experts: torch (kernels.mxfp4_experts=torch)",
        "fused kernels: torch references (kernels.reference=true)"]
    assert not layers.fused_kernels_active()
    assert experts.resolve_mxfp4_backend(torch.device("cuda")) == ("torch", "kernels.mxfp4_experts=torch")
    caplog.clear()
    apply_kernels(KernelsConfig(), torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == [
        "mxfp4 experts: torch (auto: cpu, no CUDA: dequantize + grouped matmul)",
        "fused kernels: torch references (cpu: the fused kernels run on CUDA only)"]
    assert layers.fused_kernels_active()
    backend, reason = experts.resolve_mxfp4_backend(torch.device("cuda"))  # what auto is on a GPU (no launch)
    assert backend == "triton" and reason.startswith("auto: CUDA available; bf16 projections of >= 134,217,728")
    with layers.reference_kernels():  # a test's block still overrides the config's choice, and restores it
        assert not layers.fused_kernels_active()
    assert layers.fused_kernels_active()


def test_a_set_env_var_is_ignored_with_one_warning_naming_its_field(monkeypatch, caplog):
    monkeypatch.setenv("MILES_K3_REFERENCE_KERNELS", "1")
    monkeypatch.setenv("MILES_K3_MXFP4_EXPERTS", "triton")
    caplog.set_level(logging.INFO, logger="miles_k3.model.kernel_config")
    apply_kernels(KernelsConfig(), torch.device("cpu"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        ("MILES_K3_MXFP4_EXPERTS=triton is set but no longer read: set kernels.mxfp4_experts in the config instead "
         "(this run uses kernels.mxfp4_experts=auto)"),
        ("MILES_K3_REFERENCE_KERNELS=1 is set but no longer read: set kernels.reference in the config instead "
         "(this run uses kernels.reference=false)")]
    assert layers.fused_kernels_active() and experts._mxfp4_forced == "auto"


def test_the_env_vars_are_not_read_at_import():
    code = ("from miles_k3.model import experts, layers; "
            "print(layers.fused_kernels_active(), experts._mxfp4_forced)")
    env = {"MILES_K3_REFERENCE_KERNELS": "1", "MILES_K3_MXFP4_EXPERTS": "torch", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True", "auto"]


def _forward_sees(engine) -> list[bool]:
    """fused_kernels_active() inside every RMSNorm forward of one prefill of `engine`'s model."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda *_: seen.append(layers.fused_kernels_active()))
             for m in engine.model.modules() if isinstance(m, layers.RMSNorm)]
    try:
        with torch.no_grad():
            engine.model(torch.tensor([[1, 2, 3]]))
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("reference", [True, False])
def test_the_eval_entry_point_takes_the_config_into_the_forward(reference):
    """python -m miles_k3.eval's eval_engine applies `kernels:`: kernels.reference=true makes every RMSNorm of
    the model's forward run with the fused kernels forced off (on CUDA: the torch references; GPU test below)."""
    from miles_k3.eval import eval_engine

    cfg = compose_config("eval", ["model=k3_tiny", "model.path=null", "model.experts=bf16", "device=cpu",
                                  "engine.max_context=64", "eval.max_new_tokens=8",
                                  f"kernels.reference={str(reference).lower()}"])
    engine, _, _ = eval_engine(cfg)
    seen = _forward_sees(engine)
    assert len(seen) > 4 and set(seen) == {not reference}


@gpu_test
@pytest.mark.parametrize("reference", [True, False])
def test_gpu_reference_config_decides_the_fused_calls(reference, monkeypatch):
    """On CUDA under no_grad, kernels.reference=true leaves the fused RMSNorm uncalled; false calls it."""
    from miles_k3.kernels import fused

    calls = []
    real = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    apply_kernels(KernelsConfig(reference=reference), torch.device("cuda"))
    norm = layers.RMSNorm(64, 1e-6).cuda()
    with torch.no_grad():
        norm(torch.randn(4, 64, device="cuda"))
    assert calls == ([] if reference else [1])


@gpu_test
@pytest.mark.parametrize("choice, kernel_calls", [("triton", 3), ("torch", 0), ("auto", 0)])
def test_gpu_mxfp4_experts_config_decides_the_kernel(choice, kernel_calls, monkeypatch):
    """A small MXFP4 experts forward (bf16, 8 x 64 x 32 weights: below FUSED_MIN_WEIGHTS; 40 tokens x 2 = 80 rows,
    above FUSED_MAX_ROWS) takes the fused kernel for each of its three projections only when
    kernels.mxfp4_experts=triton forces it."""
    import miles_k3.kernels.mxfp4_moe as mk

    calls = []
    real = mk.mxfp4_moe_matmul
    monkeypatch.setattr(mk, "mxfp4_moe_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    apply_kernels(KernelsConfig(mxfp4_experts=choice), torch.device("cuda"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = experts.RoutedExperts(8, 64, 32, 4.0, 25.0, expert_format="mxfp4")
        m.reset_parameters(std=0.05)
    ids = torch.randint(0, 8, (40, 2), device="cuda")
    with torch.no_grad():
        m(torch.randn(40, 64, device="cuda", dtype=torch.bfloat16), ids, torch.rand(40, 2, device="cuda"))
    assert len(calls) == kernel_calls
