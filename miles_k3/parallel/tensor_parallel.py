"""Tensor parallelism (TP) of K3's dense parts, Megatron's layout: `shard_model_tp` keeps, in place, this rank's
shard of a full model built with the same seed on every rank (and with its LoRA applied, so each adapter is
sliced together with its base), and records the TP group on the modules, whose forwards then run the region
collectives (`comm.copy_to` into a region, `comm.reduce_from` out of it).

What is split over the `tp` ranks (rank r keeps the r-th of tp equal, contiguous slices):
* KDA: the heads. Column-parallel (output rows): q/k/v/g_proj, f_b_proj, b_proj, the three short convs'
  channels, dt_bias [H*K], A_log [H]; row-parallel (input columns): o_proj. f_a_proj and o_norm are replicated.
* MLA: the query heads. Column: q_b_proj, kv_b_proj, g_proj; row: o_proj. The latent path (q_a_proj,
  kv_a_proj_with_mqa and their norms) is replicated: every rank caches the same latents.
* SiTU MLPs (dense layer 0, the MoE's shared experts): gate/up column, down row.
* The vocabulary: rows of the embedding and of the lm_head (`VocabShard`); the logits stay split
  ([B, T, V/tp]: the loss is vocab-parallel) except in decode, which gathers them for the sampler.
Routed experts are expert parallelism's (`ep`), not touched here.

LoRA under a split base: a column-parallel base keeps its adapter's B rows [Out/tp, r] (`mark_sharded` "tp") and a
replicated A whose gradient on each rank is that rank's part (`mark_grad_groups` "dp", "tp": summed by
`grads.reduce_gradients`); a row-parallel base keeps A's columns [r, In/tp] (sharded) and a replicated B with
partial gradients (B (A_r x_r) summed over the ranks by the block's `reduce_from` is B A x). Adapters of the
replicated projections whose outputs enter a region through `copy_to` (f_a_proj, q_a_proj, kv_a_proj_with_mqa)
get the whole gradient on every rank and keep the default ("dp",).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.kda import KDAAttention
from miles_k3.model.layers import SiTUMLP
from miles_k3.model.lora import LoRALinear
from miles_k3.model.mla import MLAAttention
from miles_k3.parallel.config import ParallelConfig, ParallelConfigError
from miles_k3.parallel.grads import mark_grad_groups, mark_sharded
from miles_k3.parallel.mesh import ParallelContext


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows [start, end) of `size` that this rank's embedding, lm_head and logits hold."""

    start: int
    end: int
    size: int
    """The whole vocabulary (V)."""
    group: object
    """The TP process group the vocabulary is split over."""


def vocab_shard(model: nn.Module) -> VocabShard | None:
    """The vocabulary shard of `model`'s logits: a tensor-parallel K3's `vocab_shard`, else None (a whole-vocab
    model, e.g. an HF causal LM)."""
    return model.vocab_shard if isinstance(model, K3ForCausalLM) else None


def shard_model_tp(model: K3ForCausalLM, ctx: ParallelContext) -> None:
    """Keep this rank's TP shard of `model` (a full model, after `apply_lora`), in place, and record
    `ctx.tp_group` on its modules; `model.tp_context` becomes `ctx`. A no-op when ctx.tp_size is 1. Raises
    ParallelConfigError (naming parallel.tp) when tp does not divide a split dimension or the model is sharded
    already. Build the optimizer after this call: the sharded tensors are new storage. Adapters attached after
    it would be neither sliced nor marked: apply LoRA first."""
    if ctx.tp_size == 1:
        return
    if model.tp_context is not None:
        raise ParallelConfigError(f"parallel.tp: this model is already sharded for tp={model.tp_context.tp_size}; "
                                  "shard_model_tp takes a full model (build it again to reshard)")
    ParallelConfig(tp=ctx.tp_size).check_model(model.config)
    _lay_out(model, _Shards(ctx, slice_tensors=True))


def adopt_tp_layout(twin: K3ForCausalLM, ctx: ParallelContext) -> None:
    """Record on `twin` the TP layout of a model sharded by `shard_model_tp`, whose tensors `twin` already holds
    (the rollout engine's `share_base` twin: its modules were built for the full shapes): head counts, widths
    and groups are set, nothing is sliced; each tensor's shape is checked to be this rank's shard. A no-op when
    ctx.tp_size is 1."""
    if ctx.tp_size > 1:
        _lay_out(twin, _Shards(ctx, slice_tensors=False))


