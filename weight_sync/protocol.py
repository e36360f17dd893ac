"""The weight-sync transaction, independent of how bytes travel: manifest, payload packing, checksums, and the
receiver that stages, verifies and applies a push all-or-nothing.

A push of adapter version v is one transaction: `begin(v, manifest)` -> payload bytes (in chunks through a
bounded transfer buffer) -> `commit(v, checksums)`. The payload is the manifest's tensors laid out back to back,
each starting at a multiple of ALIGN bytes (zero padding between them), in the sender's dtypes. The receiver
(`Receiver`, in the engine's process) checks the manifest against the engine's adapter buffers when the push
begins (names, shapes, floating dtypes: the error names the tensor), copies the chunks into a persistent staging
buffer, and at commit checks that every byte arrived, that every tensor's checksum matches and that every value is
finite; only then does it copy the tensors in place into the engine's buffers (cast to their dtype) and set the
engine's `weight_version`. Any failure discards the staging contents: the engine keeps serving the old version.
Versions only move forward.

Checksums (per tensor; the sender names the algorithm in its commit, the receiver recomputes with it):
* `crc32` (payloads packed in host memory): zlib's CRC-32 of the tensor's bytes (padding excluded), computed
  chunk by chunk as the bytes are packed; ~2.4 GB/s on one core, where the torch code below is ~10x slower.
* `block16` (payloads packed on a GPU): a two-sum Fletcher-style code over the payload read as 16-bit words,
  computed on the payload's device (no host copy of the data; one Triton pass on CUDA, torch elsewhere): for each ALIGN-byte block, s1 = sum of
  its words and s2 = sum of word x (position in block + 1); a tensor's checksum combines its blocks' sums with
  the block index (see `tensor_checksums`). All sums are exact in int64 for payloads up to ~4 GiB (beyond,
  the running sums wrap modulo 2^64, identically on both sides). It detects any corrupted 16-bit word, and reordered words or blocks.
Both are integrity checks against transport faults, not cryptographic ones.

Legend: B payload bytes, W 16-bit words, N blocks.
"""
from __future__ import annotations

import functools
import math
import operator
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

ALIGN = 512  # bytes: every tensor starts at a multiple of this in the payload; the checksum block size
_WORDS = ALIGN // 2
_MOD = 65521  # largest prime below 2^16: the block-index weight, kept small so sums stay exact in int64
_CHECKSUM_SLICE = 64 * 2**20  # bytes per block-sum pass (bounds the int64 temporaries to 4x this)
CHECKSUM_ALGOS = ("crc32", "block16")


class SyncError(RuntimeError):
    """A push was refused; nothing was applied and the engine still serves its previous version. `tensor` names
    the offending tensor when there is one; `metrics` holds what the push measured before it was refused (an SGLang
    parity check's figures, `sync/parity_*`), which the training loop logs with the step."""

    def __init__(self, message: str, tensor: str | None = None, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.metrics = dict(metrics or {})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a push: its name, shape, dtype name (e.g. "float32") and byte range in the payload."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def blocks(self) -> range:
        """The checksum blocks this tensor occupies (its padding included)."""
        return range(self.offset // ALIGN, (self.offset + self.nbytes + ALIGN - 1) // ALIGN)


@dataclass(frozen=True)
class Manifest:
    """The layout of a push's payload: tensors in order, each at an ALIGN-aligned offset."""

    specs: tuple[TensorSpec, ...]
    total_bytes: int  # a multiple of ALIGN

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        """The manifest for `tensors` (name -> tensor), grouped by dtype (one contiguous run per dtype, so
        finiteness is one check per dtype) and otherwise in the mapping's order. A trainer pushes one layout
        over and over: the last manifest is reused when the names, shapes and dtypes are the same."""
        if not tensors:
            raise SyncError("empty push: no tensors given (a push must carry the whole adapter)")
        vals = list(tensors.values())
        try:
            key = (tuple(tensors), tuple(t.shape for t in vals), tuple(t.dtype for t in vals))
        except AttributeError:  # not a tensor
            name, t = next((n, t) for n, t in tensors.items() if not isinstance(t, torch.Tensor))
            raise SyncError(f"tensor {name}: expected a torch.Tensor, got {type(t).__name__}", name) from None
        if _LAST_MANIFEST and _LAST_MANIFEST[0] == key:
            return _LAST_MANIFEST[1]
        order = sorted(tensors, key=lambda n: str(tensors[n].dtype))  # stable: mapping order within a dtype
        specs, offset = [], 0
        for name in order:
            t = tensors[name]
            if not isinstance(t, torch.Tensor):  # e.g. a numpy array (it has a shape and a dtype)
                raise SyncError(f"tensor {name}: expected a torch.Tensor, got {type(t).__name__}", name)
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset, nbytes))
            offset += _round_up(nbytes)
        manifest = cls(tuple(specs), offset)
        _LAST_MANIFEST[:] = [key, manifest]
        return manifest

    def to_wire(self) -> list[tuple]:
        """Plain tuples (picklable by any transport without importing this module); computed once per manifest."""
        return self._wire

    @functools.cached_property
    def _wire(self) -> list[tuple]:
        return [(s.name, list(s.shape), s.dtype, s.offset, s.nbytes) for s in self.specs]

    @classmethod
    def from_wire(cls, rows: list) -> Manifest:
        """The manifest `rows` (from `to_wire`) describe; the last one is reused for an equal `rows` (a receiver
        gets the same layout on every push)."""
        if _LAST_WIRE and _LAST_WIRE[0] == rows:
            return _LAST_WIRE[1]
        specs = tuple(TensorSpec(str(n), tuple(int(d) for d in shape), str(dt), int(o), int(b))
                      for n, shape, dt, o, b in rows)
        total = max((_round_up(s.offset + s.nbytes) for s in specs), default=0)
        manifest = cls(specs, total)
        _LAST_WIRE[:] = [list(rows), manifest]
        return manifest


