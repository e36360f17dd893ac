"""All-or-nothing copies of a pushed adapter into the engine's buffers: every name, shape, dtype kind and value is
checked before any byte moves, so a bad push changes nothing.

`copy_checked` does it from scratch: per-tensor checks in Python, one batched finiteness pass (one host sync),
one multi-tensor copy. A trainer pushes the same tensors (its LoRA Parameters) after every optimizer step, so
`PushCopier` remembers the last validated layout: a push of the same tensor objects (names, order, addresses)
skips the per-tensor Python checks, and on CUDA, from the second push at the same addresses on (new tensor
objects over the same storage, e.g. fresh `detach()` views, are re-checked but keep the graph), the push is one
captured CUDA graph of the checked-copy kernels (`miles_k3.kernels.checked_copy`: a finiteness pass, then a copy
that the device skips when the pass found a NaN/Inf): hundreds of tensors in three launches, one replay and one
host sync (reading the refusal flag) per push. Values are checked on every push.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping

import torch


def copy_checked(buffers: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], what: str,
                 require_all: bool) -> None:
    """Check every name, shape, dtype kind and value of `tensors` against `buffers`, then copy (cast to the
    buffers' dtypes); raises ValueError naming the tensor, nothing copied, on any mismatch."""
    names, src, dst = _validated(buffers, tensors, what, require_all)
    if names:
        _check_finite(names, src, what)
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


def check_tensors(buffers: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], what: str,
                  require_all: bool = False) -> None:
    """The checks of `copy_checked` without the copy (the first phase of a push that several ranks apply
    together or not at all): raises the ValueError `copy_checked` would, nothing copied either way."""
    names, src, _ = _validated(buffers, tensors, what, require_all)
    if names:
        _check_finite(names, src, what)


def _validated(buffers, tensors, what, require_all):
    unknown = sorted(set(tensors) - set(buffers))
    missing = sorted(set(buffers) - set(tensors)) if require_all else []
    if unknown or missing:
        raise ValueError(f"{what}: unknown tensors {unknown[:3]}, missing tensors {missing[:3]}; names must "
                         "be the trainer's lora_parameters() names")
    names = list(tensors)
    src, dst = list(tensors.values()), [buffers[n] for n in names]
    ok = [s.shape == d.shape and s.is_floating_point() for s, d in zip(src, dst)]
    if not all(ok):
        name, t = names[ok.index(False)], src[ok.index(False)]
        raise ValueError(f"{what}: tensor {name} has {t.dtype} {tuple(t.shape)}, expected a floating "
                         f"tensor of shape {tuple(buffers[name].shape)}")
    if names:
        device = dst[0].device
        src = [s if s.device == device else s.to(device) for s in src]
    return names, src, dst


def _non_finite_stat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A [len(tensors)] fp32 vector, non-finite exactly where a tensor may hold a NaN/Inf: on CUDA the max-abs
    (one multi-tensor pass); on CPU the sum (6x faster than max-abs there; NaN/Inf propagate into a sum, but a
    sum of huge finite values may overflow: `_check_finite` confirms)."""
    if tensors[0].is_cuda:
        return torch.stack(torch._foreach_norm(tensors, float("inf"))).float()
    return torch.stack([t.sum(dtype=torch.float32) for t in tensors])


def _check_finite(names: list[str], src: list[torch.Tensor], what: str, stat: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        stat = _non_finite_stat(src) if stat is None else stat
        suspects = (~torch.isfinite(stat)).nonzero().flatten().tolist()
        bad = next((i for i in suspects if not bool(torch.isfinite(src[i]).all())), None)
    if bad is not None:
        raise ValueError(f"{what}: tensor {names[bad]} has NaN/Inf values; refusing the whole push")


class PushCopier:
    """`copy(tensors)` = `copy_checked(buffers, tensors, what, require_all=False)`, faster for repeated pushes of
    the same tensors (see the module docstring)."""

    def __init__(self, buffers: dict[str, torch.Tensor], what: str):
        self.buffers, self.what = buffers, what
        self._names: tuple[str, ...] = ()
        self._src: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._dst: list[torch.Tensor] = []
        self._uses = 0
        self._graph: tuple | None = None  # (captured graph, its CheckedCopy: the refusal flag)

    def copy(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not self._same_layout(tensors):
            names, src, dst = _validated(self.buffers, tensors, self.what, require_all=False)
            moved = any(s is not t for s, t in zip(src, tensors.values()))  # copied to the buffers' device
            ptrs = [] if moved else list(map(_data_ptr, src))
            if not (tuple(names) == self._names and ptrs == self._ptrs and ptrs):
                self._uses, self._graph = 0, None  # new addresses: a captured graph no longer applies
            self._names, self._src, self._dst, self._ptrs = tuple(names), src, dst, ptrs
        if not self._names:
            return
        self._uses += 1
        if self._graph is None and self._uses >= 2 and self._ptrs and _graphable(self._src, self._dst):
            self._graph = self._capture()
        if self._graph is None:
            _check_finite(list(self._names), self._src, self.what)
            with torch.no_grad():
                torch._foreach_copy_(self._dst, self._src)
            return
        graph, checked = self._graph
        graph.replay()
        if checked.refused():  # a non-finite value: nothing was copied; find and name the tensor, then refuse
            _check_finite(list(self._names), self._src, self.what)
            raise ValueError(f"{self.what}: a tensor held NaN/Inf values during the push; refusing the whole push")

    def _same_layout(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """The same names in the same order, the same tensor objects, at the same addresses (so the cached
        checks, and a graph that reads those addresses, still hold)."""
        if not self._ptrs or len(tensors) != len(self._names) or tuple(tensors) != self._names:
            return False
        vals = list(tensors.values())
        return all(map(operator.is_, vals, self._src)) and list(map(_data_ptr, vals)) == self._ptrs

    @torch.no_grad()
    def _capture(self) -> tuple:
        from miles_k3.kernels.checked_copy import CheckedCopy

        checked = CheckedCopy(self._dst, self._src)
        device = self._dst[0].device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            checked.launch()  # warm-up outside capture (compiles); itself a checked copy of the current values
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            checked.launch()
        return graph, checked


_data_ptr = torch._C.TensorBase.data_ptr  # unbound: ~25% cheaper than t.data_ptr() over hundreds of tensors


def _graphable(src: list[torch.Tensor], dst: list[torch.Tensor]) -> bool:
    """The checked-copy kernels take contiguous CUDA tensors of float32/bfloat16/float16 (else: the eager path)."""
    from miles_k3.kernels.checked_copy import FLOAT_DTYPES

    return dst[0].is_cuda and all(t.is_contiguous() and t.dtype in FLOAT_DTYPES for t in (*src, *dst))
