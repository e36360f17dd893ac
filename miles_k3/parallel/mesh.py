"""The process groups of a run: `init_parallel` reads torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK),
starts the process group (NCCL on CUDA, gloo on CPU, with `parallel.timeout_s`), and builds the DeviceMesh
`("dp", "tp")` plus the EP groups (`config.py` gives the layout). Without torchrun it returns `SINGLE`: every
group trivial, today's one-process run unchanged.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles_k3.parallel.config import ParallelConfig, ParallelConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits: its rank and each group it belongs to (None: a group of one)."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    dp_group: object = None
    tp_group: object = None
    ep_group: object = None
    expert_replica_group: object = None
    """The ranks holding the same routed experts (same ep_rank in each EP group): their expert grads are summed."""
    mesh: object = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, W&B, the PEFT adapter and the run summary."""
        return self.rank == 0

    @classmethod
    def layout(cls, dp: int, tp: int, ep: int, rank: int) -> ParallelContext:
        """Rank `rank`'s place in a dp x tp mesh with ep expert ranks, without process groups (what a rank holds
        depends on its place only: planning and sizing need no process group). Ranks are dp-major (rank = dp_rank *
        tp + tp_rank); an EP group is ep consecutive ranks."""
        return cls(rank=rank, world_size=dp * tp, dp_rank=rank // tp, dp_size=dp, tp_rank=rank % tp, tp_size=tp,
                   ep_rank=rank % ep, ep_size=ep)

    def name(self) -> str:
        """`rank 3 (dp 1, tp 1, ep 3)`: how messages name this process."""
        return f"rank {self.rank} (dp {self.dp_rank}, tp {self.tp_rank}, ep {self.ep_rank})"

    def group(self, name: str):
        return {"dp": self.dp_group, "tp": self.tp_group, "ep": self.ep_group,
                "expert_replica": self.expert_replica_group}[name]

    def size(self, name: str) -> int:
        return {"dp": self.dp_size, "tp": self.tp_size, "ep": self.ep_size,
                "expert_replica": self.world_size // self.ep_size}[name]


SINGLE = ParallelContext()
RESTART_HINT = ("torchrun --max-restarts shares one rendezvous store between attempts, and a restarted rank can "
                "read a dead attempt's peer addresses from it (torch 2.13: 'Connection refused' on the restart, then "
                "a hang); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun, with --rdzv-backend c10d or "
                "--standalone (the static rendezvous always shares its store)")


def _store_per_attempt() -> bool:
    """torchrun was told to give every restart its own rendezvous store (see RESTART_HINT)."""
    return os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1"


def check_restarts(rank: int) -> None:
    """Refuse, on every rank before the process group starts, a torchrun launch whose restarts would share one
    rendezvous store: --max-restarts > 0 while its agent hands the workers its own store (torchrun sets
    TORCHELASTIC_USE_AGENT_STORE=True: TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset, or the static rendezvous). The
    workers cannot make that store safe (a prefix per attempt would need an attempt number every node agrees on;
    TORCHELASTIC_RESTART_COUNT differs between nodes), and a restart then fails ("Connection refused") or hangs."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ParallelConfigError(f"rank {rank}: torchrun --max-restarts {restarts} with one rendezvous store shared "
                                  f"by every attempt (TORCHELASTIC_USE_AGENT_STORE=True) would fail or hang at the "
                                  f"first restart: {RESTART_HINT}")


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_parallel(cfg: ParallelConfig, device_type: str) -> ParallelContext:
    """Start this process's groups for `cfg` (validated) on `device_type` ("cpu": gloo, "cuda": NCCL, the device
    cuda:LOCAL_RANK made current). One process (no torchrun, dp = tp = ep = 1): SINGLE, nothing started."""
    cfg.validate()  # parallel.dp (default: world / tp) resolved
    launched = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    cfg.check_world(world, launched)
    if world == 1:
        return SINGLE
    rank = int(os.environ["RANK"])
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ParallelConfigError(f"rank {rank}: LOCAL_RANK={local} but this node has "
                                      f"{torch.cuda.device_count()} CUDA device(s); start at most that many "
                                      "processes per node (torchrun --nproc-per-node)")
        torch.cuda.set_device(local)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        check_restarts(rank)
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        except Exception as err:  # the rendezvous: MASTER_ADDR/PORT unreachable, a peer that never came
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not _store_per_attempt()
            raise RuntimeError(f"rank {rank}: could not join the process group ({backend}, MASTER_ADDR="
                               f"{os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}) "
                               f"within parallel.timeout_s={cfg.timeout_s}: {err}"
                               + (f"; this is a restart: {RESTART_HINT}" if restarted else "")) from err
    return build_context(cfg, rank, world, device_type)


def build_context(cfg: ParallelConfig, rank: int, world: int, device_type: str) -> ParallelContext:
    """The groups of `rank` in an initialised default group of `world` ranks (every rank calls this together:
    creating a group is itself a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg.validate()  # parallel.dp resolved (default: world / tp)
    mesh = init_device_mesh(device_type, (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    ep_groups = replica_groups = []
    if cfg.ep > 1:  # creating a group is a collective of every rank: all of them call it, or none
        ep_groups = [dist.new_group(list(range(s, s + cfg.ep))) for s in range(0, world, cfg.ep)]
        replica_groups = [dist.new_group(list(range(i, world, cfg.ep))) for i in range(cfg.ep)]
    ctx = dataclasses.replace(
        ParallelContext.layout(cfg.dp, cfg.tp, cfg.ep, rank),
        dp_group=mesh.get_group("dp") if cfg.dp > 1 else None,
        tp_group=mesh.get_group("tp") if cfg.tp > 1 else None,
        ep_group=ep_groups[rank // cfg.ep] if cfg.ep > 1 else None,
        expert_replica_group=replica_groups[rank % cfg.ep] if cfg.ep > 1 and world // cfg.ep > 1 else None,
        mesh=mesh)
    log.info("parallel: %s of %d (dp=%d x tp=%d, ep=%d; %s)", ctx.name(), world, cfg.dp, cfg.tp, cfg.ep,
             dist.get_backend())
    return ctx


@contextlib.contextmanager
def naming_rank(ctx: ParallelContext):
    """Errors raised inside (a collective that timed out, a peer that died) say which rank saw them."""
    try:
        yield
    except Exception as err:
        if not ctx.distributed or str(err).startswith(f"rank {ctx.rank}"):
            raise
        if not _reconstructible(err):
            raise
        raise type(err)(f"{ctx.name()}: {err}") from err


def _reconstructible(err: Exception) -> bool:
    try:
        type(err)("x")
        return True
    except Exception:  # noqa: BLE001 - any constructor failure means "cannot rebuild it with a message"
        return False


def shutdown(ctx: ParallelContext) -> None:
    """Leave the process group at the run's end (`leave_process_group`); nothing in one process."""
    if ctx.distributed:
        leave_process_group()


def leave_process_group() -> None:
    """Every rank of the default group waits for the others, then destroys the groups and collects what held them.

    Why not `destroy_process_group()` alone: it keeps gloo's worker threads running (a group's threads are joined
    only when its last reference goes), and a worker that finished a collective drops the work's tensors after
    the caller has moved on: a Python decref, which takes the GIL. Taken during interpreter teardown, the GIL ends
    that thread inside a C++ destructor and the process aborts (SIGABRT, "terminate called without an active
    exception": once in a loaded CI run, rank 1 of a 2-rank test). The garbage collection here runs the groups'
    destructors, which release the GIL and join their threads, while the interpreter is alive (for groups nothing
    else still holds; a caller's ParallelContext keeps its groups to the end). The barrier waits (GIL released)
    until every rank is done, so no rank closes its connections while a peer still reads its last collective; a
    barrier that fails (a peer gone, or a group that already failed, where it was reported) is logged, and the
    groups are left all the same."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
    except Exception as err:  # noqa: BLE001 - any failure of the barrier: leave without it
        log.warning("rank %d: leaving the process group without the final barrier: %s", dist.get_rank(), err)
    dist.destroy_process_group()
    gc.collect()