_LAST_MANIFEST: list = []  # [(names, shapes, dtypes), Manifest] of the last Manifest.of
_LAST_WIRE: list = []  # [rows, Manifest] of the last Manifest.from_wire


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy); non-contiguous tensors are copied first."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def pack_range(manifest: Manifest, tensors: Mapping[str, torch.Tensor], dst_u8: torch.Tensor, start: int) -> None:
    """Write payload bytes [start, start + len(dst_u8)) into dst_u8: the tensors' bytes at their offsets, zeros
    in the padding. `start` and len(dst_u8) are multiples of ALIGN (except a final partial chunk's length).
    One multi-tensor copy; the byte views are cached for a repeated pack of the same tensors (same objects at the
    same addresses) into the same buffer range, whose padding is then still zero and is not written again."""
    key = (dst_u8.data_ptr(), dst_u8.numel(), dst_u8.device, start)
    vals = [tensors[sp.name] for sp in manifest.specs]
    plan = _PACK_PLANS.get(key)
    if plan is None or not plan.holds(vals):
        plan = _PackPlan(manifest, vals, dst_u8, start)
        _PACK_PLANS.clear()  # one buffer layout at a time: another pack may have overwritten this one's padding
        _PACK_PLANS[key] = plan
        dst_u8.zero_()
    if plan.dst:
        torch._foreach_copy_(plan.dst, plan.src)


class _PackPlan:
    """The byte views one pack_range copies: src slices of the tensors, dst slices of the buffer."""

    def __init__(self, manifest: Manifest, vals: list[torch.Tensor], dst_u8: torch.Tensor, start: int):
        end = start + dst_u8.numel()
        self.vals, self.ptrs, self.src, self.dst = vals, [t.data_ptr() for t in vals], [], []
        for sp, t in zip(manifest.specs, vals):
            lo, hi = max(sp.offset, start), min(sp.offset + sp.nbytes, end)
            if lo < hi:
                self.src.append(byte_view(t)[lo - sp.offset:hi - sp.offset])
                self.dst.append(dst_u8[lo - start:hi - start])

    def holds(self, vals: list[torch.Tensor]) -> bool:
        return (len(vals) == len(self.vals) and all(map(operator.is_, vals, self.vals))
                and [t.data_ptr() for t in vals] == self.ptrs and all(t.is_contiguous() for t in vals))


_PACK_PLANS: dict[tuple, _PackPlan] = {}


def clear_pack_cache() -> None:
    """Drop the cached pack views (they hold the last buffer and tensors alive): a sender's close() calls it
    before it releases its transfer buffer."""
    _PACK_PLANS.clear()


