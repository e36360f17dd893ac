"""The `launcher` and `ray:` config of `python -m miles_k3.train` and their checks (no Ray import: Ray is an optional
extra, imported when a run is launched on it, `miles_k3/ray_launch.py`).

`launcher=process` (the default) runs the loop in this process: one process, or one rank of a torchrun launch.
`launcher=ray` makes this process the driver of a Ray Train job (`TorchTrainer`): `ray.num_workers` workers run the
loop as the ranks of one process group that Ray starts, and Ray restarts the group after a worker dies.
`check_fleet` checks the run config of rollout.mode=fleet, whose rollouts are sampled by engine actors on Ray
(`trainer/fleet.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from importlib.util import find_spec
from typing import Optional

from miles_k3.parallel.config import ParallelConfig, ParallelConfigError

LAUNCHERS = ("process", "ray")
RAY_INSTALL = "pip install 'miles-k3[ray]'"
"""How to install the pinned Ray (pyproject's `ray` extra); in a checkout: pip install -e '.[ray]'."""


@dataclass
class RayConfig:
    """The Ray Train job of `launcher=ray` (docs/guides/ray.md); refused with launcher=process (it would do
    nothing)."""

    num_workers: int = 1
    """Training processes (Ray Train workers, each one rank of the mesh): parallel.dp x parallel.tp must equal it
    (parallel.dp defaults to num_workers / parallel.tp)."""
    address: str | None = None
    """The Ray cluster: null is ray.init's default (RAY_ADDRESS, which `ray job submit` sets; else the cluster that
    `ray start` last began on this machine; else a new local one); HOST:PORT, ray://HOST:PORT or auto name one,
    local starts a new one here. A cluster that does not answer within start_timeout_s is refused, naming it."""
    max_failures: int = 0
    """Restarts of the worker group after a worker fails or dies (Ray Train's FailureConfig.max_failures; -1: no
    limit). A restarted group resumes from the run's last complete checkpoint, so anything but 0 needs resume=auto."""
    cpus_per_worker: float = 1.0
    """CPUs each worker holds (Ray's CPU resource; its OMP_NUM_THREADS; threads= sets torch's)."""
    gpus_per_worker: Optional[int] = None  # noqa: UP045 (OmegaConf 2.3 structured configs need Optional)
    """GPUs each worker holds: 1 (it computes on cuda, NCCL) or 0 (the CPU, gloo); null: 1 under device=cuda, 0
    under device=cpu, and under device=auto 1 when the cluster has GPUs."""
    start_timeout_s: float = 60.0
    """How long the worker group may wait for its resources, at the start and at each restart (Ray Train's
    worker-group start timeout); past it the run stops, naming what the cluster lacks."""

    def validate(self) -> None:
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers: must be an integer >= 1, got {self.num_workers!r}")
        if self.max_failures < -1:
            raise ValueError(f"max_failures: must be >= -1 (-1: restart without limit), got {self.max_failures}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if not self.cpus_per_worker >= 0:
            raise ValueError(f"cpus_per_worker: must be >= 0, got {self.cpus_per_worker}")
        if self.gpus_per_worker not in (None, 0, 1):
            raise ValueError(f"gpus_per_worker: {self.gpus_per_worker}; a worker is one rank on one GPU "
                             "(cuda:LOCAL_RANK): use 1, 0 for the CPU, or null (from device)")


def default_ray_dp(launcher: str, parallel: ParallelConfig, ray: RayConfig) -> None:
    """launcher=ray: parallel.dp left null defaults to ray.num_workers / parallel.tp, as it defaults to torchrun's
    world / tp (set before the sections are validated; a tp that does not divide it is refused by
    `check_launcher`)."""
    if launcher == "ray" and parallel.dp is None and isinstance(parallel.tp, int) and parallel.tp >= 1 \
            and isinstance(ray.num_workers, int) and ray.num_workers % parallel.tp == 0:
        parallel.dp = ray.num_workers // parallel.tp


def check_launcher(launcher: str, ray: RayConfig, parallel: ParallelConfig, resume: str, device: str) -> None:
    """`launcher` is one of LAUNCHERS; launcher=ray: the mesh is ray.num_workers ranks, a restart can resume
    (resume=auto), each worker picks its own device; launcher=process: the ray: section is left at its defaults."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher: '{launcher}' is not one of {', '.join(LAUNCHERS)}")
    if launcher != "ray":
        changed = [f.name for f in fields(RayConfig) if getattr(ray, f.name) != getattr(RayConfig(), f.name)]
        if changed:
            raise ValueError(f"ray.{changed[0]}: set, but launcher={launcher} runs the loop in this process and "
                             "reads no ray: field; add launcher=ray")
        return
    if parallel.world_size != ray.num_workers:
        raise ParallelConfigError(f"parallel.dp x parallel.tp = {parallel.dp} x {parallel.tp} = "
                                  f"{parallel.world_size} but ray.num_workers={ray.num_workers}; set ray.num_workers="
                                  f"{parallel.world_size}, or leave parallel.dp null (num_workers / tp) with a "
                                  "parallel.tp that divides ray.num_workers")
    if ray.max_failures != 0 and (resume or "").strip().lower() != "auto":
        raise ValueError(f"resume: {resume} with ray.max_failures={ray.max_failures}; a restarted worker group "
                         "continues from the run's last checkpoint: set resume=auto (a fresh run_dir starts at "
                         "step 0), or ray.max_failures=0")
    if device.startswith("cuda:"):
        raise ValueError(f"device: {device} pins one GPU, and under launcher=ray each worker takes the GPU Ray gives "
                         "it; use device=cuda or device=auto")
    if (device, ray.gpus_per_worker) in (("cpu", 1), ("cuda", 0)):
        raise ValueError(f"ray.gpus_per_worker: {ray.gpus_per_worker} with device={device}; a worker computes on "
                         "the GPU it holds, or on the CPU without one: leave ray.gpus_per_worker null (from device)")


def check_fleet(cfg) -> None:
    """rollout.mode=fleet (`trainer.fleet`, docs/guides/ray.md) in the run config `cfg`: Ray installed; native
    engines (each builds its own K3 base); env=single's groups; one trainer process that starts the engine actors
    (launcher=process, no torchrun ranks); no routes (the engines do not return them)."""
    if cfg.rollout.mode != "fleet":
        return
    if find_spec("ray") is None:
        raise ValueError(f"rollout.mode: fleet runs its engines as Ray actors, and Ray is not installed; install it "
                         f"with {RAY_INSTALL}")
    if cfg.engine.backend != "native" or cfg.model.hf_path is not None:
        raise ValueError("engine.backend: rollout.mode=fleet's engines are native ones over a K3 base of their own; "
                         "set engine.backend=native (and model.path, not model.hf_path), or rollout.mode=sync")
    if cfg.env.name != "single":
        raise ValueError(f"env: {cfg.env.name}: rollout.mode=fleet plays single-turn groups (env=single); for "
                         "multi-turn episodes use rollout.mode=partial or sync")
    if cfg.launcher != "process":
        raise ValueError(f"launcher: {cfg.launcher} runs the loop on Ray Train's workers, and rollout.mode=fleet's "
                         "engine actors are started by one trainer process; set launcher=process (the engines run "
                         "on Ray all the same)")
    if cfg.parallel.world_size != 1:
        raise ValueError(f"parallel.dp: parallel.dp x parallel.tp = {cfg.parallel.world_size} ranks, and "
                         "rollout.mode=fleet is driven by one trainer process; set parallel.dp=1 parallel.tp=1, or "
                         "rollout.mode=partial")
    if cfg.rollout.return_routed_experts or cfg.trainer.routing_replay:
        raise ValueError("rollout.return_routed_experts: rollout.mode=fleet's engines do not return routes (nor "
                         "does trainer.routing_replay get them); set both off, or rollout.mode=partial")
