"""Filling a planned model with its weights: every rank reads only the slices it holds.

A model is built on the meta device and cut to this rank's shard (`parallelize.parallelize`) before any weight
exists; `materialize` then allocates the shard shapes on the rank's device, once, and `load_weights` fills them
from a `WeightSource`: a checkpoint directory (`CheckpointReader`: safetensors' slice API reads each tensor's rank
slice straight from the files that hold it, one file open at a time; TP tensors only their rows or columns, routed
experts only this rank's ids, replicated tensors whole) or the random init a seed defines (`RandomInit`: the
checkpoint `python -m miles_k3.init_checkpoint` writes for that seed, drawn slice by slice). The reads are planned
first (`plan_reads`: stored names, slices and byte counts from the model's own plan, no payload read), so
`model_info` sizes a rank's load from the same list the loader executes.

Memory: no full tensor of a sharded parameter is ever held. A read is staged on the host in chunks of rows of at
most STAGING_BYTES (64 MiB) of stored data (an MXFP4 expert conversion: one expert at a time, 17.5 MB for K3), then
copied into its slice of the device tensor. Conversions of the expert format work per expert: stored MXFP4 read
into bf16 experts is dequantized, stored bf16 read into MXFP4 experts is quantized (floor rule).

Random init: a stored tensor's values are drawn in blocks of rows (block b of tensor `name` from a generator seeded
by (seed, name, b)), so a rank draws only the blocks that hold its rows and every mesh gets the weights of one
process; routed experts are stored tensors of their own (one expert each). Values are rounded to the stored dtype,
so a random base is bit for bit the checkpoint init_checkpoint writes for the seed. Adapters (`init_adapters`): A
is kaiming-uniform per tensor (expert LoRA: per expert) from (seed, name[, expert]), B zero, then sliced.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from torch import nn

from miles_k3.model.checkpoint import (
    CHECKPOINT_PREFIX,
    STORED_BYTES,
    CheckpointError,
    CheckpointIndex,
    TensorSpec,
    expected_tensors,
    meta_model,
    open_checkpoint,
    open_safetensors,
    skip_meta_init,
    spec_bytes,
)
from miles_k3.model.config import K3Config
from miles_k3.model.experts import EXPERT_FORMATS, PROJS, RoutedExperts
from miles_k3.model.k3 import K3ForCausalLM, fill_init_, init_rule
from miles_k3.model.lora import ExpertLoRA, LoRAConfig, LoRALinear, apply_lora, lora_parameters
from miles_k3.model.parallelize import ShardPlan, Slice, parallelize
from miles_k3.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from miles_k3.parallel.config import ParallelConfigError
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import gather, world_of

log = logging.getLogger(__name__)

STAGING_BYTES = 64 * 2**20
"""Stored bytes staged on the host per copy into the device (a chunk of rows of one read)."""
INIT_BLOCK_ELEMS = 1 << 22
"""Random init draws a stored tensor in blocks of rows of at most this many elements (one row when a row is
larger), each block from its own seeded generator."""
INIT_STD = 0.02


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
    """What one rank read: stored bytes, from which files, of a checkpoint of `total_bytes` text bytes."""

    bytes_read: int = 0
    files: set = field(default_factory=set)
    total_bytes: int = 0

    def line(self, rank: int) -> str:
        return (f"rank {rank} read {self.bytes_read:,} of {self.total_bytes:,} checkpoint bytes from "
                f"{len(self.files)} files")


class WeightSource(Protocol):
    """Stored tensors by checkpoint name: a checkpoint directory or a seeded random init."""

    config: K3Config
    expert_format: str
    total_bytes: int

    def spec(self, name: str) -> TensorSpec: ...
    def file(self, name: str) -> Path | None: ...
    def check(self, names: list[str]) -> None: ...
    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        """Stored tensor `name` at `index` (safetensors slice indexing), in its stored dtype, on the CPU or on
        `device` (a hint: where the values go)."""
    def close(self) -> None: ...


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
    by file. Raises CheckpointError naming tensor and file."""
    reads = sorted(plan_reads(model, plan, source.expert_format),
                   key=lambda r: (str(source.file(r.names[0]) or ""), r.names[0]))
    source.check([n for r in reads for n in r.names])
    _check_slices(reads, source)
    return reads


def load_weights(model: K3ForCausalLM, reads: list[Read], source: WeightSource) -> LoadStats:
    """Fill the materialised `model` by executing `reads` (`check_reads`) against `source`, slice by slice, with
    host staging bounded by STAGING_BYTES. Returns what was read."""
    views = model.state_dict(keep_vars=True)
    stats = LoadStats(total_bytes=source.total_bytes)
    try:
        for read in reads:
            _execute(read, views, source)
            stats.bytes_read += read_bytes(read, {n: source.spec(n) for n in read.names})
            stats.files.update(f for f in map(source.file, read.names) if f is not None)
    finally:
        source.close()
    return stats


