"""benchmarks/record.py: a result file holds the command as typed, the commit with a dirty flag, the hardware, a
UTC date and the figures, at benchmarks/results/<name>.json or the path given."""
import datetime
import json
import subprocess

from bench_module import load_benchmark
from repo_helpers import REPO as ROOT

record = load_benchmark("record")


def test_write_result_records_command_commit_hardware_and_figures(tmp_path):
    out = tmp_path / "r" / "x.json"
    path = record.write_result("bench_x", {"step_s": 1.25, "rows": [{"batch": 64}]}, out=out,
                               argv=["benchmarks/bench_x.py", "--batches", "64"])
    assert path == out
    r = json.loads(out.read_text())
    assert r["name"] == "bench_x" and r["command"] == "python benchmarks/bench_x.py --batches 64"
    assert r["figures"] == {"step_s": 1.25, "rows": [{"batch": 64}]}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if head.returncode == 0:
        assert r["commit"] == head.stdout.strip() and isinstance(r["dirty"], bool)
    assert set(r["hardware"]) == {"device", "cpu", "cpu_count", "torch", "cuda"} and r["hardware"]["cpu_count"] >= 1
    assert datetime.datetime.fromisoformat(r["date"]).utcoffset() == datetime.timedelta(0)


def test_default_path_is_results_folder_by_name():
    assert record.RESULTS == ROOT / "benchmarks" / "results"


def test_every_benchmark_script_writes_its_result():
    """Each script under benchmarks/ (but the shared helpers) calls write_result with its own name."""
    helpers = {"record.py", "logprob_compare.py", "gpu_measure.py"}
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))
               if p.name not in helpers and f'write_result("{p.stem}"' not in p.read_text()]
    assert not missing, missing
