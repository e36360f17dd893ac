"""Run tracking: every metric goes to a local `metrics.jsonl` in the run directory, and to Weights & Biases when
`tracking.logger=wandb` (online when a `WANDB_API_KEY` is set or `WANDB_MODE=online`, else offline files under
the run directory that `wandb sync` uploads later). Metric keys are namespaced (`rollout/`, `train/`, `sync/`,
`eval/`, `perf/`, `mem/`); tables (sampled completions) go to W&B and to `tables/<key>.jsonl`; `finish()` draws
the reward / accuracy / KL / loss curves into `curves.png` (matplotlib). wandb is imported
only when it is used, and the API key is never written anywhere by this module.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("miles_k3.tracking")
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


class Tracker:
    """`log(metrics, step)`, `log_table(key, columns, rows, step)`, `finish()` (also as a context manager)."""

    def __init__(self, cfg: TrackingConfig, run_dir: str | os.PathLike, config: dict | None = None):
        cfg.validate()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed in finish)
        self._wandb = _start_wandb(cfg, self.run_dir, config or {}) if cfg.logger == "wandb" else None

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
            write_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


CURVES = ("rollout/reward_mean", "eval/avg@", "train/kl", "train/loss", "train/rollout_logprob_abs_diff",
          "train/grad_norm")
"""Metric keys (or key prefixes, e.g. every eval/avg@n) drawn in curves.png when a run logged them."""


def write_curves(metrics_file: Path, png: Path) -> Path | None:
    """A PNG of the CURVES metrics against the step, one panel each (written to a temporary file, then renamed);
    None when the file holds none of them."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if isinstance(v, (int, float)) and row.get("step") is not None and any(k.startswith(c) for c in CURVES):
                series.setdefault(k, []).append((row["step"], v))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.2 * len(series)), sharex=True, squeeze=False)
    for ax, (k, pts) in zip(axes[:, 0], sorted(series.items())):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_ylabel(k, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png)
    return png


def _start_wandb(cfg: TrackingConfig, run_dir: Path, config: dict):
    try:
        import wandb
    except ImportError:
        raise RuntimeError("tracking.logger=wandb needs wandb: pip install 'miles-k3[wandb]' (or use "
                           "tracking.logger=none)") from None
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
