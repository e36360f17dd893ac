"""benchmarks/bench_gap_sources.py on the CPU: its comparisons line up the engine's and the trainer's log-probs token
by token (a shift by one position would read ~nats, not fp32 rounding), and it sees bf16 rounding where there is
some. The GPU figures: docs/measurements/train-rollout-gap.md."""
import json
import subprocess
import sys

import pytest
from bench_module import load_benchmark

bench = load_benchmark("bench_gap_sources")


def test_abs_diffs_refuses_samples_of_other_lengths_and_p99_reads_the_tail():
    assert bench.abs_diffs([[1.0, -2.0], [0.5]], [[1.5, -1.0], [0.25]]) == [0.5, 1.0, 0.25]
    with pytest.raises(ValueError, match="sample 1: 2 log-probs against 1"):
        bench.abs_diffs([[0.0], [0.0, 0.0]], [[0.0], [0.0]])
    assert bench.p99([float(i) for i in range(200)]) == 198.0  # the 99th percentile of 0..199, nearest rank
    assert bench.p99([3.0]) == 3.0


@pytest.mark.slow
def test_fp32_sides_agree_to_rounding_and_bf16_shows_its_own(tmp_path):
    """k3_tiny (random init) on the CPU: the run in bf16, and the fp32 variant. In fp32 the engine's decode and the
    trainer's forward differ only in fp32 rounding (~1e-7 relative: well under 1e-5 nats), and the trainer's
    forward is the exact reference itself (same model: 0). In bf16 (8 mantissa bits, 4e-3 relative) each side is
    off the exact answer by more than 1e-4 nats per token, and the two disagree by more than 1e-4."""
    model_dir = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "miles_k3.init_checkpoint", "model=k3_tiny", f"out={model_dir}"],
                   check=True, capture_output=True)
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": f"{i} + {2 * i}", "answer": str(3 * i)}) + "\n"
                            for i in range(3)))
    rows = bench.run(["--model-dir", str(model_dir), "--data", str(data), "--device", "cpu", "--dtype", "bf16",
                      "--prompts", "3", "--n", "2", "--max-new-tokens", "12", "--budget-gib", "0.25",
                      "--variants", "default,fp32", "--json", str(tmp_path / "out.jsonl")])
    bf16, fp32 = rows
    assert (bf16["variant"], bf16["dtype"], fp32["dtype"]) == ("default", "torch.bfloat16", "torch.float32")
    assert fp32["tokens"] > 12 and bf16["tokens"] > 12
    assert fp32["gap"] < 1e-5 and fp32["engine_vs_exact"] < 1e-5 and fp32["trainer_vs_exact"] == 0.0
    assert fp32["trainer_batch"] < 1e-5 and fp32["route_mismatch_frac"] == 0.0
    assert bf16["gap"] > 1e-4 and bf16["engine_vs_exact"] > 1e-4 and bf16["trainer_vs_exact"] > 1e-4
    assert [json.loads(line)["variant"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [
        "default", "fp32"]
