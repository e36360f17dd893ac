"""Every benchmark's result file: `write_result(name, figures)` writes `benchmarks/results/<name>.json` (or `out`),
one JSON object holding what was measured and how:

    {"name", "command" (the argv, as typed), "commit" (git HEAD), "dirty" (uncommitted changes to tracked files),
     "hardware" {"device", "cpu", "cpu_count", "torch", "cuda"}, "date" (UTC, ISO 8601), "figures"}

docs/measurements/*.md cite these files instead of narrating runs. `compile_figures(rows)`: the figures of a
training run's steps that waited on the compiler, which every benchmark of the training loop reports. The benchmarks import it as `from record import
write_result` (they run as `python benchmarks/<script>.py`, which puts this folder on sys.path).
"""
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict:
    """The GPU (torch.cuda's name of device 0, or None), the CPU model and core count, torch and CUDA versions."""
    info = {"device": None, "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": None, "cuda": None}
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["device"], info["cuda"] = torch.cuda.get_device_name(0), torch.version.cuda
    return info


def record(name: str, figures, argv: list[str] | None = None) -> dict:
    """The result object of `figures` (anything JSON can hold) measured by the command `argv` (default sys.argv)."""
    argv = list(sys.argv if argv is None else argv)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"name": name, "command": " ".join(["python", *argv]), "commit": _git("rev-parse", "HEAD"),
            "dirty": None if status is None else bool(status), "hardware": hardware(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "figures": figures}


def write_result(name: str, figures, out: str | os.PathLike | None = None, argv: list[str] | None = None) -> Path:
    """Write `record(name, figures, argv)` to `out` (default benchmarks/results/<name>.json) and return the path."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(name, figures, argv), indent=1, default=str) + "\n")
    print(f"result: {path}", file=sys.stderr, flush=True)
    return path


def compile_figures(rows: list[dict]) -> dict:
    """Of a training run's step rows (metrics.jsonl), on CUDA where perf/triton_new_<phase> is logged: the steps
    that added Triton cache entries (kernels compiled or tuned in them), their summed perf/step_s and the entries;
    {} where nothing was counted (the CPU)."""
    if not any(k.startswith("perf/triton_new_") for r in rows for k in r):
        return {}
    new = [sum(v for k, v in r.items() if k.startswith("perf/triton_new_")) for r in rows]
    return {"compiling_steps": sum(1 for n in new if n),
            "compiling_seconds": round(sum(r["perf/step_s"] for r, n in zip(rows, new) if n), 2),
            "triton_new": round(sum(new))}