def _check_slices(reads: list[Read], source: WeightSource) -> None:
    """A planned slice lies inside its stored tensor (a config whose shapes do not match the checkpoint's)."""
    for read in reads:
        s = read.slice
        if s is None:
            continue
        shape = source.spec(read.names[0]).shape
        if s.dim >= len(shape) or s.start + s.length > shape[s.dim]:
            raise CheckpointError(f"tensor '{read.names[0]}' in {source.file(read.names[0])}: this rank reads "
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
    spec = source.spec(name)
    s = read.slice
    rows = spec.shape[0] if s is None or s.dim != 0 else s.length
    first = s.start if s is not None and s.dim == 0 else 0
    row_bytes = max(1, spec_bytes(spec) // max(1, spec.shape[0]))
    if s is not None and s.dim != 0:
        row_bytes = row_bytes // spec.shape[s.dim] * s.length
    step = max(1, STAGING_BYTES // row_bytes)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        index = [slice(first + r0, first + r1)] + [slice(None)] * (len(spec.shape) - 1)
        if s is not None and s.dim != 0:
            index[s.dim] = slice(s.start, s.start + s.length)
        target.narrow(0, r0, r1 - r0).copy_(source.read(name, tuple(index), target.device))


# ---- sources --------------------------------------------------------------------------------------------------
class CheckpointReader:
    """A checkpoint directory as a WeightSource: specs from its index and the headers of the files a rank reads
    (`check` opens only those), slices through safetensors' `get_slice`, one file open at a time (reads arrive
    sorted by file)."""

    def __init__(self, index: CheckpointIndex):
        self.index, self.config, self.expert_format = index, index.config, index.expert_format
        self.total_bytes = index.total_bytes
        self._headers: dict[str, tuple[Path, TensorSpec]] = {}
        self._open: tuple[Path, object, object] | None = None  # (file, context manager, handle)

    def spec(self, name: str) -> TensorSpec:
        return self._headers[name][1] if name in self._headers else self.index.expected[name]

    def file(self, name: str) -> Path | None:
        return self.index.locations.get(name)

    def check(self, names: list[str]) -> None:
        """Every name listed by the index, and its header's spec the config's (only the files holding `names`
        are opened)."""
        missing = [n for n in names if n not in self.index.locations]
        if missing:
            raise CheckpointError(f"{self.index.path}: no file in the checkpoint holds tensor '{missing[0]}' "
                                  f"({len(missing)} missing); re-download or re-write the checkpoint")
        self._headers = self.index.headers(names)

    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        file = self.index.locations[name]
        if self._open is None or self._open[0] != file:
            self.close()
            cm = open_safetensors(file, [name])
            self._open = (file, cm, cm.__enter__())
        try:
            return self._open[2].get_slice(name)[index]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"tensor '{name}' in {file}: cannot be read ({e}); re-download or re-write the "
                                  "file") from None

    def close(self) -> None:
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None


class RandomInit:
    """The random init of (config, expert format, seed) as a WeightSource: the stored tensors
    `python -m miles_k3.init_checkpoint` writes for the seed, drawn on demand, only the rows a read asks for
    (block b of tensor `name`: a generator seeded by (seed, name, b); MXFP4 experts: their bf16 draw quantized by
    the floor rule). Values are in the stored dtype. They are drawn on the device they go to (CUDA's generator
    differs from the CPU's): every mesh of one device type gets the same weights, and on the CPU they are
    init_checkpoint's."""

    def __init__(self, config: K3Config, expert_format: str, seed: int = 0, std: float = INIT_STD):
        self.config, self.expert_format, self.seed, self.std = config, expert_format, seed, std
        self._specs: dict[str, TensorSpec] | None = None
        self._quantized: tuple | None = None  # (base name, rows, device, packed, scale) of the last MXFP4 draw

    @property
    def specs(self) -> dict[str, TensorSpec]:
        """Stored name -> spec of every tensor (computed on first use: a meta model's state dict)."""
        if self._specs is None:
            self._specs = expected_tensors(self.config, self.expert_format)
        return self._specs

    @property
    def total_bytes(self) -> int:
        return sum(map(spec_bytes, self.specs.values()))

    def spec(self, name: str) -> TensorSpec:
        return self.specs[name]

    def file(self, name: str) -> Path | None:
        return None

    def check(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.specs]
        assert not unknown, unknown[:3]  # the plan comes from the same config: an internal invariant

    def close(self) -> None:
        self._quantized = None

    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        spec = self.specs[name]
        device = torch.device("cpu") if device is None or device.type == "meta" else torch.device(device)
        r0, r1, _ = index[0].indices(spec.shape[0])
        if name.endswith(("weight_packed", "weight_scale")):
            base, _, kind = name.rpartition(".")
            packed, scale = self._mxfp4_rows(base, spec, r0, r1, device)
            t = packed if kind == "weight_packed" else scale
        else:
            t = self.rows(name, spec.shape, r0, r1, device).to(_TORCH_DTYPES[spec.dtype])
        return t[(slice(None), *index[1:])]

    def _mxfp4_rows(self, base: str, spec: TensorSpec, r0: int, r1: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows r0..r1 of an MXFP4 expert projection: its bf16 draw (`base + ".weight"`) quantized."""
        if self._quantized is None or self._quantized[:3] != (base, (r0, r1), device):
            in_features = self.specs[f"{base}.weight_packed"].shape[1] * 2
            w = self.rows(f"{base}.weight", (spec.shape[0], in_features), r0, r1, device).to(torch.bfloat16)
            self._quantized = (base, (r0, r1), device, *quantize_mxfp4(w, "floor"))
        return self._quantized[3], self._quantized[4]

    def rows(self, name: str, shape: tuple[int, ...], r0: int, r1: int, device: torch.device | None = None
             ) -> torch.Tensor:
        """Rows r0..r1 of tensor `name` of `shape` (fp32, on `device`), drawn block by block. A_log's padding rows
        (beyond num_heads, the published [128] for 96 heads) are zero."""
        device = torch.device("cpu") if device is None else device
        row = 1
        for d in shape[1:]:
            row *= d
        per_block = max(1, INIT_BLOCK_ELEMS // row)
        rule = init_rule(name, len(shape))
        heads = self.config.linear_attn_config.num_heads if rule == "a_log" else shape[0]
        parts = []
        for b in range(r0 // per_block, -(-r1 // per_block)):
            lo, hi = b * per_block, min(shape[0], (b + 1) * per_block)
            new = torch.empty if hi <= heads else torch.zeros  # rows past `heads` (A_log's padding) stay zero
            block = new((hi - lo, *shape[1:]), device=device)
            if lo < heads:
                fill_init_(block[: heads - lo], rule, self.std, _generator(self.seed, name, b, device))
            parts.append(block[max(r0, lo) - lo: min(r1, hi) - lo])
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros((0, *shape[1:]), device=device)


_TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
assert set(_TORCH_DTYPES) == set(STORED_BYTES)


def _generator(seed: int, name: str, block: int, device: torch.device | None = None) -> torch.Generator:
    """A generator on `device` (default CPU) for block `block` of tensor `name` under `seed` (the same on every
    rank and machine of that device type)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return torch.Generator(device=device or "cpu").manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


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
                gen = _generator(seed, f"{path}.lora_A", e)
                m.lora_A[i].copy_(torch.empty(m.lora_A.shape[1:]).uniform_(-bound, bound, generator=gen))
            m.lora_B.zero_()


def _init_linear_a(a: torch.Tensor, key: str, plan: ShardPlan, seed: int) -> None:
    part = plan.slice_of(key)
    shape = list(a.shape)
    if part is not None:
        shape[part.dim] = part.full
    bound = 1.0 / shape[1] ** 0.5
    whole = torch.empty(shape).uniform_(-bound, bound, generator=_generator(seed, key, 0))
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
        model = meta_model(source.config, expert_format, kda_backend)
        if lora is not None:
            apply_lora(model, lora)
    model.requires_grad_(False)
    for p in lora_parameters(model).values():
        p.requires_grad_(True)
    plan = parallelize(model, ctx)
    model.cast(dtype)
    if device.type == "meta":
        return model
    reads = _agreed(ctx, CheckpointError, lambda: check_reads(model, plan, source))
    _agreed(ctx, ParallelConfigError, lambda: check_fits(model, device, ctx))
    materialize(model, device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    stats = load_weights(model, reads, source)
    if lora is not None:
        init_adapters(model, plan, seed)
    model.kda_backend(device)
    if isinstance(source, CheckpointReader):
        lines = gather(stats.line(ctx.rank), world_of(ctx))
        for line in lines if ctx.is_main else ():
            log.info("%s", line)
    return model


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                    expert_format: str = "auto", kda_backend: str = "auto") -> K3ForCausalLM:
    """The whole K3 of a checkpoint directory (one process), frozen, on `device` in `dtype` (fp32 families kept).
    `expert_format`: "auto" keeps the stored format; "bf16" on an MXFP4 checkpoint dequantizes while loading
    (references, benchmarks); "mxfp4" on a bf16 checkpoint quantizes while loading (floor rule)."""
    if expert_format not in ("auto", *EXPERT_FORMATS):
        raise CheckpointError(f"expert_format: '{expert_format}' is not one of auto, {', '.join(EXPERT_FORMATS)}")
    if not dtype.is_floating_point:
        raise CheckpointError(f"dtype: {dtype} is not a floating-point dtype; use torch.bfloat16 or torch.float32")
    index = open_checkpoint(path)
    fmt = index.expert_format if expert_format == "auto" else expert_format
    model = build_k3(CheckpointReader(index), fmt, torch.device(device), dtype, kda_backend=kda_backend)
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
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
