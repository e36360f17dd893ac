"""Run tracking: every metric goes to a local `metrics.jsonl` in the run directory, and to Weights & Biases when
`tracking.logger=wandb` (online when a `WANDB_API_KEY` is set or `WANDB_MODE=online`, else offline files under
the run directory that `wandb sync` uploads later). Metric keys are namespaced (`rollout/`, `train/`, `sync/`,
`eval/`, `perf/`, `mem/`); tables (sampled completions) go to W&B and to `tables/<key>.jsonl`; `finish()` draws
the reward / accuracy / KL / loss curves into `curves.png` (matplotlib). A resumed run first cuts both back to the
checkpoint's step (`truncate_after`). wandb is imported only when it is used, and the API key is never written
anywhere by this module. On many ranks only rank 0 tracks (the metrics it logs are the global ones); the other
ranks hold a `NullTracker`.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_k3.utils.atomic import atomic_write_text

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("miles_k3.utils.tracking")
LOGGERS = ("none", "wandb")


@dataclass
class TrackingConfig:
    """Where metrics go besides the run directory's metrics.jsonl."""

    logger: str = "none"
    """none (metrics.jsonl only) or wandb."""
    project: str = "miles_k3"
    """W&B project."""
    run_name: str | None = None
    """W&B run name; None: the run directory's name."""
    mode: str = "auto"
    """W&B mode: auto (online with a WANDB_API_KEY or WANDB_MODE=online, else offline), online, offline."""

    def validate(self) -> None:
        if self.logger not in LOGGERS:
            raise ValueError(f"logger: '{self.logger}' is not one of {', '.join(LOGGERS)}")
        if self.mode not in ("auto", "online", "offline"):
            raise ValueError(f"mode: '{self.mode}' is not one of auto, online, offline")
        if self.logger == "wandb" and importlib.util.find_spec("wandb") is None:
            raise ValueError(f"logger: wandb is not installed; {WANDB_INSTALL}")


WANDB_INSTALL = ("pip install -e '.[wandb]' (from a checkout) or pip install 'miles-k3[wandb]', or use "
                 "tracking.logger=none")


class Tracker:
    """`log(metrics, step)`, `log_table(key, columns, rows, step)`, `finish()` (also as a context manager)."""

    def __init__(self, cfg: TrackingConfig, run_dir: str | os.PathLike, config: dict | None = None):
        cfg.validate()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed in finish)
        self._wandb = _start_wandb(cfg, self.run_dir, config or {}) if cfg.logger == "wandb" else None
        self.title = cfg.run_name or self.run_dir.name

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int | None = None) -> None:
        path = self.run_dir / "tables" / f"{key.replace('/', '_')}.jsonl"
        path.parent.mkdir(exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **dict(zip(columns, map(_jsonable, r)))}) + "\n" for r in rows)
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Table(columns=columns, data=[list(r) for r in rows])}, step=step)

    @property
    def wandb_dir(self) -> str | None:
        """The W&B run's local files (offline runs: what `wandb sync` uploads)."""
        return None if self._wandb is None else self._wandb.dir

    def finish(self) -> None:
        if not self._metrics.closed:
            self._metrics.close()
            write_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png", self.title)
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


class NullTracker:
    """The tracker of a rank other than 0: the same methods as `Tracker`, writing nothing (rank 0 logs the run's
    global metrics, and its run directory is the run's)."""

    wandb_dir = None

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Nothing: rank 0 logs the global metrics."""

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int | None = None) -> None:
        """Nothing: rank 0 logs the sampled completions."""

    def finish(self) -> None:
        """Nothing to close."""


def truncate_after(run_dir: str | os.PathLike, step: int) -> int:
    """Keep only the rows of steps <= `step` in `run_dir`'s metrics.jsonl and tables/*.jsonl (each rewritten to a
    temporary file and renamed): a run resumed from the checkpoint of `step` logs the later steps again, and a
    run killed after its last checkpoint had logged some of them already. Rows without a step are kept; a torn
    last line (a write cut by the kill) is dropped. Returns the number of rows dropped."""
    root = Path(run_dir)
    dropped = 0
    for path in [root / "metrics.jsonl", *sorted((root / "tables").glob("*.jsonl"))]:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        kept = [line for i, line in enumerate(lines) if _at_or_before(line, step, last=i == len(lines) - 1)]
        if len(kept) < len(lines):
            dropped += len(lines) - len(kept)
            atomic_write_text(path, "".join(kept))
    return dropped


def logged_evals(run_dir: str | os.PathLike, up_to: int) -> dict[int, dict[str, float]]:
    """The eval/ metrics that `run_dir`'s metrics.jsonl holds for steps <= `up_to`, by step: what a resumed run
    evaluated before its checkpoint (step 0's eval of the base included). Unreadable lines and non-numbers (a NaN
    is logged as "nan") are left out."""
    path = Path(run_dir) / "metrics.jsonl"
    evals: dict[int, dict[str, float]] = {}
    if not path.is_file():
        return evals
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or step > up_to:
            continue
        found = {k: v for k, v in row.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        if found:
            evals.setdefault(step, {}).update(found)
    return evals


def _at_or_before(line: str, step: int, last: bool) -> bool:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return not (last and not line.endswith("\n"))  # a torn last line goes; other lines are not ours to judge
    return not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] <= step


CURVES = ("rollout/reward_mean", "eval/avg@", "train/kl", "train/loss", "train/rollout_logprob_abs_diff",
          "train/grad_norm")
"""Metric keys (or key prefixes, e.g. every eval/avg@n) drawn in curves.png when a run logged them; a key's
`<key>_se` (eval/avg@n_se: the standard error across problems) is drawn as a band around it."""
PERCENT = ("eval/avg@",)
"""Accuracies, drawn in % as the run's summary prints them."""
SMOOTHING = 0.8
"""EMA weight of the per-step curves (drawn over the faint raw values): a light smoothing, about 5 steps."""