# ---- checksums ---------------------------------------------------------------------------------------------
def block_sums(payload_u8: torch.Tensor) -> torch.Tensor:
    """payload_u8 [B] (B a multiple of ALIGN) -> sums_N2 [N, 2] int64: per ALIGN-byte block, (s1, s2) over its
    16-bit words w_j (j = 0.._WORDS-1, unsigned): s1 = sum w_j, s2 = sum w_j * (j + 1). On CUDA one Triton pass
    (`miles_k3.kernels.block_sums`, bit-identical); elsewhere `block_sums_reference`."""
    if payload_u8.numel() % ALIGN:
        raise ValueError(f"block_sums: {payload_u8.numel()} bytes is not a multiple of {ALIGN}")
    if payload_u8.is_cuda and payload_u8.is_contiguous():
        from miles_k3.kernels.block_sums import block_sums_triton

        return block_sums_triton(payload_u8, ALIGN)
    return block_sums_reference(payload_u8)


def block_sums_reference(payload_u8: torch.Tensor) -> torch.Tensor:
    """`block_sums` in torch (any device), slice by slice to bound the int64 temporaries."""
    if payload_u8.numel() % ALIGN:
        raise ValueError(f"block_sums: {payload_u8.numel()} bytes is not a multiple of {ALIGN}")
    n = payload_u8.numel() // ALIGN
    out = torch.empty(n, 2, dtype=torch.int64, device=payload_u8.device)
    pos = torch.arange(1, _WORDS + 1, dtype=torch.int64, device=payload_u8.device)
    step = _CHECKSUM_SLICE // ALIGN
    for b0 in range(0, n, step):
        b1 = min(n, b0 + step)
        w = payload_u8[b0 * ALIGN:b1 * ALIGN].view(torch.int16).view(b1 - b0, _WORDS).to(torch.int64) & 0xFFFF
        out[b0:b1, 0] = w.sum(1)
        out[b0:b1, 1] = (w * pos).sum(1)
    return out


def tensor_checksums(manifest: Manifest, sums_N2: torch.Tensor) -> list[int]:
    """Per tensor of the manifest, from the payload's block sums: S1 | (S2 << 64) where S1 = sum of its blocks'
    s1 (< 2^63) and S2 = sum over its blocks i (counted from the tensor's first) of s2_i + ((i + 1) mod 65521) * s1_i."""
    idx = _checksum_index(manifest, sums_N2.shape[0], sums_N2.device)
    weighted = sums_N2[:, 1] + idx.rel * sums_N2[:, 0]
    zero = torch.zeros(1, dtype=torch.int64, device=sums_N2.device)
    # two 1-D scans: a scan along dim 0 of an [N, 2] tensor runs one thread per column on CUDA (~45 ms at N=466k)
    cum = torch.stack([torch.cat([zero, torch.cumsum(col.contiguous(), 0)]) for col in (sums_N2[:, 0], weighted)], 1)
    return [s1 | (s2 << 64) for s1, s2 in (cum[idx.stops] - cum[idx.starts]).tolist()]  # [tensors, 2] to host


@dataclass(frozen=True)
class _ChecksumIndex:
    rel: torch.Tensor  # [N] int64: (block index within its tensor + 1) mod 65521
    starts: torch.Tensor  # [tensors] first block of each tensor
    stops: torch.Tensor  # [tensors] one past its last block


@functools.lru_cache(maxsize=8)
def _checksum_index(manifest: Manifest, n: int, device: torch.device) -> _ChecksumIndex:
    """Per manifest, built once on the host and moved to `device` (repeated pushes reuse it)."""
    starts = torch.tensor([s.blocks.start for s in manifest.specs], dtype=torch.int64)
    stops = torch.tensor([s.blocks.stop for s in manifest.specs], dtype=torch.int64)
    first = torch.zeros(n, dtype=torch.int64)
    if len(starts):
        first.scatter_(0, starts, starts)
        first = torch.cummax(first, 0).values  # each block's tensor start block (blocks are in tensor order)
    rel = (torch.arange(n) - first + 1) % _MOD
    return _ChecksumIndex(rel.to(device), starts.to(device), stops.to(device))


def payload_checksums(manifest: Manifest, payload_u8: torch.Tensor, algo: str) -> list[int]:
    """Per-tensor checksums (`algo`, one of CHECKSUM_ALGOS) of a whole payload held in one buffer."""
    if algo == "block16":
        return tensor_checksums(manifest, block_sums(payload_u8[:manifest.total_bytes]))
    if algo == "crc32":
        host = payload_u8[:manifest.total_bytes].cpu()
        return [_crc32(host[s.offset:s.offset + s.nbytes]) for s in manifest.specs]
    raise ValueError(f"checksum algorithm {algo!r} is not one of {', '.join(CHECKSUM_ALGOS)}")


