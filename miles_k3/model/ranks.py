"""A command's place in the run's ranks, started before any weight is built: `start_ranks` checks the mesh
(`parallel:`) against the model's shapes from its config alone, joins torchrun's process group (`init_parallel`;
one process: SINGLE, nothing started) and picks this rank's device. `build_model(..., ctx)` then plans the rank's
shard on the meta device and reads only its slices of the checkpoint: the one sharded build of eval, sft and the
training dry run (steps=0), as of training (`launch.build_run`). `end_ranks` leaves the process group at the end.
"""
from __future__ import annotations

import logging
import os

import torch

from miles_k3.model.build import ModelConfig, load_k3_config
from miles_k3.model.parallelize import check_mesh
from miles_k3.parallel.config import ParallelConfig
from miles_k3.parallel.mesh import ParallelContext, init_parallel, leave_process_group
from miles_k3.utils.runtime import resolve_device


def start_ranks(model: ModelConfig, parallel: ParallelConfig, device: str) -> tuple[ParallelContext, torch.device]:
    """(this process's place in the mesh, its device): the mesh checked against `model`'s K3 config (a degree that
    does not divide a split dimension is refused naming parallel.tp / parallel.ep, before a process group starts),
    torchrun's world checked against parallel.dp x parallel.tp and its process group joined (gloo on the CPU, NCCL
    on CUDA), the device `device` resolves to, cuda:LOCAL_RANK for a CUDA run on many ranks. Without torchrun and
    with a mesh of one: (SINGLE, the resolved device). Every rank calls it together. Ranks other than 0 log
    warnings and errors only from here on: rank 0's lines say what every rank does (its build logs each rank's
    reads)."""
    if os.environ.get("RANK", "0") != "0":  # torchrun's rank, as init_parallel reads it
        logging.getLogger("miles_k3").setLevel(logging.WARNING)
    if model.hf_path is None and (parallel.tp > 1 or parallel.ep > 1):
        check_mesh(load_k3_config(model), parallel.tp, parallel.ep)
    resolved = resolve_device(device)
    ctx = init_parallel(parallel, resolved.type)
    if ctx.distributed and resolved.type == "cuda":
        resolved = torch.device("cuda", torch.cuda.current_device())  # made current by init_parallel
    return ctx, resolved


def end_ranks() -> None:
    """Leave the process group `start_ranks` joined (every rank, at the command's end: `leave_process_group` waits
    for the others and joins gloo's threads); nothing in one process."""
    leave_process_group()
