"""K3's routed experts (`block_sparse_moe.experts`): E SiTU-GLU experts in the latent width, stored as bf16
parameters or, as in the published checkpoint, as frozen native MXFP4 (compressed-tensors
`mxfp4-pack-quantized`: `weight_packed` uint8 [out, in/2] + `weight_scale` uint8 E8M0 [out, in/32]).

Tokens arrive grouped by expert (rows of expert 0, then expert 1, ...; `counts[e]` rows each). Every
projection is a grouped matmul `y[rows of e] = x[rows of e] @ W_e^T`. In MXFP4 format the weights are
multiplied by `MXFP4GroupedLinear`, an autograd function that saves only references to the uint8 storage and
reads it again in backward (input gradient only): no bf16 copy of an expert weight is ever kept, neither as
storage nor for backward. Its backend is one switch, `kernels.mxfp4_experts` (auto | torch | triton: set once
at startup by `miles_k3.model.kernel_config.apply_kernels`, which logs what it resolves to and why): "triton" on
CUDA with bf16 activations, a W4A16 grouped matmul that decodes the MXFP4 codes in registers and reads only the
experts that have rows (`miles_k3.kernels.mxfp4_moe`, also inside captured decode steps), for projections of at
least FUSED_MIN_WEIGHTS weights, or of any size for at most FUSED_MAX_ROWS rows (a small decode step), unless
forced (real-width K3; k3_m's small experts keep the torch path above 64 rows); "torch"
everywhere else (the CPU path and the reference): dequantize a chunk of experts to bf16, then a grouped matmul.
Tests and benchmarks force one within a block: `with mxfp4_experts_backend("torch"):`. Optional per-expert LoRA
deltas (`self.lora`, see `miles_k3.model.lora`) are added to each projection's output.

Legend: M routed rows (token-expert pairs), E experts, I expert width (moe_intermediate_size), Dl latent
width, O/In a projection's output/input width.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.kernels.mxfp4 import GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4
from miles_k3.model.layers import situ_glu, to_dtype

EXPERT_FORMATS = ("bf16", "mxfp4")
MXFP4_BACKENDS = ("torch", "triton")
PROJS = ("w1", "w2", "w3")  # gate, down, up (checkpoint names)
# Experts dequantized at once in MXFP4 format: bounds the transient bf16 buffer (K3: 64 x 22 MB = 1.4 GB).
DEQUANT_CHUNK = 64


_SYNC_FREE = False


@contextlib.contextmanager
def sync_free_experts():
    """Within this block routed experts never copy row counts to the host (CUDA-graph capturable decode):
    every projection is one grouped matmul over device row ends (MXFP4 on the torch backend: all experts
    dequantized at once; on the triton backend only the experts with rows are read)."""
    global _SYNC_FREE
    before, _SYNC_FREE = _SYNC_FREE, True
    try:
        yield
    finally:
        _SYNC_FREE = before


def sync_free_active() -> bool:
    """True inside `sync_free_experts()` (a decode step that may be captured in a CUDA graph)."""
    return _SYNC_FREE


_mxfp4_forced = "auto"  # kernels.mxfp4_experts (`set_mxfp4_experts_backend`), or an `mxfp4_experts_backend` block's
_mxfp4_resolved: dict[str, tuple[str, str]] = {}  # f"{device type}:{choice}" -> (backend, reason)


def _check_backend_name(name: str, what: str) -> None:
    if name not in ("auto", *MXFP4_BACKENDS):
        raise ValueError(f"{what}: '{name}' is not one of auto, {', '.join(MXFP4_BACKENDS)}")


def set_mxfp4_experts_backend(name: str) -> None:
    """Make `name` ("auto", "torch" or "triton") the process's MXFP4 experts backend: kernels.mxfp4_experts, set
    once at startup (`miles_k3.model.kernel_config.apply_kernels`). An `mxfp4_experts_backend` block overrides it."""
    global _mxfp4_forced
    _check_backend_name(name, "kernels.mxfp4_experts")
    _mxfp4_forced = name


@contextlib.contextmanager
def mxfp4_experts_backend(name: str = "auto"):
    """Within this block MXFP4 experts use backend `name` ("torch", "triton", or "auto": triton on CUDA, torch
    elsewhere), whatever kernels.mxfp4_experts says. Restores the previous choice on exit; not thread-local."""
    global _mxfp4_forced
    _check_backend_name(name, "mxfp4_experts_backend")
    before, _mxfp4_forced = _mxfp4_forced, name
    try:
        yield
    finally:
        _mxfp4_forced = before


def resolve_mxfp4_backend(device: torch.device) -> tuple[str, str]:
    """(backend, reason) of MXFP4 expert matmuls on `device` under the current choice, computed once per device
    type and choice, e.g. ("triton", "auto: CUDA available; bf16 projections of >= 134,217,728 weights, ...") or ("torch",
    "kernels.mxfp4_experts=torch"). Forced triton without CUDA (and without TRITON_INTERPRET=1) is a ValueError."""
    key = f"{device.type}:{_mxfp4_forced}"
    if key not in _mxfp4_resolved:
        forced = f"kernels.mxfp4_experts={_mxfp4_forced}"
        if _mxfp4_forced == "torch":
            choice = ("torch", forced)
        elif device.type == "cuda":
            choice = ("triton", forced if _mxfp4_forced == "triton" else
                      f"auto: CUDA available; bf16 projections of >= {FUSED_MIN_WEIGHTS:,} weights or <= "
                      f"{FUSED_MAX_ROWS} rows, others torch")
        elif _mxfp4_forced == "triton" and os.environ.get("TRITON_INTERPRET", "0") == "1":
            choice = ("triton", f"{forced}, Triton interpreter on {device.type}")
        elif _mxfp4_forced == "triton":
            raise ValueError(f"kernels.mxfp4_experts: the triton backend of MXFP4 experts needs CUDA (or "
                             f"TRITON_INTERPRET=1), got {device.type}; use torch or auto")
        else:
            choice = ("torch", f"auto: {device.type}, no CUDA: dequantize + grouped matmul")
        _mxfp4_resolved[key] = choice
    return _mxfp4_resolved[key]


# "auto" takes the fused kernel for a projection of at least this many decoded weights (all experts): there the
# bf16 copy the torch path writes and reads dominates (K3: 896 x 3072 x 3584 = 9.9e9). Below it (k3_m: 64 x 128 x
# 384 = 3.1e6, a 6 MB copy) the torch path is kept for more than FUSED_MAX_ROWS rows: on an H200 k3_m engine decode
# measured 27.8k tok/s at batch 256 (1,024 rows) with the kernel against 40.1k before it (tiny grids: 64 experts x
# 1-3 column tiles). At most FUSED_MAX_ROWS rows the kernel wins at any size: its one launch per projection against
# the torch path's dequantize + grouped matmul; on an H100 (benchmarks/results/bench_engine_gpu_h100_ab.json,
# merged LoRA both) k3_m decode at batch 1 (4 rows) 332 -> 396 tok/s and at batch 16 (64 rows) 4.79k -> 5.67k.
# Between 64 and 1,024 rows it is not measured; the torch path stays there.
FUSED_MIN_WEIGHTS = 2**27
FUSED_MAX_ROWS = 64


def _use_fused_mxfp4(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """The Triton W4A16 path: the resolved backend is triton, the activations are bf16 (its only activation
    dtype; fp32 activations keep the exact torch path), and, unless triton is forced, the projection holds at
    least FUSED_MIN_WEIGHTS weights or x has at most FUSED_MAX_ROWS rows (a function of shapes alone, so a
    captured decode step and an eager one take the same path)."""
    if x.dtype != torch.bfloat16 or resolve_mxfp4_backend(x.device)[0] != "triton":
        return False
    return (_mxfp4_forced == "triton" or packed.numel() * 2 >= FUSED_MIN_WEIGHTS
            or x.shape[0] <= FUSED_MAX_ROWS)


def _use_routing_kernel(flat_ids: torch.Tensor) -> bool:
    """Sync-free decode with ids on CUDA groups the routed rows with one Triton launch
    (`miles_k3.kernels.moe_routing.group_by_expert`, equal to argsort + index_add + cumsum bit for bit) and
    combines the expert outputs by token with one more (`combine_rows`: the fp32 products and sum over the slots
    of `combine_slots`, whose five torch kernels it replaces); everywhere else (CPU, training, prefill) the torch
    ops."""
    return _SYNC_FREE and flat_ids.is_cuda


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm (one kernel for all experts) for bf16 on CUDA."""
    return x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16


