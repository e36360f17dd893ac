"""`python -m miles_k3.train launcher=ray ray.num_workers=N ...`: the training loop on Ray Train's workers.

This process is the driver of a Ray Train job (`TorchTrainer`, Ray Train's v2 API): Ray reserves N workers
(`ray.cpus_per_worker` CPUs and `ray.gpus_per_worker` GPUs each, in one placement group), starts one torch process
group over them (gloo on the CPU, NCCL on GPUs; Ray sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR as torchrun
does) and runs `_worker_loop` on each: the loop of `miles_k3.train.train`, every worker one rank of the mesh
(`parallel.dp x parallel.tp = ray.num_workers`). When a worker fails or dies, Ray stops the group and starts a new
one (`FailureConfig(max_failures=ray.max_failures)`), which resumes from the run's last complete checkpoint
(`resume=auto`, as a torchrun restart does): the final adapter is the uninterrupted run's.

The run directory is the one a torchrun run writes (rank 0 writes train.log, metrics.jsonl, W&B, checkpoints;
this process writes Hydra's record), plus `ray/`, Ray Train's own records. Relative paths (run_dir, data files)
mean the driver's working directory, as on the command line.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path

from miles_k3.config import ConfigFieldError
from miles_k3.ray_config import RAY_INSTALL

log = logging.getLogger("miles_k3.train")
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
"""Ray Train's worker-group start timeout (read by its controller, which gets the driver's value)."""
RAY_RECORDS = "ray"
"""run_dir/ray: Ray Train's records of the job (its storage_path/name)."""
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""train.log's lines, as Hydra's job logging writes them."""
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
"""The workers' environment: print stays print (Ray Train would also log each print as a line of its own, so the
run's summary would come twice)."""


def import_ray():
    """Ray Train's modules; SystemExit with the install command when Ray is not installed."""
    try:
        import ray
        import ray.train
        import ray.train.torch
    except ImportError as e:
        raise SystemExit(f"miles_k3.train: launcher=ray needs Ray Train ({e}); install it with {RAY_INSTALL}") \
            from None
    return ray


def launch_on_ray(cfg, raw_yaml: str, loop: Callable) -> None:
    """Run `cfg` (validated, launcher=ray) as a Ray Train job and wait for it: each worker calls `loop(cfg,
    raw_yaml)` (`miles_k3.train.train`, which returns the Run; Ray pickles it by name). A cluster that cannot give the
    workers their resources within ray.start_timeout_s, at the start or at a restart, stops the run naming what it
    lacks (ConfigFieldError); a worker's user error (data, checkpoint, config) is raised as itself once Ray has used
    up its restarts; any other failure as Ray reports it."""
    ray = import_ray()
    from miles_k3.parallel.mesh import launched_by_torchrun

    if launched_by_torchrun():
        raise ConfigFieldError("launcher: ray, but this process is a rank of a torchrun launch; run one driver "
                               "(python -m miles_k3.train launcher=ray ...) and Ray starts the ranks")
    cfg.run_dir = str(Path(cfg.run_dir).resolve())  # every worker's, whatever its working directory
    if not ray.is_initialized():
        ray.init(address=check_reachable(cfg.ray.address, cfg.ray.start_timeout_s))
    gpus = gpus_per_worker(cfg.device, cfg.ray.gpus_per_worker, ray.cluster_resources())
    cfg.device = "cuda" if gpus else "cpu"  # chosen once, here, for every worker
    per_worker = {"CPU": float(cfg.ray.cpus_per_worker)} | ({"GPU": 1.0} if gpus else {})
    log.info("ray: %d workers x %s on %s (device=%s, %s); restarts: %s; run dir %s", cfg.ray.num_workers,
             _fmt(per_worker), ray.get_runtime_context().gcs_address, cfg.device, "NCCL" if gpus else "gloo",
             "no limit" if cfg.ray.max_failures == -1 else cfg.ray.max_failures, cfg.run_dir)
    trainer = _trainer(cfg, raw_yaml, loop, per_worker)
    try:
        with _env(START_TIMEOUT_ENV, str(cfg.ray.start_timeout_s)):
            trainer.fit()
    except ray.train.TrainingFailedError as e:
        raise _explained(e, cfg, per_worker, ray) from e


def check_reachable(address: str | None, timeout_s: float) -> str | None:
    """`address` (ray.address), checked: the cluster Ray would connect to, in Ray's own order (RAY_ADDRESS, then
    ray.address, then the cluster `ray start` last began on this machine; None: none, ray.init starts a local one),
    must accept a connection within `timeout_s`, else ConfigFieldError naming it (ray.init would wait for it without
    end)."""
    from ray._private.services import get_ray_address_from_environment

    where = ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else
             f"ray.address={address}" if address not in (None, "auto") else
             "the cluster `ray start` last began on this machine, /tmp/ray/ray_current_cluster")
    try:
        resolved = get_ray_address_from_environment(address, None)
    except ConnectionError as e:  # address=auto and no cluster here
        raise ConfigFieldError(f"ray.address: {address}: {e}") from None
    if resolved is None or resolved == "local":
        return address
    host, _, port = resolved.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ConfigFieldError(f"ray.address: no Ray cluster answers at {resolved} ({where}) within "
                               f"ray.start_timeout_s={timeout_s:g} ({e}); start one (ray start --head), or name "
                               "another (ray.address=HOST:PORT, or ray.address=local for a new one here)") from None
    return address


