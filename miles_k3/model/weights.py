"""Filling a planned model with its weights: every rank reads only the slices it holds.

A model is built on the meta device and cut to this rank's shard (`parallelize.parallelize`) before any weight
exists; `materialize` then allocates the shard shapes on the rank's device, once, and `load_weights` fills them
from a `WeightSource` (`weight_sources.py`): a checkpoint directory (`WeightFileReader`: the byte ranges of each
tensor's rank slice, read with `os.preadv` from the files that hold it, one file open at a time; TP tensors only
their rows or columns, routed experts only this rank's ids, replicated tensors whole) or the random init a seed
defines (`RandomInit`: the checkpoint `python -m miles_k3.init_checkpoint` writes for that seed, drawn slice by
slice). The reads are planned first (`plan_reads`: stored names, slices and byte counts from the model's own plan,
no payload read; `plan_ranges`: their byte ranges in the files, from the headers), so `model_info` sizes a rank's
load, in its own bytes and in the file pages it reads, from the same list the loader executes.

File pages (`file_reads.py`): a row-parallel weight's column slice is strided through every row of the file, so
reading it costs far more pages than its bytes. In a run with a TP process group such a tensor is exchanged
(`_exchange`): TP rank t reads the contiguous rows [t R/tp, (t+1) R/tp), all columns (exactly its own share of
bytes), and one all-to-all per chunk within the TP group gives every rank its columns of every row block. Every
other read is contiguous (rows, experts, whole tensors), so a rank pages in ~ its own bytes (K3 at tp=8 x ep=64:
1.0002x; docs/concepts/scale-out.md). Without a TP group (one process planning one rank of a mesh) the columns
are read per row, page by page. Rank 0 logs each rank's bytes, pages and exchanged bytes.

Memory: no full tensor of a sharded parameter is ever held. A read is staged on the host in chunks of rows of at
most STAGING_BYTES (64 MiB) of stored data (an exchange: three buffers of a third of it; an MXFP4 expert
conversion: one expert at a time, 17.5 MB for K3), then copied into its slice of the device tensor. Conversions of
the expert format work per expert: stored MXFP4 read into bf16 experts is dequantized, stored bf16 read into MXFP4
experts is quantized (floor rule).

Random init: a stored tensor's values are drawn in blocks of rows (block b of tensor `name` from a generator seeded
by (seed, name, b)), so a rank draws only the blocks that hold its rows, and of a column slice keeps only its
columns of each block as it is drawn (memory: the slice plus one block), and every mesh gets the weights of one
process; routed experts are stored tensors of their own (one expert each). Values are rounded to the stored dtype,
so a random base is bit for bit the checkpoint init_checkpoint writes for the seed. Adapters (`init_adapters`): A
is kaiming-uniform per tensor (expert LoRA: per expert) from (seed, name[, expert]), B zero, then sliced.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from miles_k3.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from miles_k3.model.experts import EXPERT_FORMATS, PROJS, RoutedExperts
from miles_k3.model.file_reads import GAP_BYTES, FileRanges, exchange_rows, exchanged, extent
from miles_k3.model.hollow import PayloadRange
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.lora import ExpertLoRA, LoRAConfig, LoRALinear, apply_lora
from miles_k3.model.parallelize import ShardPlan, Slice, parallelize
from miles_k3.model.weight_files import (
    CHECKPOINT_PREFIX,
    STORED_BYTES,
    TORCH_DTYPES,
    TensorSpec,
    WeightsError,
    meta_model,
    open_weights,
    skip_meta_init,
    spec_bytes,
)
from miles_k3.model.weight_sources import WeightFileReader, WeightSource, seeded_generator
from miles_k3.parallel.config import ParallelConfigError
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import gather, world_of

log = logging.getLogger(__name__)

STAGING_BYTES = 64 * 2**20
"""Stored bytes staged on the host per copy into the device (a chunk of rows of one read)."""


@dataclass(frozen=True)
class Read:
    """One read of a rank's load: the stored tensors `names` (checkpoint names; two for an MXFP4 pair) fill the
    model's state-dict entries `keys` (two for a quantized pair); `slice` is the part of the stored tensor read
    (None: whole); `convert` is None, "dequantize" (stored MXFP4 -> bf16 experts) or "quantize" (stored bf16 ->
    MXFP4 experts)."""

    keys: tuple[str, ...]
    names: tuple[str, ...]
    slice: Slice | None = None
    convert: str | None = None


@dataclass
class LoadStats:
    """What one rank read: stored bytes (its slices' own), from which files, of a checkpoint of `total_bytes` text
    bytes; the file pages its reads touched (`page_bytes`, each page once) in `ranges` contiguous ranges; the bytes it
    sent its TP group in exchanges (`exchanged_bytes`)."""

    bytes_read: int = 0
    files: set = field(default_factory=set)
    total_bytes: int = 0
    page_bytes: int = 0
    ranges: int = 0
    exchanged_bytes: int = 0

    def line(self, rank: int) -> str:
        ratio = f"{self.page_bytes / self.bytes_read:.4f}x" if self.bytes_read else "-"
        return (f"rank {rank} read {self.bytes_read:,} of {self.total_bytes:,} checkpoint bytes from "
                f"{len(self.files)} files: {self.page_bytes:,} bytes of file pages ({ratio}) in {self.ranges:,} "
                f"ranges, {self.exchanged_bytes:,} bytes exchanged over tp")


# ---- the read plan --------------------------------------------------------------------------------------------
class ModelLayout:
    """What a K3 (whole or cut, on any device) stores, listed once: its base tensors outside the routed experts
    (state-dict key, tensor; no adapters) and its RoutedExperts modules by path."""

    def __init__(self, model: K3ForCausalLM):
        self.config = model.config
        self.routed = [(path, m) for path, m in model.named_modules() if isinstance(m, RoutedExperts)]
        skip = {id(t) for _, m in self.routed for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
        self.base = [(key, t) for key, t in [*model.named_parameters(), *model.named_buffers()]
                     if "lora_" not in key and id(t) not in skip]


def plan_reads(model: K3ForCausalLM | ModelLayout, plan: ShardPlan, stored_format: str) -> list[Read]:
    """Every read that fills `model` (whole or already cut by `plan`, on any device, meta included; or its
    `ModelLayout`) with this rank's part of a checkpoint whose experts are stored as `stored_format`: one per base
    tensor (its plan slice, else whole; A_log its first heads: the stored tensor may be padded), and per held
    expert and projection one (or one pair) in the model's format. Adapters are not read (`init_adapters`)."""
    layout = model if isinstance(model, ModelLayout) else ModelLayout(model)
    reads = []
    for key, t in layout.base:
        if layout.config.tie_word_embeddings and key == "lm_head.weight":
            continue
        part = plan.slice_of(key)
        if part is None and key.endswith("A_log"):
            part = Slice(0, 0, t.shape[0], t.shape[0])
        reads.append(Read((key,), (CHECKPOINT_PREFIX + key,), part))
    for path, experts in layout.routed:
        held = plan.expert_range(path, experts.total_experts)
        for e in held.ids:
            for proj in PROJS:
                reads.extend(_expert_reads(f"{path}.{e}.{proj}", experts.expert_format, stored_format))
    return reads


def _expert_reads(base: str, model_format: str, stored_format: str) -> list[Read]:
    """The reads of one expert projection `base` (`...experts.{e}.w1`, a state-dict key without its suffix)."""
    name = CHECKPOINT_PREFIX + base
    if model_format == stored_format == "bf16":
        return [Read((f"{base}.weight",), (f"{name}.weight",))]
    if model_format == stored_format:
        return [Read((f"{base}.{k}",), (f"{name}.{k}",)) for k in ("weight_packed", "weight_scale")]
    if model_format == "bf16":
        return [Read((f"{base}.weight",), (f"{name}.weight_packed", f"{name}.weight_scale"), None, "dequantize")]
    return [Read((f"{base}.weight_packed", f"{base}.weight_scale"), (f"{name}.weight",), None, "quantize")]


def read_bytes(read: Read, specs: dict[str, TensorSpec], sizes: dict[str, int] | None = None) -> int:
    """Stored bytes `read` takes from its source (`specs`: the stored spec of each name; `sizes`, optional: their
    payload bytes, precomputed)."""
    total = sum(sizes[n] for n in read.names) if sizes is not None else sum(spec_bytes(specs[n]) for n in read.names)
    if read.slice is None:
        return total
    spec = specs[read.names[0]]
    return total // spec.shape[read.slice.dim] * read.slice.length


def plan_ranges(reads: list[Read], payload: dict[str, PayloadRange], tp: int = 1, tp_rank: int = 0,
                exchange: bool = True, gap: int = GAP_BYTES) -> FileRanges:
    """The file ranges the loader reads to execute `reads` on TP rank `tp_rank` of `tp`, from the stored tensors'
    byte offsets (`payload`: a checkpoint's headers, `hollow.payload_ranges`, or the published layout's,
    `hollow.published_payload_ranges`; no payload read): the ranges of every chunk `load_weights` reads, or with
    `exchange` (a run with a TP process group) an exchanged tensor's row block (`file_reads.exchanged`). Their
    `cost()` is the rank's file pages and contiguous ranges, exactly what the loader's reader records."""
    out = FileRanges()
    for read in reads:
        p = payload[read.names[0]]
        part = read.slice
        if read.convert is not None or part is None or part.dim == 0 or len(p.shape) == 1:
            for name in read.names:  # contiguous: its chunks are adjacent ranges, as one
                q = payload[name]
                ext = extent(q.begin, q.shape, STORED_BYTES[q.dtype], _index(part, q.shape))
                out.add_range(q.file, ext.offset, ext.offset + ext.nbytes)
        elif exchange and exchanged(p.shape, part, tp):
            r0, r1 = exchange_rows(p.shape[0], tp, tp_rank)
            row = (p.end - p.begin) // p.shape[0]
            out.add_range(p.file, p.begin + r0 * row, p.begin + r1 * row)
        else:  # strided: the ranges of each chunk, as the loader reads them
            for _, _, index in _row_chunks(part, TensorSpec(p.shape, p.dtype)):
                out.add(p.file, *extent(p.begin, p.shape, STORED_BYTES[p.dtype], index).ranges(gap))
    return out


def _index(part: Slice | None, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The index of `part` (None: whole) into a stored tensor of `shape`."""
    if part is None:
        return ()
    return (slice(None),) * part.dim + (slice(part.start, part.start + part.length),)


# ---- materialising and loading --------------------------------------------------------------------------------
def device_bytes(model: nn.Module) -> int:
    """Bytes the model's tensors take (each storage once): what `materialize` allocates for a meta model."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta tensor of `model` uninitialised storage on `device`, once, at its (shard) shape and dtype.
    Unlike `to_empty`, the Parameter objects keep their Python attributes (the gradient groups `parallelize`
    marked) and a tensor shared by two modules stays shared."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:  # (empty_strided: empty_like of a meta tensor goes through torch._refs)
                    new = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                        new.__dict__.update(t.__dict__)
                    done[id(t)] = new
                table[name] = done[id(t)]


def check_reads(model: K3ForCausalLM, plan: ShardPlan, source: WeightSource) -> list[Read]:
    """This rank's reads (`plan_reads` of `model`, whole or cut by `plan`, on any device: meta before anything is
    allocated), checked against the source before any weight is read: every name present, its stored shape and
    dtype the config's (only the files this rank reads are opened), every slice inside its stored tensor. Sorted
    by file, then by where the tensor lies in it (every rank of a TP group has its exchanged reads in one order).
    Raises WeightsError naming tensor and file."""
    reads = plan_reads(model, plan, source.expert_format)
    source.check([n for r in reads for n in r.names])
    _check_slices(reads, source)
    return sorted(reads, key=lambda r: (str(source.file(r.names[0]) or ""), source.offset(r.names[0]), r.names[0]))


def load_weights(model: K3ForCausalLM, reads: list[Read], source: WeightSource, ctx: ParallelContext = SINGLE
                 ) -> LoadStats:
    """Fill the materialised `model` by executing `reads` (`check_reads`) against `source`, slice by slice, with
    host staging bounded by STAGING_BYTES; a checkpoint's row-parallel column slices exchanged within `ctx`'s TP
    group when it has one (`_exchange`: every rank of the group must load the same checkpoint). Returns what was
    read."""
    views = model.state_dict(keep_vars=True)
    stats = LoadStats(total_bytes=source.total_bytes)
    group = ctx.tp_group if ctx.tp_size > 1 else None
    try:
        for read in reads:
            spec = source.spec(read.names[0])
            if (group is not None and read.convert is None and source.file(read.names[0]) is not None
                    and exchanged(spec.shape, read.slice, ctx.tp_size)):
                stats.exchanged_bytes += _exchange(read, views[read.keys[0]], source, ctx)
            else:
                _execute(read, views, source)
            stats.bytes_read += read_bytes(read, {n: source.spec(n) for n in read.names})
            stats.files.update(f for f in map(source.file, read.names) if f is not None)
    finally:
        source.close()
    stats.page_bytes, stats.ranges = source.pages()
    return stats


def _check_slices(reads: list[Read], source: WeightSource) -> None:
    """A planned slice lies inside its stored tensor (a config whose shapes do not match the checkpoint's)."""
    for read in reads:
        s = read.slice
        if s is None:
            continue
        shape = source.spec(read.names[0]).shape
        if s.dim >= len(shape) or s.start + s.length > shape[s.dim]:
            raise WeightsError(f"tensor '{read.names[0]}' in {source.file(read.names[0])}: this rank reads "
                                  f"[{s.start}, {s.start + s.length}) along dim {s.dim}, outside its stored shape "
                                  f"{list(shape)}; the mesh or config.json does not match the checkpoint")


@torch.no_grad()
def _execute(read: Read, views: dict[str, torch.Tensor], source: WeightSource) -> None:
    if read.convert == "dequantize":
        target = views[read.keys[0]]
        exact = target.dtype if target.dtype in (torch.bfloat16, torch.float32) else torch.float32
        packed, scale = (source.read(n, (slice(None),), target.device) for n in read.names)
        target.copy_(dequantize_mxfp4(packed, scale, exact))
        return
    if read.convert == "quantize":
        packed, scale = quantize_mxfp4(source.read(read.names[0], (slice(None),), views[read.keys[0]].device),
                                       "floor")
        views[read.keys[0]].copy_(packed)
        views[read.keys[1]].copy_(scale)
        return
    name, target = read.names[0], views[read.keys[0]]
    for r0, r1, index in _row_chunks(read.slice, source.spec(name)):
        target.narrow(0, r0, r1 - r0).copy_(source.read(name, index, target.device))


def _row_chunks(part: Slice | None, spec: TensorSpec):
    """(first, stop, index) of each chunk a read of `part` (None: whole) of a stored tensor of `spec` is staged in:
    rows [first, stop) of the rank's target, `index` into the stored tensor, at most STAGING_BYTES of stored data
    (at least one row)."""
    rows = spec.shape[0] if part is None or part.dim != 0 else part.length
    first = part.start if part is not None and part.dim == 0 else 0
    row_bytes = max(1, spec_bytes(spec) // max(1, spec.shape[0]))
    if part is not None and part.dim != 0:
        row_bytes = max(1, row_bytes // spec.shape[part.dim] * part.length)
    step = max(1, STAGING_BYTES // row_bytes)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        index = [slice(first + r0, first + r1)] + [slice(None)] * (len(spec.shape) - 1)
        if part is not None and part.dim != 0:
            index[part.dim] = slice(part.start, part.start + part.length)
        yield r0, r1, tuple(index)


def _exchange_chunks(spec: TensorSpec, tp: int, tp_rank: int):
    """(first, stop, index) of each round of an exchange of a tensor of `spec` (2-D, rows divisible by tp): rows
    [first, stop) of every row block, `index` this rank's rows of them, so that its read, the buffer sent and the one
    received each hold at most a third of STAGING_BYTES."""
    block0, block1 = exchange_rows(spec.shape[0], tp, tp_rank)
    row_bytes = spec_bytes(spec) // spec.shape[0]
    step = max(1, STAGING_BYTES // 3 // row_bytes)
    for r0 in range(0, block1 - block0, step):
        r1 = min(block1 - block0, r0 + step)
        yield r0, r1, (slice(block0 + r0, block0 + r1),)


@torch.no_grad()
def _exchange(read: Read, target: torch.Tensor, source: WeightFileReader, ctx: ParallelContext) -> int:
    """Fill `target` (this rank's columns [t C/tp, (t+1) C/tp) of a stored [R, C] tensor, all rows) through the TP
    group: in rounds of rows (`_exchange_chunks`), every TP rank t reads its rows of block t (contiguous, all
    columns), cuts them into tp column blocks and sends block j to rank j (`all_to_all_single`, stored bytes on the
    target's device); what rank j receives from rank t is its columns of rows of block t. The three buffers (read,
    sent, received) are one allocation per tensor. Returns the bytes this rank sent to the others."""
    name = read.names[0]
    spec = source.spec(name)
    tp, part, device = ctx.tp_size, read.slice, target.device
    assert part.start == ctx.tp_rank * part.length, (name, part, ctx.name())  # the plan's tp split
    block = spec.shape[0] // tp
    row_bytes = spec_bytes(spec) // spec.shape[0]
    chunks = list(_exchange_chunks(spec, tp, ctx.tp_rank))
    size = max(r1 - r0 for r0, r1, _ in chunks) * row_bytes
    if device.type == "cpu":
        host, send_buf, got_buf = torch.empty(3 * size, dtype=torch.uint8).split(size)
    else:
        host = torch.empty(size, dtype=torch.uint8)
        send_buf, got_buf = torch.empty(2 * size, dtype=torch.uint8, device=device).split(size)
    sent = 0
    for r0, r1, index in chunks:
        k, n = r1 - r0, (r1 - r0) * row_bytes
        source.read(name, index, device, out=host[:n])
        send = send_buf[:n].view(tp, k, row_bytes // tp)  # [tp, k, the columns of rank j]
        send.copy_(host[:n].to(device).view(k, tp, row_bytes // tp).transpose(0, 1))
        got = got_buf[:n]
        _all_to_all(got, send, ctx.tp_group)
        values = got.view(TORCH_DTYPES[spec.dtype]).view(tp, k, part.length)
        for t in range(tp):
            target.narrow(0, t * block + r0, k).copy_(values[t])
        sent += (tp - 1) * n // tp
    return sent


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Split j of `inp` to group rank j, split j of `out` from it (equal splits)."""
    dist.all_to_all_single(out.view(-1), inp.view(-1), group=group)


# ---- adapters -------------------------------------------------------------------------------------------------
@torch.no_grad()
def init_adapters(model: nn.Module, plan: ShardPlan, seed: int) -> None:
    """Initialise the LoRA adapters of a materialised, planned `model` as one process would: B zero; A
    kaiming-uniform (a=sqrt(5): U(+-1/sqrt(In)) for the whole In) drawn whole per adapter from (seed, its key)
    and cut to this rank's slice; expert LoRA's A [E, r, In] per held expert from (seed, key, expert id)."""
    for path, m in model.named_modules():
        if isinstance(m, LoRALinear):
            _init_linear_a(m.lora_A.weight, f"{path}.lora_A.weight", plan, seed)
            m.lora_B.weight.zero_()
        elif isinstance(m, ExpertLoRA):
            experts_path = path.rsplit(".lora.", 1)[0]
            held = plan.expert_range(experts_path, model.get_submodule(experts_path).total_experts)
            bound = 1.0 / m.lora_A.shape[2] ** 0.5
            for i, e in enumerate(held.ids):
                gen = seeded_generator(seed, f"{path}.lora_A", e)
                m.lora_A[i].copy_(torch.empty(m.lora_A.shape[1:]).uniform_(-bound, bound, generator=gen))
            m.lora_B.zero_()


def _init_linear_a(a: torch.Tensor, key: str, plan: ShardPlan, seed: int) -> None:
    part = plan.slice_of(key)
    shape = list(a.shape)
    if part is not None:
        shape[part.dim] = part.full
    bound = 1.0 / shape[1] ** 0.5
    whole = torch.empty(shape).uniform_(-bound, bound, generator=seeded_generator(seed, key, 0))
    a.copy_(whole if part is None else part.of(whole))


# ---- the one build path ---------------------------------------------------------------------------------------
def build_k3(source: WeightSource, expert_format: str, device: torch.device, dtype: torch.dtype,
             ctx: ParallelContext = SINGLE, lora: LoRAConfig | None = None, seed: int = 0,
             kda_backend: str = "auto") -> K3ForCausalLM:
    """This rank's K3 from `source`, frozen, on `device` in `dtype` (fp32 families kept), experts in
    `expert_format`, with `lora` attached (fp32, initialised by `init_adapters` from `seed`): planned on the meta
    device (`parallelize` for `ctx`), its reads checked against the source and its bytes against the device on every
    rank (a problem on any rank is raised on every rank, naming it, before anything is allocated), then allocated
    once at the shard shapes and filled slice by slice. On the meta device the planned model is returned as is.
    Rank 0 logs one line per rank: `rank R read B of T checkpoint bytes from F files`."""
    with skip_meta_init():
        model = meta_model(source.config, expert_format, kda_backend).requires_grad_(False)  # the base is frozen
        if lora is not None:
            apply_lora(model, lora)
    plan = parallelize(model, ctx)
    model.cast(dtype)
    if device.type == "meta":
        return model
    reads = _agreed(ctx, WeightsError, lambda: check_reads(model, plan, source))
    _agreed(ctx, ParallelConfigError, lambda: check_fits(model, device, ctx))
    materialize(model, device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    stats = load_weights(model, reads, source, ctx)
    if lora is not None:
        init_adapters(model, plan, seed)
    model.kda_backend(device)
    if isinstance(source, WeightFileReader):
        lines = gather(stats.line(ctx.rank), world_of(ctx))
        for line in lines if ctx.is_main else ():
            log.info("%s", line)
    return model


def load_k3(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
            expert_format: str = "auto", kda_backend: str = "auto") -> K3ForCausalLM:
    """The whole K3 of a weights directory (one process), frozen, on `device` in `dtype` (fp32 families kept).
    `expert_format`: "auto" keeps the stored format; "bf16" on an MXFP4 checkpoint dequantizes while loading
    (references, benchmarks); "mxfp4" on a bf16 checkpoint quantizes while loading (floor rule)."""
    if expert_format not in ("auto", *EXPERT_FORMATS):
        raise WeightsError(f"expert_format: '{expert_format}' is not one of auto, {', '.join(EXPERT_FORMATS)}")
    if not dtype.is_floating_point:
        raise WeightsError(f"dtype: {dtype} is not a floating-point dtype; use torch.bfloat16 or torch.float32")
    index = open_weights(path)
    fmt = index.expert_format if expert_format == "auto" else expert_format
    model = build_k3(WeightFileReader(index), fmt, torch.device(device), dtype, kda_backend=kda_backend)
    log.info("loaded %s: %d tensors, experts %s%s", index.path, len(index.locations), fmt,
             "" if fmt == index.expert_format else f" (stored {index.expert_format})")
    return model


def check_fits(model: nn.Module, device: torch.device, ctx: ParallelContext = SINGLE) -> None:
    """The planned (meta) `model` fits the memory `device` has free; ParallelConfigError with the figures if not."""
    need, free = device_bytes(model), available_bytes(device)
    if free is not None and need > free:
        raise ParallelConfigError(f"{ctx.name()}: its shard of the model needs {need / 1e9:.2f} GB on {device} but "
                                  f"{free / 1e9:.2f} GB are free; spread the model over more ranks (parallel.tp, "
                                  "parallel.ep) or free the device")


def available_bytes(device: torch.device) -> int | None:
    """Free memory of `device`: CUDA's free bytes, the host's MemAvailable for the CPU (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:  # not Linux
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)


def _agreed(ctx: ParallelContext, error: type[Exception], check):
    """`check()` on every rank; when it raises on any rank, every rank raises `error` (its own message, or the
    failing rank's), so no rank goes on to a collective the others never reach."""
    try:
        result, mine = check(), None
    except error as e:
        result, mine = None, e
    verdicts = gather(None if mine is None else str(mine), world_of(ctx))
    if mine is not None:
        raise mine
    failed = [(r, m) for r, m in enumerate(verdicts) if m is not None]
    if failed:
        raise error(f"rank {failed[0][0]}: {failed[0][1]}")
    return result
