"""Multi-process tests: `run_ranks(world, fn, *args)` starts `world` processes as torchrun would (WORLD_SIZE,
RANK, LOCAL_RANK, MASTER_ADDR/PORT set), runs `fn(rank, *args)` in each and returns every rank's result, in rank
order. The backend is gloo on the CPU; MILES_K3_TEST_BACKEND=nccl runs the same tests on GPUs (one per rank), so
the multi-GPU machines reuse them unchanged. `fn` must be a module-level function (the processes are spawned)."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

BACKEND = os.environ.get("MILES_K3_TEST_BACKEND", "gloo")
DEVICE_TYPE = "cuda" if BACKEND == "nccl" else "cpu"


def test_device(rank: int) -> torch.device:
    """The device of `rank` under the test backend (cuda:rank with NCCL, the CPU with gloo)."""
    return torch.device(f"cuda:{rank}") if DEVICE_TYPE == "cuda" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, env: dict, fn, args) -> None:
    os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       **env})
    torch.set_num_threads(1)  # 2 cores shared by every rank
    result = fn(rank, *args)
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    # the library's teardown: a barrier, then the groups destroyed and gloo's threads joined before the interpreter
    # exits (a worker still dropping its last collective's tensors at exit aborts the process: SIGABRT)
    from miles_k3.parallel.mesh import leave_process_group
    leave_process_group()


def run_ranks(world: int, fn, *args, env: dict | None = None, timeout_s: float = 300.0) -> list:
    """Every rank's `fn(rank, *args)` (spawned processes); a rank's exception is raised here with its traceback;
    a run past `timeout_s` is killed and fails."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world, _free_port(), out_dir, env or {}, fn, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"run_ranks: {world} ranks of {fn.__name__} still running after {timeout_s} s")
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world)]