def curve_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The CURVES metrics (and their `_se` keys) of metrics.jsonl rows as (step, value) points in row order;
    non-numbers (NaN is logged as the string "nan") and rows without a step are left out."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for k, v in row.items():
            if (isinstance(v, (int, float)) and not isinstance(v, bool) and row.get("step") is not None
                    and any(k.startswith(c) for c in CURVES)):
                series.setdefault(k, []).append((row["step"], float(v)))
    return series


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Bias-corrected exponential moving average: out[t] = sum_i w^(t-i) (1-w) x_i / (1 - w^(t+1))."""
    out, acc = [], 0.0
    for t, x in enumerate(values):
        acc = weight * acc + (1 - weight) * x
        out.append(acc / (1 - weight ** (t + 1)))
    return out


def curves_figure(series: dict[str, list[tuple[int, float]]], title: str):
    """The matplotlib Figure of curves.png: one panel per metric (not the `_se` keys), titled `title`; eval
    accuracies in % with a +-1 standard-error band when their `_se` was logged; per-step metrics as an EMA
    (SMOOTHING) over the raw values drawn faint."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    keys = sorted(k for k in series if not (k.endswith("_se") and k.removesuffix("_se") in series))
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys) + 0.4), sharex=True, squeeze=False)
    for ax, k in zip(axes[:, 0], keys):
        scale = 100.0 if k.startswith(PERCENT) else 1.0
        x = [p[0] for p in series[k]]
        y = [scale * p[1] for p in series[k]]
        if k.startswith("eval/"):  # a few evaluations: points, no smoothing
            ax.plot(x, y, marker="o", markersize=3, label=k)
            se = dict(series.get(k + "_se", []))
            if se:
                lo = [v - scale * se.get(s, 0.0) for s, v in zip(x, y)]
                hi = [v + scale * se.get(s, 0.0) for s, v in zip(x, y)]
                ax.fill_between(x, lo, hi, alpha=0.25, label="±1 s.e.")
        else:
            (raw,) = ax.plot(x, y, alpha=0.3, linewidth=0.8, label="raw")
            ax.plot(x, ema(y), color=raw.get_color(), linewidth=1.5, label=f"EMA {SMOOTHING}")
        ax.set_ylabel(k + (" (%)" if scale != 1.0 else ""), fontsize=8)
        ax.legend(fontsize=6, loc="best")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def write_curves(metrics_file: Path, png: Path, title: str | None = None) -> Path | None:
    """curves.png of metrics.jsonl (`curves_figure`, titled `title`, default the run directory's name), written to
    a temporary file, then renamed; None when the file holds none of the CURVES metrics."""
    rows = [json.loads(line) for line in metrics_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    series = curve_series(rows)
    if not series:
        return None
    fig = curves_figure(series, title or metrics_file.parent.name)
    import matplotlib.pyplot as plt

    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png)
    return png


def _start_wandb(cfg: TrackingConfig, run_dir: Path, config: dict):
    try:
        import wandb
    except ImportError:
        raise RuntimeError(f"tracking.logger=wandb needs wandb: {WANDB_INSTALL}") from None
    mode = cfg.mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "online" else "offline"
    log.info("W&B: project %s, mode %s, files in %s", cfg.project, mode, run_dir)
    return wandb.init(project=cfg.project, name=cfg.run_name or run_dir.name, dir=str(run_dir), mode=mode,
                      config=config, reinit="finish_previous")


def _jsonable(v: Any) -> Any:
    """Numbers as floats/ints (NaN/inf as strings: JSON has none), tensors/numpy scalars via item()."""
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