def _grouped_mm(x_MI: torch.Tensor, w_EOI: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over widths padded with zeros to a multiple of 8 (its 16-byte alignment): a LoRA rank of
    2 or 4 on the experts stays one kernel with no host sync, which a captured decode step needs."""
    pad_i, pad_o = -w_EOI.shape[2] % 8, -w_EOI.shape[1] % 8
    if pad_i:
        x_MI, w_EOI = F.pad(x_MI, (0, pad_i)), F.pad(w_EOI, (0, pad_i))
    if pad_o:
        w_EOI = F.pad(w_EOI, (0, 0, 0, pad_o))
    y = torch._grouped_mm(x_MI, w_EOI.transpose(1, 2), offs=offs)
    return y[:, :y.shape[1] - pad_o] if pad_o else y


Counts = list[int] | torch.Tensor  # rows per expert (host list), or their cumulative ends (device int32 tensor)


def grouped_linear(x_MI: torch.Tensor, counts: Counts, w_EOI: torch.Tensor) -> torch.Tensor:
    """y [M, O]: rows of x grouped by expert (counts[e] rows for expert e, in order) times w[e]^T.

    Ordinary autograd: differentiable in x and w. On CUDA bf16 one `torch._grouped_mm` kernel; otherwise
    one matmul per expert that has rows (the CPU reference path). `counts` may be a device tensor of
    cumulative row ends (int32 [E], the sync-free form: captured decode steps, and on CUDA in bf16 every forward of
    bf16 experts without LoRA, `RoutedExperts.device_row_ends`).
    """
    if isinstance(counts, torch.Tensor):
        if _use_grouped_mm(x_MI, w_EOI):
            return _grouped_mm(x_MI, w_EOI, counts)
        counts = torch.diff(counts, prepend=counts.new_zeros(1)).tolist()  # CPU: a host list is free
    assert len(counts) == w_EOI.shape[0] and sum(counts) == x_MI.shape[0], (len(counts), w_EOI.shape)
    if x_MI.shape[0] == 0:  # [0, O], still a function of w: an expert shard that got no rows has a zero gradient
        return x_MI @ w_EOI[0].t()
    if _use_grouped_mm(x_MI, w_EOI):
        offs = torch.tensor(counts, device=x_MI.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return _grouped_mm(x_MI, w_EOI, offs)
    outs = [x_e @ w_EOI[e].t() for e, x_e in enumerate(torch.split(x_MI, counts)) if counts[e]]
    return torch.cat(outs)


def _mxfp4_grouped(x_MI: torch.Tensor, counts: Counts, packed: torch.Tensor, scale: torch.Tensor,
                   transpose: bool) -> torch.Tensor:
    """x @ W_e^T (or x @ W_e with `transpose`) over MXFP4 experts, dequantizing DEQUANT_CHUNK experts at a
    time (only chunks that have rows) into x's dtype. packed [E, O, In/2], scale [E, O, In/32]. With
    device `counts` (sync-free decode) every expert is dequantized at once: no host-side row counts."""
    if isinstance(counts, torch.Tensor):
        w = dequantize_mxfp4(packed, scale, dtype=x_MI.dtype)
        return grouped_linear(x_MI, counts, w.transpose(1, 2) if transpose else w)
    num_experts, out_rows = packed.shape[0], packed.shape[1]
    width = packed.shape[2] * 2 if transpose else out_rows
    y = x_MI.new_empty(x_MI.shape[0], width)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    for e0 in range(0, num_experts, DEQUANT_CHUNK):
        e1 = min(num_experts, e0 + DEQUANT_CHUNK)
        r0, r1 = starts[e0], starts[e1]
        if r1 == r0:
            continue
        active = [e for e in range(e0, e1) if counts[e]]
        lo, hi = active[0], active[-1] + 1  # dequantize only the span of experts that have rows
        w = dequantize_mxfp4(packed[lo:hi], scale[lo:hi], dtype=x_MI.dtype)  # [c, O, In]
        if transpose:
            w = w.transpose(1, 2)
        y[r0:r1] = grouped_linear(x_MI[r0:r1], counts[lo:hi], w)
        del w
    return y


class MXFP4GroupedLinear(torch.autograd.Function):
    """y = grouped x @ dequant(W)^T for frozen MXFP4 experts. Saves only the uint8 storage (references, no
    copy) and reads it again in backward, on the backend forward used; returns the input gradient only (the
    base is frozen)."""

    @staticmethod
    def forward(ctx, x_MI, counts, packed, scale):
        ctx.counts, ctx.fused = counts, _use_fused_mxfp4(x_MI, packed)
        ctx.save_for_backward(packed, scale)
        return _mxfp4_matmul(x_MI, counts, packed, scale, False, ctx.fused)

    @staticmethod
    def backward(ctx, grad_MO):
        packed, scale = ctx.saved_tensors
        grad_x = _mxfp4_matmul(grad_MO.contiguous(), ctx.counts, packed, scale, True, ctx.fused)
        return grad_x, None, None, None


def _mxfp4_matmul(x_MI: torch.Tensor, counts: Counts, packed: torch.Tensor, scale: torch.Tensor, transpose: bool,
                  fused: bool) -> torch.Tensor:
    """x @ W_e^T (x @ W_e with `transpose`) over MXFP4 experts by the chosen backend."""
    if fused:
        from miles_k3.kernels.mxfp4_moe import mxfp4_moe_matmul
        return mxfp4_moe_matmul(x_MI, counts, packed, scale, transpose=transpose)
    return _mxfp4_grouped(x_MI, counts, packed, scale, transpose=transpose)


def combine_slots(y_MD: torch.Tensor, order_M: torch.Tensor, w_NK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """u [N, D] in `dtype`: expert outputs y (row i is slot order[i] of the flattened [N, K] routing) put back in
    (token, slot) order and summed over the K slots with the routing weights in fp32. Deterministic (no
    atomics). The engine's captured decode step combines with `moe_routing.combine_rows` instead (one launch; its
    sum over the slots in slot order: at most one ulp of a 16-bit output from this)."""
    n_tok, top_k = w_NK.shape
    y_NKD = torch.empty_like(y_MD).index_copy_(0, order_M, y_MD).view(n_tok, top_k, y_MD.shape[-1])
    return (y_NKD.float() * w_NK.unsqueeze(-1)).sum(1).to(dtype)


class RoutedExperts(nn.Module):
    """E SiTU-GLU experts: w1 (gate), w3 (up) [E, I, Dl] and w2 (down) [E, Dl, I].

    `expert_format`: "bf16" keeps stacked Parameters `w1`, `w2`, `w3`; "mxfp4" keeps uint8 buffers
    `w1_packed` [E, I, Dl/2], `w1_scale` [E, I, Dl/32] (same for w3; w2: [E, Dl, I/2], [E, Dl, I/32]) and
    never a bf16 copy. The state dict exposes the checkpoint's per-expert names, as views into the stacked
    storage: `{e}.w1.weight` (bf16) or `{e}.w1.weight_packed` + `{e}.w1.weight_scale` (mxfp4).
    `num_experts` is the number of experts held here: all `total_experts` (E), or under expert parallelism
    (`keep_experts`) the global ids expert_offset .. expert_offset + num_experts - 1; state-dict keys always
    carry global ids, and a shard refuses another shard's experts.
    `lora`: None, or an nn.ModuleDict over some of w1/w2/w3 whose modules map (x [M, In], counts) to a
    delta [M, O] added to that projection's output.
    """

    def __init__(self, num_experts: int, latent: int, inter: int, beta: float, linear_beta: float | None,
                 expert_format: str = "bf16"):
        super().__init__()
        if expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format: '{expert_format}' is not one of {', '.join(EXPERT_FORMATS)}")
        self.num_experts, self.latent, self.inter = num_experts, latent, inter
        self.total_experts = num_experts  # E of the whole model, whether all are held here or not
        self.expert_offset = 0  # global id of the first expert held here (expert parallelism: keep_experts)
        self.beta, self.linear_beta, self.expert_format = beta, linear_beta, expert_format
        self.lora: nn.ModuleDict | None = None
        for name in PROJS:
            out_f, in_f = self.proj_shape(name)
            if expert_format == "bf16":
                setattr(self, name, nn.Parameter(torch.empty(num_experts, out_f, in_f)))
                continue
            if in_f % GROUP_SIZE:
                raise ValueError(f"{name}: input width {in_f} is not a multiple of the MXFP4 group size "
                                 f"{GROUP_SIZE}; use expert_format=bf16 for this config")
            self.register_buffer(f"{name}_packed", torch.zeros(num_experts, out_f, in_f // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale",
                                 torch.zeros(num_experts, out_f, in_f // GROUP_SIZE, dtype=torch.uint8))

    def proj_shape(self, name: str) -> tuple[int, int]:
        """(out, in) of one expert's projection `name`."""
        return (self.latent, self.inter) if name == "w2" else (self.inter, self.latent)

    def num_params(self) -> int:
        """Logical (decoded) parameters of all experts, whatever the storage format."""
        return self.num_experts * sum(o * i for o, i in map(self.proj_shape, PROJS))

    # ---- compute -----------------------------------------------------------------------------------
    def project(self, name: str, x_MI: torch.Tensor, counts: Counts) -> torch.Tensor:
        """Projection `name` of grouped rows: base (bf16 or MXFP4) plus the LoRA delta if attached."""
        if self.expert_format == "bf16":
            y = grouped_linear(x_MI, counts, to_dtype(getattr(self, name), x_MI.dtype))
        else:
            y = MXFP4GroupedLinear.apply(x_MI, counts, getattr(self, f"{name}_packed"),
                                         getattr(self, f"{name}_scale"))
        if self.lora is not None and name in self.lora and self.lora[name].enabled:
            y = y + self.lora[name](x_MI, counts).to(y.dtype)
        return y

    def grouped_glu(self, z_MI: torch.Tensor, counts: Counts) -> torch.Tensor:
        """The SiTU-GLU expert of each row: rows grouped by (local) expert, counts[e] rows each -> [M, Dl] in
        z's dtype."""
        h = situ_glu(self.project("w1", z_MI, counts), self.project("w3", z_MI, counts),
                     self.beta, self.linear_beta)
        return self.project("w2", h, counts)

    def device_row_ends(self, z_ND: torch.Tensor) -> bool:
        """Whether a forward of `z_ND` keeps the row counts on the device: bf16 experts without LoRA, z bf16 on
        CUDA, where every projection is one torch._grouped_mm reading cumulative row ends from the device. The
        host list (`bincount(...).tolist()`) would cost a device sync in every MoE layer of every training
        forward, and an upload of the offsets per projection; the offsets are the same numbers either way, so the
        kernel and its results are the same."""
        return self.expert_format == "bf16" and self.lora is None and z_ND.is_cuda and z_ND.dtype == torch.bfloat16

    def forward(self, z_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        """u = sum_k w[n,k] * E_{ids[n,k]}(z[n]); expert outputs rounded to z's dtype, weighted in fp32."""
        n_tok, top_k = ids_NK.shape
        if n_tok == 0:
            return torch.zeros_like(z_ND)
        flat_ids = ids_NK.reshape(-1)
        if _use_routing_kernel(flat_ids):  # captured decode on CUDA: the grouping and the combine, one launch each
            from miles_k3.kernels.moe_routing import combine_rows, group_by_expert
            _, token_of, counts, row_of = group_by_expert(flat_ids, self.num_experts, top_k, with_rows=True)
            return combine_rows(self.grouped_glu(z_ND[token_of], counts), row_of, w_NK, z_ND.dtype)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // top_k
        if _SYNC_FREE or self.device_row_ends(z_ND):  # cumulative row ends stay on the device (no sync)
            ones = torch.ones_like(flat_ids, dtype=torch.int32)
            counts = torch.zeros(self.num_experts, dtype=torch.int32, device=flat_ids.device)
            counts = counts.index_add_(0, flat_ids, ones).cumsum(0, dtype=torch.int32)
        else:
            counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync per layer
        return combine_slots(self.grouped_glu(z_ND[token_of], counts), order, w_NK, z_ND.dtype)

    # ---- storage -----------------------------------------------------------------------------------
    def dequantized(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A new [E, O, In] tensor of projection `name`'s decoded weights (a copy: for references/merging)."""
        if self.expert_format == "bf16":
            return getattr(self, name).detach().to(dtype, copy=True)
        return dequantize_mxfp4(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, scale_rule: str = "floor") -> None:
        """N(0, std) weights; in MXFP4 format drawn per expert and quantized (no bf16 layer copy)."""
        for name in PROJS:
            if self.expert_format == "bf16":
                getattr(self, name).normal_(0.0, std)
                continue
            packed, scale = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
            if packed.is_meta:
                continue
            out_f, in_f = self.proj_shape(name)
            for e in range(self.num_experts):
                w = torch.empty(out_f, in_f, device=packed.device).normal_(0.0, std)
                packed[e], scale[e] = quantize_mxfp4(w, scale_rule)

    @torch.no_grad()
    def keep_experts(self, first: int, count: int) -> None:
        """Keep only the experts of global ids first .. first + count - 1, in their native storage (bf16
        Parameters, the same objects, or MXFP4 uint8 buffers): a copy of that slice, so the rest is freed. The
        LoRA deltas are the caller's to slice (`miles_k3.model.parallelize`)."""
        lo = first - self.expert_offset
        assert 0 <= lo and count >= 1 and lo + count <= self.num_experts, (first, count, self.expert_offset)
        for name in PROJS:
            if self.expert_format == "bf16":
                w = getattr(self, name)
                w.data = w.data[lo: lo + count].clone()
                continue
            for kind in ("packed", "scale"):
                setattr(self, f"{name}_{kind}", getattr(self, f"{name}_{kind}")[lo: lo + count].clone())
        self.expert_offset, self.num_experts = first, count

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint suffix (`w1.weight`, or `w1.weight_packed`/`w1.weight_scale`) -> stacked tensor."""
        if self.expert_format == "bf16":
            return {f"{n}.weight": getattr(self, n) for n in PROJS}
        return {f"{n}.weight_{kind}": getattr(self, f"{n}_{kind}") for n in PROJS for kind in ("packed", "scale")}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for suffix, stacked in self.stored_tensors().items():
            for e in range(self.num_experts):
                key = f"{prefix}{self.expert_offset + e}.{suffix}"  # global ids: a shard's keys are unambiguous
                destination[key] = stacked[e] if keep_vars else stacked[e].detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        expected = set()
        for suffix, stacked in self.stored_tensors().items():
            for e in range(self.num_experts):
                key = f"{prefix}{self.expert_offset + e}.{suffix}"
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                elif state_dict[key].shape != stacked.shape[1:]:
                    error_msgs.append(f"size mismatch for {key}: checkpoint {tuple(state_dict[key].shape)}, "
                                      f"model {tuple(stacked.shape[1:])}")
                elif stacked.dtype == torch.uint8 and state_dict[key].dtype != torch.uint8:
                    error_msgs.append(f"dtype mismatch for {key}: checkpoint {state_dict[key].dtype}, "
                                      "model torch.uint8 (MXFP4 storage)")
                else:
                    with torch.no_grad():
                        stacked[e].copy_(state_dict[key])
        if strict:
            # Own direct entries only; keys of child modules (the LoRA deltas) are theirs to claim.
            extra = [k for k in state_dict if k.startswith(prefix) and k not in expected
                     and not k[len(prefix):].startswith("lora.")]
            held = range(self.expert_offset, self.expert_offset + self.num_experts)
            foreign = [k for k in extra if self.num_experts < self.total_experts
                       and k[len(prefix):].split(".", 1)[0].isdigit()
                       and int(k[len(prefix):].split(".", 1)[0]) in range(self.total_experts)]
            if foreign:
                error_msgs.append(f"{foreign[0]} (and {len(foreign) - 1} more): experts this module does not "
                                  f"hold: it holds experts {held.start}..{held.stop - 1} of {self.total_experts} "
                                  "(a parallel.ep shard); load the checkpoint shard of this ep rank, or load "
                                  "into a model not cut by parallelize")
            unexpected_keys.extend(k for k in extra if k not in foreign)
