"""Checked multi-tensor copy: copy hundreds of tensors (casting to each destination's dtype) only if every source
value is finite, in two Triton launches per (source dtype, destination dtype) pair and no host synchronisation.

It is the engine-side copy of a weight push (`miles_k3.rollout.push_copy.PushCopier`): all-or-nothing needs every
value checked before any byte moves, and a host round trip between the check and the copy (read a flag, then
launch the copy) costs more than the copy itself for a LoRA adapter. Here the copy is conditional on the device:

    flag   = 0                                              (a memset)
    check:   one program per tile of BLOCK elements: if any |x| is not < inf (NaN, +-Inf) -> flag = 1 (atomic)
    copy:    one program per tile: if flag == 0, dst[tile] = cast(src[tile])

Both kernels read their tiles from a table built once per layout (`CheckedCopy(dst, src)`): per tile the element
offset of its source and destination relative to the group's first tensors (every CUDA address of one dtype is a
multiple of its element size, so these offsets are exact) and its element count. A stream orders the copy after
the check, so the copy sees the final flag; `flag` tells the caller afterwards (one read, one synchronisation)
whether the copy was refused. `launch()` is capturable in a CUDA graph: a push is then one graph replay.

Casts are torch's: values go through fp32 and round to nearest even in the destination dtype (bf16 with integer
ops, `fused._round`, so the interpreter, whose own fp32 -> bf16 cast truncates, agrees), so the copy is
bit-identical to `torch._foreach_copy_` (tested on CPU under the interpreter and on the H200). Reference: `checked_copy_reference` (pure torch, any device).
Launching the kernels needs CUDA (or `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_k3.kernels.fused import _ROUND_KIND, _on_device, _round

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 4096  # elements per tile (one program)
_NUM_WARPS = 4


def checked_copy_reference(dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    """Copy src[i] into dst[i] (cast to dst's dtype) if every value of every src is finite; True when copied,
    False (nothing copied) otherwise."""
    with torch.no_grad():
        if not all(bool(torch.isfinite(s).all()) for s in src):
            return False
        torch._foreach_copy_(dst, src)
    return True


@triton.jit
def _check_kernel(src, src_off_ptr, count_ptr, flag_ptr, BLOCK: tl.constexpr, HINT: tl.constexpr):
    tile = tl.program_id(0)
    off = tl.multiple_of(tl.load(src_off_ptr + tile), HINT)
    n = tl.load(count_ptr + tile)
    i = tl.arange(0, BLOCK)
    x = tl.load(src + off + i, mask=i < n, other=0.0).to(tl.float32)
    bad = tl.max((~(tl.abs(x) < float("inf"))).to(tl.int32), axis=0)
    if bad != 0:
        tl.atomic_max(flag_ptr, 1)


@triton.jit
def _copy_kernel(src, dst, src_off_ptr, dst_off_ptr, count_ptr, flag_ptr, BLOCK: tl.constexpr,
                 HINT: tl.constexpr, ROUND: tl.constexpr):
    if tl.load(flag_ptr) != 0:
        return
    tile = tl.program_id(0)
    s = tl.multiple_of(tl.load(src_off_ptr + tile), HINT)
    d = tl.multiple_of(tl.load(dst_off_ptr + tile), HINT)
    n = tl.load(count_ptr + tile)
    i = tl.arange(0, BLOCK)
    x = _round(tl.load(src + s + i, mask=i < n).to(tl.float32), ROUND)  # exact in fp32; rounded like torch
    tl.store(dst + d + i, x.to(dst.dtype.element_ty), mask=i < n)


class _Group:
    """The tiles of the (src dtype, dst dtype) pairs of one group, as device tables."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], block: int, device: torch.device):
        self.src0, self.dst0 = pairs[0][1], pairs[0][0]
        s_es, d_es = self.src0.element_size(), self.dst0.element_size()
        src_off, dst_off, counts = [], [], []
        for d, s in pairs:
            ds, dd = s.data_ptr() - self.src0.data_ptr(), d.data_ptr() - self.dst0.data_ptr()
            if ds % s_es or dd % d_es:  # cannot happen for allocator addresses; refuse rather than misaddress
                raise ValueError("checked_copy: a tensor's address is not a multiple of its element size")
            for start in range(0, s.numel(), block):
                src_off.append(ds // s_es + start)
                dst_off.append(dd // d_es + start)
                counts.append(min(block, s.numel() - start))
        # 16-element-aligned tile starts (every allocation is 512-byte aligned) let Triton vectorise the accesses
        self.hint = 16 if all(o % 16 == 0 for o in src_off + dst_off) else 1
        self.src_off = torch.tensor(src_off, dtype=torch.int64).to(device)
        self.dst_off = torch.tensor(dst_off, dtype=torch.int64).to(device)
        self.counts = torch.tensor(counts, dtype=torch.int32).to(device)
        self.tiles = len(counts)


class CheckedCopy:
    """The tile tables of one layout of (dst, src) pairs; `launch()` enqueues the checked copy, `flag` is 1 after
    it when some source value was not finite (then nothing was copied). The tensors are held (their addresses are
    in the tables): a new layout needs a new CheckedCopy."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor], block: int = BLOCK):
        if len(dst) != len(src) or not dst:
            raise ValueError(f"checked_copy: {len(dst)} destinations for {len(src)} sources (need equal, > 0)")
        device = dst[0].device
        groups: dict[tuple, list] = {}
        for i, (d, s) in enumerate(zip(dst, src)):
            if d.device != device or s.device != device:
                raise ValueError(f"checked_copy: pair {i} is on {s.device} -> {d.device}, expected {device}")
            if s.dtype not in FLOAT_DTYPES or d.dtype not in FLOAT_DTYPES:
                raise ValueError(f"checked_copy: pair {i} has {s.dtype} -> {d.dtype}; only {FLOAT_DTYPES}")
            if s.shape != d.shape or not (s.is_contiguous() and d.is_contiguous()):
                raise ValueError(f"checked_copy: pair {i} needs contiguous tensors of one shape, got "
                                 f"{tuple(s.shape)} -> {tuple(d.shape)}")
            if s.numel():
                groups.setdefault((s.dtype, d.dtype), []).append((d, s))
        self.dst, self.src = list(dst), list(src)
        self.groups = [_Group(pairs, block, device) for pairs in groups.values()]
        self.block = block
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)

    def launch(self) -> None:
        """Enqueue: flag = 0, the checks, the conditional copies (no host synchronisation)."""
        self.flag.zero_()
        with _on_device(self.flag):
            self._launch()

    def _launch(self) -> None:
        for g in self.groups:
            _check_kernel[(g.tiles,)](g.src0, g.src_off, g.counts, self.flag, BLOCK=self.block, HINT=g.hint,
                                      num_warps=_NUM_WARPS)
        for g in self.groups:
            _copy_kernel[(g.tiles,)](g.src0, g.dst0, g.src_off, g.dst_off, g.counts, self.flag, BLOCK=self.block,
                                     HINT=g.hint, ROUND=_ROUND_KIND[g.dst0.dtype], num_warps=_NUM_WARPS)

    def refused(self) -> bool:
        """After `launch()`: True when a non-finite value stopped the copy (reads the flag: synchronises)."""
        return bool(self.flag.item())
