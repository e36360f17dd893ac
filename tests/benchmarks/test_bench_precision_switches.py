"""benchmarks/bench_precision_switches.py on the CPU: each timed train step runs under its own setting, each
setting's engine is built under it, the order alternates between rounds, the paired ratios are per round, and the
process's GEMM setting is given back. (Its timings mean something on a GPU only.)"""

import pytest
import torch
from bench_module import load_benchmark

bench = load_benchmark("bench_precision_switches")


def _flags(model):
    return (model.fp32_lm_head, model.model.fp32_residual,
            not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)


def test_every_step_and_engine_runs_under_its_own_setting_and_the_setting_is_given_back(monkeypatch):
    steps, engines = [], []
    real_step, real_engine = bench.train_step, bench.RolloutEngine

    def recording_step(model, *args, **kwargs):
        steps.append(_flags(model))
        return real_step(model, *args, **kwargs)

    def recording_engine(model, *args, **kwargs):
        engines.append(_flags(model))
        engine = real_engine(model, *args, **kwargs)
        assert (engine.model.fp32_lm_head, engine.model.model.fp32_residual) == engines[-1][:2]  # its twin's
        return engine

    monkeypatch.setattr(bench, "train_step", recording_step)
    monkeypatch.setattr(bench, "RolloutEngine", recording_engine)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    report = bench.run(["--model", "k3_tiny", "--device", "cpu", "--rounds", "2", "--seqs", "2", "--prompt", "4",
                        "--response", "3", "--new-tokens", "3", "--budget-gib", "0.1",
                        "--settings", "plain,fp32_res_head,fp32_gemm"])
    want = {"plain": (False, False, False), "fp32_res_head": (True, True, False), "fp32_gemm": (False, False, True)}
    assert engines == list(want.values())
    # rounds 0 (warm-up), 1, 2: the order reverses every round
    order = ["plain", "fp32_res_head", "fp32_gemm", "fp32_gemm", "fp32_res_head", "plain",
             "plain", "fp32_res_head", "fp32_gemm"]
    assert steps == [want[n] for n in order]
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True
    rows = report["settings"]
    assert rows["plain"]["train_s_over_plain"] == {"mean": 1.0, "se": 0.0, "median": 1.0}
    assert set(rows) == set(want) and all(r["train_s"] > 0 and r["rollout_s"] > 0 for r in rows.values())


def test_paired_ratios_and_refusals():
    assert bench.paired([1.0, 1.2, 1.1]) == pytest.approx({"mean": 1.1, "se": 0.1 / 3**0.5, "median": 1.1})
    with pytest.raises(SystemExit, match="include plain"):
        bench.run(["--settings", "fp32_head", "--device", "cpu"])
    with pytest.raises(SystemExit, match=r"\['fp64'\] not among"):
        bench.run(["--settings", "plain,fp64", "--device", "cpu"])