def gpus_per_worker(device: str, given: int | None, cluster: dict[str, float]) -> int:
    """1 when the workers compute on CUDA, 0 on the CPU: ray.gpus_per_worker when given (checked against device
    with the config), else from device; device=auto picks CUDA when the cluster has GPUs."""
    if given is not None:
        return given
    if device == "auto":
        return int(cluster.get("GPU", 0) > 0)
    return int(device == "cuda")


def _trainer(cfg, raw_yaml: str, loop: Callable, per_worker: dict[str, float]):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        _worker_loop,
        train_loop_config={"cfg": cfg, "raw_yaml": raw_yaml, "loop": loop, "cwd": os.getcwd()},
        torch_config=TorchConfig(timeout_s=math.ceil(cfg.parallel.timeout_s)),  # the collectives' timeout
        scaling_config=ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu="GPU" in per_worker,
                                     resources_per_worker=per_worker),
        # controller_failure_limit=0: a worker group that cannot start in time stops the run (Ray's default
        # retries it without end: a hang, not a refusal)
        run_config=RunConfig(name=RAY_RECORDS, storage_path=cfg.run_dir,
                             failure_config=FailureConfig(max_failures=cfg.ray.max_failures,
                                                          controller_failure_limit=0),
                             worker_runtime_env={"env_vars": WORKER_ENV}))


def _explained(error: Exception, cfg, per_worker: dict[str, float], ray) -> Exception:
    """What to raise for Ray's TrainingFailedError: a worker group that could not get its resources in time, as a
    ConfigFieldError naming what the cluster lacks; a worker's user error (the lowest rank's), as itself; else Ray's
    error."""
    from ray.train import ControllerError, WorkerGroupError
    from ray.train.v2._internal.exceptions import (
        InsufficientClusterResourcesError,
        WorkerGroupStartupTimeoutError,
    )

    from miles_k3.config import USER_ERRORS

    if isinstance(error, ControllerError) and isinstance(
            error.controller_failure, (WorkerGroupStartupTimeoutError, InsufficientClusterResourcesError)):
        return ConfigFieldError(f"ray.num_workers: the cluster did not give {cfg.ray.num_workers} workers x "
                                f"{_fmt(per_worker)} within ray.start_timeout_s={cfg.ray.start_timeout_s:g}: "
                                f"{missing_resources(per_worker, cfg.ray.num_workers, ray)}; lower ray.num_workers, "
                                "ray.cpus_per_worker or ray.gpus_per_worker, or add nodes that have them")
    if isinstance(error, WorkerGroupError):
        for rank in sorted(error.worker_failures):
            failure = error.worker_failures[rank]
            if isinstance(failure, USER_ERRORS):
                return failure
    return error


def missing_resources(per_worker: dict[str, float], num_workers: int, ray) -> str:
    """What a cluster lacks for `num_workers` x `per_worker`: the resources its nodes do not have in all, else those
    that other work holds now, else that no single node has one worker's share."""
    want = {k: v * num_workers for k, v in per_worker.items() if v > 0}
    total, free = ray.cluster_resources(), ray.available_resources()
    short = [f"{k} {total.get(k, 0.0):g} of the {v:g} needed" for k, v in want.items() if total.get(k, 0.0) < v]
    if short:
        return f"it has {', '.join(short)} ({_fmt({k: total.get(k, 0.0) for k in want})} in all)"
    busy = [f"{k} {free.get(k, 0.0):g} free of the {v:g} needed" for k, v in want.items() if free.get(k, 0.0) < v]
    if busy:
        return f"it has {_fmt(want)} in all, but other work holds some ({', '.join(busy)})"
    return f"it has {_fmt(want)} in all, but no node has one worker's {_fmt(per_worker)}"


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ---- on each worker ---------------------------------------------------------------------------------------------
def _worker_loop(config: dict) -> None:
    """One rank of the job (Ray Train runs it in a thread of its worker actor, the process group started): the
    driver's `loop` over `cfg`, from the driver's working directory, rank 0 appending its log lines to
    run_dir/train.log."""
    from miles_k3.cli import quiet_http_logs
    from miles_k3.launch import silence_fla_cpu_warning
    from miles_k3.parallel.mesh import shutdown

    cfg, cwd = config["cfg"], config["cwd"]
    if os.path.isdir(cwd):
        os.chdir(cwd)  # Ray Train starts its workers in a directory of its own
    rank = int(os.environ["RANK"])  # Ray Train's torch backend sets it, as torchrun does
    silence_fla_cpu_warning()
    quiet_http_logs()
    with _rank0_log(Path(cfg.run_dir), rank):  # the loop leaves signals to Ray here (StopFlag: main thread only)
        log_workers(rank)
        run = config["loop"](cfg, config["raw_yaml"])
        shutdown(run.ctx)


def log_workers(rank: int) -> None:
    """Rank 0 logs where every rank of this worker group runs: `ray: worker group of N: rank 0 pid P on HOST, ...`
    (a collective over the group Ray started)."""
    import torch.distributed as dist

    me = (os.getpid(), socket.gethostname())
    everyone = [me]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
    if rank == 0:
        log.info("ray: worker group of %d: %s", len(everyone),
                 ", ".join(f"rank {r} pid {pid} on {host}" for r, (pid, host) in enumerate(everyone)))


@contextlib.contextmanager
def _rank0_log(run_dir: Path, rank: int):
    """Rank 0's log records also go to run_dir/train.log (appended: the driver's Hydra writes there too), as
    torchrun's rank 0 writes them; Ray prints every worker's to the driver's console."""
    if rank != 0:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
