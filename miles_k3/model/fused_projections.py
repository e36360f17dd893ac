"""Linears that read one input, computed together in the rollout engine's decode step.

A decode step at batch 1-16 is bound by kernel launches, not by the bytes it reads (on an H100 a k3_m step takes
about as long at batch 16 as at batch 1). Each linear is one GEMM, and each adapted one (`LoRALinear`, unmerged)
four more: A x, B (A x), the scale and the add. `FusedProjections` computes a group of linears that read the same
input as one GEMM over their weights stacked by rows, and with adapters one GEMM over their A stacked by rows and
one over their B placed block-diagonally, added into the base output with the scale as the GEMM's alpha
(`addmm_`): 1 kernel for the group without adapters (or with merged ones), 3 with, against 1 or 5 per linear.

The groups (`attach_fused_projections`): KDA's q, k, v, g, b and f_a projections; MLA's q_a, kv_a and g; a dense
MLP's gate and up; a latent MoE's routed down projection with its shared expert's gate and up. Only the engine's
model gets them (its own copy of the grouped base weights: see `EngineConfig.fuse_projections` for the memory),
only the decode step uses them (one token per request), and only without tensor or expert parallelism.

Numerics against the linears one by one: every output element is the same dot product, but the GEMM over the
stacked weight may split its reduction differently (last-bit differences in bf16), and the adapter's delta is added
to the base output before one rounding, where the unfused form rounds B (A x), its scaled value and the sum.
`refresh` re-reads the weights and adapters (the engine calls it whenever it binds another adapter or version).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.lora import LoRALinear


class FusedProjections:
    """The linears of `sections` (a sequence of sequences of nn.Linear, every one reading the same input) as one
    GEMM (+ two for their adapters). Calling it on x [..., In] returns one tensor [..., sum of the section's Out]
    per section: views into one output (unit stride along the last dim), the section's linears side by side.

    The linears must share In, dtype and device and have no bias. An adapted linear (`LoRALinear`) whose
    `inference_copies.forward_merged` is set (the engine's merge_lora) enters with its merged weight and no
    adapter GEMMs; all the group's adapters must then be merged, and otherwise share one scale."""

    def __init__(self, sections: Sequence[Sequence[nn.Linear]]):
        self.sections = [tuple(s) for s in sections]
        self.linears: tuple[nn.Linear, ...] = tuple(m for s in self.sections for m in s)
        if not self.linears or any(not s for s in self.sections):
            raise ValueError("FusedProjections: every section needs at least one linear")
        first = self.linears[0].weight
        for m in self.linears:
            if m.bias is not None or m.in_features != first.shape[1] or m.weight.dtype != first.dtype \
                    or m.weight.device != first.device:
                raise ValueError(f"FusedProjections: the linears must share In ({first.shape[1]}), dtype "
                                 f"({first.dtype}) and device ({first.device}) and have no bias; got {m}")
        self.widths = [sum(m.out_features for m in s) for s in self.sections]
        adapted = [m for m in self.linears if isinstance(m, LoRALinear)]
        merged = [m for m in adapted if m.inference_copies is not None and m.inference_copies.forward_merged]
        if merged and len(merged) != len(adapted):
            raise ValueError("FusedProjections: some adapters of the group are merged and some not")
        self.merged = bool(merged)
        self.adapted = tuple(adapted)
        self.weight = torch.empty(sum(self.widths), first.shape[1], dtype=first.dtype, device=first.device)
        self.a = self.b = None
        self.scale = 1.0
        if adapted and not self.merged:
            scales = {m.scale for m in adapted}
            if len(scales) > 1:
                raise ValueError(f"FusedProjections: the group's adapters have scales {sorted(scales)}; one is needed")
            self.scale = scales.pop()
            rank = sum(m.rank for m in adapted)
            self.a = torch.empty(rank, first.shape[1], dtype=first.dtype, device=first.device)
            self.b = torch.zeros(sum(self.widths), rank, dtype=first.dtype, device=first.device)
        self.refresh()

    def nbytes(self) -> int:
        """Bytes this group allocated (the stacked weights, and A and B)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.a, self.b) if t is not None)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the linears' current weights (merged: W + s B A rounded once, as `LoRALinear.merged_weight`) and
        adapters in place (the addresses never change: captured CUDA graphs read them)."""
        row = col = 0
        for m in self.linears:
            out = m.out_features
            self.weight[row:row + out].copy_(m.merged_weight() if self.merged and m in self.adapted else m.weight)
            if self.a is not None and isinstance(m, LoRALinear):
                self.a[col:col + m.rank].copy_(m.lora_A.weight)
                self.b[row:row + out, col:col + m.rank].copy_(m.lora_B.weight)
                col += m.rank
            row += out

    def serves(self, x: torch.Tensor) -> bool:
        """Whether this call can take the fused form: a decode step's input (one token per request, x [B, 1, In]),
        no autograd, x in the weights' dtype, every adapter enabled (disabled, a LoRALinear computes its base
        alone)."""
        return (x.dim() == 3 and x.shape[1] == 1 and not torch.is_grad_enabled() and x.dtype == self.weight.dtype
                and all(m.enabled for m in self.adapted))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        x_NI = x.reshape(-1, x.shape[-1])
        y_NO = F.linear(x_NI, self.weight)
        if self.a is not None:
            y_NO.addmm_(F.linear(x_NI, self.a), self.b.t(), alpha=self.scale)
        return list(y_NO.view(*x.shape[:-1], y_NO.shape[-1]).split(self.widths, dim=-1))


def attach_fused_projections(model: nn.Module) -> list[FusedProjections]:
    """Set `fused_projections` on every module of the engine's `model` that has a group (KDA and MLA attention,
    dense MLPs, latent MoE blocks; not under tensor or expert parallelism) and return the groups. Attach after the
    adapters and their inference copies (`attach_inference_copies`): a group reads whether they are merged."""
    from miles_k3.model.kda import KDAAttention
    from miles_k3.model.layers import SiTUMLP
    from miles_k3.model.mla import MLAAttention
    from miles_k3.model.moe import LatentMoE

    modules = list(model.modules())
    shared_in_moe = {id(m.shared_experts) for m in modules if isinstance(m, LatentMoE) and _moe_groups(m)}
    groups = []
    for m in modules:
        sections = None
        if isinstance(m, KDAAttention) and m.tp_group is None:
            sections = [(m.q_proj, m.k_proj, m.v_proj), (m.g_proj,), (m.b_proj,), (m.f_a_proj,)]
        elif isinstance(m, MLAAttention) and m.tp_group is None:
            sections = [(m.q_a_proj,), (m.kv_a_proj_with_mqa,)] + ([(m.g_proj,)] if m.g_proj is not None else [])
        elif isinstance(m, SiTUMLP) and m.tp_group is None and id(m) not in shared_in_moe:
            sections = [(m.gate_proj,), (m.up_proj,)]
        elif isinstance(m, LatentMoE) and _moe_groups(m):
            shared = m.shared_experts
            sections = [(m.routed_expert_down_proj,), (shared.gate_proj,), (shared.up_proj,)]
        if sections is not None:
            m.fused_projections = FusedProjections(sections)
            groups.append(m.fused_projections)
    return groups


def _moe_groups(moe: nn.Module) -> bool:
    """Whether a latent MoE block gets a group (its shared expert's gate and up join its routed down projection;
    the shared expert then gets none of its own): a shared expert, no expert or tensor parallelism."""
    return moe.expert_parallel is None and moe.shared_experts is not None and moe.shared_experts.tp_group is None