class _Shards:
    """Takes this rank's slice of tensors (`slice_tensors`), or checks that a tensor is that slice already."""

    def __init__(self, ctx: ParallelContext, slice_tensors: bool):
        self.ctx, self.slice_tensors = ctx, slice_tensors
        self.rank, self.size, self.group = ctx.tp_rank, ctx.tp_size, ctx.tp_group

    def bounds(self, full: int) -> tuple[int, int]:
        """[start, end) of this rank's slice of a dimension of length `full` (divisible: `check_model`)."""
        n = full // self.size
        return self.rank * n, (self.rank + 1) * n

    def take(self, p: torch.Tensor, dim: int, full: int) -> None:
        """p (a Parameter) becomes its slice along `dim` (new contiguous storage: the whole is freed)."""
        start, end = self.bounds(full)
        if not self.slice_tensors:
            assert p.shape[dim] == end - start, (tuple(p.shape), dim, full, self.size)
            return
        assert p.shape[dim] == full, (tuple(p.shape), dim, full)
        p.data = p.data.narrow(dim, start, end - start).clone(memory_format=torch.contiguous_format)

    def column(self, lin: nn.Linear) -> None:
        """Output rows split (a column-parallel linear); its adapter's B split with them, A's grads partial."""
        full = lin.out_features
        self.take(lin.weight, 0, full)
        if isinstance(lin, LoRALinear):
            self.take(lin.lora_B.weight, 0, full)
            lin.lora_B.out_features = full // self.size
            mark_sharded(lin.lora_B.weight, "tp")
            mark_grad_groups(lin.lora_A.weight, "dp", "tp")
        lin.out_features = full // self.size

    def row(self, lin: nn.Linear) -> None:
        """Input columns split (a row-parallel linear); its adapter's A split with them, B's grads partial."""
        full = lin.in_features
        self.take(lin.weight, 1, full)
        if isinstance(lin, LoRALinear):
            self.take(lin.lora_A.weight, 1, full)
            lin.lora_A.in_features = full // self.size
            mark_sharded(lin.lora_A.weight, "tp", dim=1)
            mark_grad_groups(lin.lora_B.weight, "dp", "tp")
        lin.in_features = full // self.size


def _lay_out(model: K3ForCausalLM, shards: _Shards) -> None:
    for layer in model.model.layers:
        if isinstance(layer.self_attn, MLAAttention):
            _mla(layer.self_attn, shards)
        else:
            _kda(layer.self_attn, shards)
        mlps = [layer.block_sparse_moe.shared_experts] if layer.is_moe else [layer.mlp]
        for mlp in filter(None, mlps):
            _mlp(mlp, shards)
    _vocab(model, shards)
    model.tp_context = shards.ctx


def _kda(m: KDAAttention, shards: _Shards) -> None:
    h, k = m.num_heads, m.head_dim
    for lin in (m.q_proj, m.k_proj, m.v_proj, m.g_proj, m.f_b_proj, m.b_proj):
        shards.column(lin)
    for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):  # depthwise: one channel per row
        shards.take(conv.weight, 0, h * k)
        conv.in_channels = conv.out_channels = conv.groups = h * k // shards.size
    shards.take(m.dt_bias, 0, h * k)
    shards.take(m.A_log, 0, h)
    shards.row(m.o_proj)
    m.num_heads = h // shards.size
    m.tp_group = shards.group


def _mla(m: MLAAttention, shards: _Shards) -> None:
    for lin in filter(None, (m.q_b_proj, m.kv_b_proj, m.g_proj)):
        shards.column(lin)
    shards.row(m.o_proj)
    m.num_heads //= shards.size
    m.tp_group = shards.group


def _mlp(m: SiTUMLP, shards: _Shards) -> None:
    shards.column(m.gate_proj)
    shards.column(m.up_proj)
    shards.row(m.down_proj)
    m.tp_group = shards.group


def _vocab(model: K3ForCausalLM, shards: _Shards) -> None:
    """Embedding and lm_head rows [start, end) (one slice when they are tied)."""
    size = model.config.vocab_size
    embed, head = model.model.embed_tokens, model.lm_head
    tied = head.weight is embed.weight
    shards.take(embed.weight, 0, size)
    embed.num_embeddings = size // shards.size
    if not tied:
        shards.take(head.weight, 0, size)
    head.out_features = size // shards.size
    start, end = shards.bounds(size)
    model.model.vocab_shard = VocabShard(start, end, size, shards.group)