def _crc32(host_u8: torch.Tensor, value: int = 0) -> int:
    return zlib.crc32(memoryview(host_u8.numpy()), value) if host_u8.numel() else value


class PayloadWriter:
    """Sender side: packs a push's tensors chunk by chunk into a bounded transfer buffer and computes the
    per-tensor checksums of exactly the bytes it packed: `crc32` for a host buffer, `block16` (on the device)
    for a GPU buffer, unless `algo` forces one; `checksum=False` computes none."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], checksum: bool = True, algo: str | None = None):
        self.tensors = dict(tensors)
        self.manifest = Manifest.of(self.tensors)
        if algo is not None and algo not in CHECKSUM_ALGOS:
            raise ValueError(f"checksum algorithm {algo!r} is not one of {', '.join(CHECKSUM_ALGOS)}")
        self.checksum, self.algo = checksum, algo
        self._sums: list[torch.Tensor] = []
        self._crcs = [0] * len(self.manifest.specs)

    def chunks(self, buffer_u8: torch.Tensor) -> Iterator[tuple[int, int]]:
        """For each chunk: packs payload bytes [offset, offset + nbytes) into buffer_u8[:nbytes] and yields
        (offset, nbytes); the buffer may be reused once the consumer has taken the chunk. len(buffer_u8) must
        be a multiple of ALIGN."""
        size = buffer_u8.numel()
        if size < ALIGN or size % ALIGN:
            raise ValueError(f"transfer buffer: {size} bytes is not a positive multiple of {ALIGN}")
        if self.algo is None:
            self.algo = "block16" if buffer_u8.is_cuda else "crc32"
        for start in range(0, self.manifest.total_bytes, size):
            n = min(size, self.manifest.total_bytes - start)
            pack_range(self.manifest, self.tensors, buffer_u8[:n], start)
            if self.checksum:
                self._add_checksums(buffer_u8[:n], start)
            yield start, n

    def _add_checksums(self, chunk_u8: torch.Tensor, start: int) -> None:
        if self.algo == "block16":
            self._sums.append(block_sums(chunk_u8))
            return
        host = chunk_u8.cpu()
        end = start + chunk_u8.numel()
        for i, s in enumerate(self.manifest.specs):
            lo, hi = max(s.offset, start), min(s.offset + s.nbytes, end)
            if lo < hi:
                self._crcs[i] = _crc32(host[lo - start:hi - start], self._crcs[i])

    def checksums(self) -> tuple[str, list[int]] | None:
        """(algorithm, per-tensor checksums) of everything `chunks` packed (None when checksums are off)."""
        if not self.checksum:
            return None
        if self.algo == "block16":
            sums = self._sums[0] if len(self._sums) == 1 else torch.cat(self._sums)  # on the device: the host
            return "block16", tensor_checksums(self.manifest, sums)  # would take ~70 ms per 240 MB push here
        return "crc32", list(self._crcs)


def readback_matches(buffers: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> bool:
    """Debug readback: every byte of the engine's `buffers` equals `tensors` cast to the buffers' dtypes."""
    return all(torch.equal(buffers[n], t.to(buffers[n].dtype)) for n, t in tensors.items())


def sync_devices(devices) -> None:
    """Wait for the current stream of every CUDA device in `devices` (CPU devices need no wait)."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.current_stream(d).synchronize()


# ---- reports -----------------------------------------------------------------------------------------------
@dataclass
class PushReport:
    """What one push did (logged under `sync/`)."""

    version: int
    transport: str
    bytes: int
    seconds: float
    num_tensors: int
    num_chunks: int
    checksum_match: bool | None  # None: nothing crossed a wire (local), so there was nothing to checksum
    readback_match: bool | None = None  # the debug readback: every engine byte equals the trainer's

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf

    def metrics(self) -> dict[str, float]:
        m = {"sync/version": self.version, "sync/bytes": self.bytes, "sync/seconds": self.seconds,
             "sync/gbps": self.gbps, "sync/num_tensors": self.num_tensors, "sync/num_chunks": self.num_chunks}
        if self.checksum_match is not None:
            m["sync/checksum_match"] = float(self.checksum_match)
        if self.readback_match is not None:
            m["sync/readback_match"] = float(self.readback_match)
        return m
