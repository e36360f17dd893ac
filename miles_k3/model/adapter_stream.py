"""The PEFT adapter of a sharded run, written by rank 0 one tensor at a time: no rank ever holds the whole adapter.

A tp / ep run's LoRA is cut with its bases (`model.parallelize`): a column-parallel base's B rows and a row-parallel
base's A columns over tp, routed-expert LoRA by expert over ep. `save_adapter_streamed` writes the directory
`adapter.save_adapter` writes for the whole model (adapter_config.json, and adapter_model.safetensors with the same
keys, shapes and bytes: safetensors' order, by name for fp32 tensors). Rank 0 writes the header from the whole shapes
(each tensor's `Slice` in the shard plan), then the tensors in file order, each assembled from its pieces: its own,
or received point-to-point from the lowest rank holding the piece (`dist.recv`); every other rank sends the pieces
it is that rank of (`dist.send`), in the same order. Memory: rank 0 holds at most one whole PEFT tensor (one
expert's [r, In] for routed experts) and one received piece besides its parameters (`transient_bytes`); the others
send views of their parameters, nothing more. If rank 0 cannot write, it still receives every piece (no peer is left
waiting) and then raises.

Legend: E experts (E_l: a rank's), r rank, In / Out a projection's input / output width.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from miles_k3.model.adapter import PEFT_PREFIX, WEIGHTS_FILE, check_config_matches
from miles_k3.model.lora import LoRAConfig, expert_loras, lora_linears, lora_parameters
from miles_k3.parallel.grads import sharded_over
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.utils.atomic import atomic_directory

HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to a multiple of 8 bytes
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@dataclass(frozen=True)
class Piece:
    """Part of a whole PEFT tensor: parameter `param` of rank `src` (its row `row` along dim 0: a routed-expert
    LoRA's local expert; None: the whole parameter), placed at `start` along `dim` of the whole tensor."""

    src: int
    param: str
    row: int | None
    start: int
    dim: int


@dataclass(frozen=True)
class Entry:
    """One tensor of adapter_model.safetensors: its PEFT key, whole shape and dtype, and where its pieces are."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def export_layout(model: nn.Module, ctx: ParallelContext = SINGLE) -> list[Entry]:
    """Every tensor of the whole adapter's PEFT file in file order (by key), with its pieces on the ranks of `ctx`:
    the same list on every rank (from this rank's shard plan and the mesh's layout; no communication). Works on a
    meta model (`model_info`)."""
    plan = getattr(model, "shard_plan", None)  # an HF model has none
    prefix = getattr(model, "peft_prefix", PEFT_PREFIX)
    params = lora_parameters(model)
    first = _first_holders(ctx)
    entries = []
    for path, _ in lora_linears(model):
        for part in ("A", "B"):
            name = f"{path}.lora_{part}.weight"
            entries.append(_linear_entry(f"{prefix}{name}", name, params[name],
                                         None if plan is None else plan.slice_of(name), first))
    for path, proj, _ in expert_loras(model):
        for part in ("A", "B"):
            name = f"{path}.lora.{proj}.lora_{part}"
            p = params[name]
            part_slice = None if plan is None else plan.slice_of(name)
            held = p.shape[0]
            for e in range(held if part_slice is None else part_slice.full):
                src = 0 if part_slice is None else first[("ep", e // held)]
                entries.append(Entry(f"{prefix}{path}.{e}.{proj}.lora_{part}.weight", tuple(p.shape[1:]), p.dtype,
                                     (Piece(src, name, e % held, 0, 0),)))
    return sorted(entries, key=lambda e: e.key)


def _linear_entry(key: str, name: str, p: torch.Tensor, part, first: dict) -> Entry:
    if part is None:
        return Entry(key, tuple(p.shape), p.dtype, (Piece(0, name, None, 0, 0),))
    assert sharded_over(p) == ("tp",), (name, sharded_over(p))  # the planner cuts linear LoRA over tp only
    shape = list(p.shape)
    shape[part.dim] = part.full
    pieces = tuple(Piece(first[("tp", t)], name, None, t * part.length, part.dim)
                   for t in range(part.full // part.length))
    return Entry(key, tuple(shape), p.dtype, pieces)


def _first_holders(ctx: ParallelContext) -> dict[tuple[str, int], int]:
    """(group, index in it) -> the lowest global rank at that index: the rank that sends a piece held there (tp: the
    tp rank's slice, on dp replica 0; ep: the ep rank's experts, in EP group 0)."""
    first: dict[tuple[str, int], int] = {}
    for r in reversed(range(ctx.world_size)):
        c = ParallelContext.layout(ctx.dp_size, ctx.tp_size, ctx.ep_size, r)
        first[("tp", c.tp_rank)] = first[("ep", c.ep_rank)] = r
    return first


def transient_bytes(entries: list[Entry]) -> int:
    """What rank 0 holds at once beyond its parameters while it streams `entries`: the largest whole tensor plus,
    for one assembled from several pieces, one received piece (a tensor received whole is the received buffer)."""
    return max((e.nbytes + (e.nbytes // len(e.pieces) if len(e.pieces) > 1 else 0) for e in entries), default=0)


def save_adapter_streamed(model: nn.Module, lora_cfg: LoRAConfig, path: str | os.PathLike,
                          base_model_name_or_path: str | None, ctx: ParallelContext = SINGLE,
                          overwrite: bool = False) -> Path | None:
    """Every rank of `ctx` together: rank 0 writes the whole adapter as a PEFT directory at `path` (atomically,
    `save_adapter`'s files), receiving the other ranks' pieces one tensor at a time; the others send theirs. Returns
    the directory on rank 0, None elsewhere. Rank 0 raises after every piece was received when it could not write
    (a FileExistsError for an existing `path` without `overwrite`, an OSError, a config that is not the model's)."""
    entries = export_layout(model, ctx)
    params = lora_parameters(model)
    if not ctx.is_main:
        for entry in entries:
            for piece in entry.pieces:
                if piece.src == ctx.rank:
                    _send(_piece_data(params, piece), 0)
        return None
    tensors = _assembled(entries, params)
    try:
        check_config_matches(model, lora_cfg)
        with atomic_directory(path, overwrite) as tmp:
            _write_config(lora_cfg, tmp, base_model_name_or_path)
            _write_streamed(entries, tensors, tmp / WEIGHTS_FILE)
    except BaseException:
        for _ in tensors:  # the peers still send: take every piece, so that none waits for ever
            pass
        raise
    return Path(path)


def _piece_data(params: dict, piece: Piece) -> torch.Tensor:
    p = params[piece.param].detach()
    return (p if piece.row is None else p[piece.row]).contiguous()  # a view: both are contiguous already


def _send(t: torch.Tensor, dst: int) -> None:
    import torch.distributed as dist

    dist.send(t, dst=dst)


def _assembled(entries: list[Entry], params: dict) -> Iterator[torch.Tensor]:
    """Rank 0: each entry's whole tensor in turn (a view of its own parameter when it holds it whole)."""
    import torch.distributed as dist

    for entry in entries:
        if len(entry.pieces) == 1 and entry.pieces[0].src == 0:
            yield _piece_data(params, entry.pieces[0])
            continue
        like = params[entry.pieces[0].param]
        whole = None if len(entry.pieces) == 1 else torch.empty(entry.shape, dtype=entry.dtype, device=like.device)
        for piece in entry.pieces:
            if piece.src == 0:
                part = _piece_data(params, piece)
            else:
                shape = list(entry.shape)
                shape[piece.dim] = shape[piece.dim] // len(entry.pieces)
                part = torch.empty(shape, dtype=entry.dtype, device=like.device)
                dist.recv(part, src=piece.src)
            if whole is None:
                whole = part
            else:
                whole.narrow(piece.dim, piece.start, part.shape[piece.dim]).copy_(part)
            del part
        yield whole


def _write_config(lora_cfg: LoRAConfig, tmp: Path, base: str | None) -> None:
    from peft import LoraConfig  # lazy, as in adapter.save_adapter

    LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
               target_modules=list(lora_cfg.targets), use_rslora=lora_cfg.use_rslora, bias="none",
               modules_to_save=None, use_dora=False, fan_in_fan_out=False, init_lora_weights=True,
               inference_mode=True, task_type="CAUSAL_LM", base_model_name_or_path=base).save_pretrained(str(tmp))


def _write_streamed(entries: list[Entry], tensors: Iterator[torch.Tensor], file: Path) -> None:
    """safetensors' layout (8-byte header length, the JSON header with `__metadata__` first, space-padded to 8
    bytes, the payload), the header from the entries' shapes, each tensor written as it arrives."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for entry, t in zip(entries, tensors, strict=True):
            host = t.detach().to("cpu").contiguous()
            assert tuple(host.shape) == entry.shape, (entry.key, host.shape, entry.shape)
            if host.numel():
                f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
            del host, t

