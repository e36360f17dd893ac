"""K3's sharding plan: `parallelize(model, ctx)` cuts a K3 (with its LoRA attached) to this rank's shard of the
run's mesh and records, for every tensor it cuts, which slice of the whole it holds (`ShardPlan`). It is meant for a
model on the meta device (plan first, materialise after: torchtitan's contract), where cutting costs nothing; the
loader (`weights.py`) then allocates the shard shapes and reads only these slices of the checkpoint. The same
function cuts the rollout engine's twin, `model_info`'s sizing model and, for tests, a materialised full model (its
tensors are then copied to their slices). `shard_plan(model, ctx)` gives the plan alone, touching nothing.

Tensor parallelism (`tp`), Megatron's layout: rank r keeps the r-th of tp equal, contiguous slices of
* KDA: the heads. Column-parallel (output rows): q/k/v/g_proj, f_b_proj, b_proj, the three short convs' channels,
  dt_bias [H*K], A_log [H]; row-parallel (input columns): o_proj. f_a_proj and o_norm are replicated.
* MLA: the query heads. Column: q_b_proj, kv_b_proj, g_proj; row: o_proj. The latent path (q_a_proj,
  kv_a_proj_with_mqa and their norms) is replicated: every rank caches the same latents.
* SiTU MLPs (dense layer 0, the MoE's shared experts): gate/up column, down row.
* The vocabulary: rows of the embedding and of the lm_head (`VocabShard`); the logits stay split ([B, T, V/tp]: the
  loss is vocab-parallel) except in decode, which gathers them for the sampler.
Expert parallelism (`ep`): rank e of an EP group keeps routed experts [e * E/ep, (e + 1) * E/ep) of every MoE layer
in their native storage, with their expert-LoRA slices; its LatentMoE routes its tp share of the tokens and sends
rows to the experts' owners (`expert_parallel.py`). With ep = 1 the experts stay whole on every rank.

LoRA under a split base: a column-parallel base keeps its adapter's B rows [Out/tp, r] (`mark_sharded` "tp") and a
replicated A whose gradient on each rank is that rank's part (`mark_grad_groups` "dp", "tp": summed by
`grads.reduce_gradients`); a row-parallel base keeps A's columns [r, In/tp] (sharded) and a replicated B with
partial gradients (B (A_r x_r) summed over the ranks by the block's `reduce_from` is B A x). Adapters of the
replicated projections whose outputs enter a region through `copy_to` (f_a_proj, q_a_proj, kv_a_proj_with_mqa) get
the whole gradient on every rank and keep the default ("dp",). Expert LoRA is summed over the expert replicas; the
routed path's replicated latent projections, fed only this rank's tp share of the tokens, over dp and tp.

Plan keys are state-dict keys of the whole model (`model.layers.3.self_attn.q_proj.weight`; checkpoint names drop
the `language_model.` prefix only); routed experts are planned as id ranges per `RoutedExperts` module.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.expert_parallel import ExpertParallel
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.kda import KDAAttention
from miles_k3.model.layers import SiTUMLP
from miles_k3.model.lora import LoRALinear
from miles_k3.model.mla import MLAAttention
from miles_k3.model.moe import LatentMoE
from miles_k3.parallel.comm import VocabShard
from miles_k3.parallel.config import ParallelConfig, ParallelConfigError, divisors
from miles_k3.parallel.grads import mark_grad_groups, mark_sharded
from miles_k3.parallel.mesh import ParallelContext


@dataclass(frozen=True)
class Slice:
    """Rows [start, start + length) along `dim` of a tensor whose whole length there is `full`."""

    dim: int
    start: int
    length: int
    full: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This slice of `t` (the whole tensor): a view."""
        return t.narrow(self.dim, self.start, self.length)


@dataclass(frozen=True)
class ExpertRange:
    """The routed experts a rank holds of one MoE layer: global ids first .. first + count - 1 of `total`."""

    first: int
    count: int
    total: int

    @property
    def ids(self) -> range:
        return range(self.first, self.first + self.count)


@dataclass
class ShardPlan:
    """What one rank holds of a K3: for every cut tensor its `Slice` (state-dict key of the whole model -> slice;
    a key not listed is held whole), and per `RoutedExperts` module path the `ExpertRange` it holds (none listed:
    every expert). `ctx` is the rank's place in the mesh."""

    ctx: ParallelContext
    slices: dict[str, Slice] = field(default_factory=dict)
    experts: dict[str, ExpertRange] = field(default_factory=dict)

    def slice_of(self, key: str) -> Slice | None:
        return self.slices.get(key)

    def expert_range(self, path: str, total: int) -> ExpertRange:
        """The experts held of the RoutedExperts at `path` (all `total` when not expert-parallel)."""
        return self.experts.get(path, ExpertRange(0, total, total))

    @property
    def whole(self) -> bool:
        """Nothing is cut: the rank holds the whole model (one process, or a pure data-parallel mesh)."""
        return not self.slices and not self.experts


def check_mesh(cfg: K3Config, tp: int, ep: int) -> None:
    """Every dimension of `cfg` that parallel.tp / parallel.ep split divides by its degree; raises
    ParallelConfigError naming the field (before any process group starts or any weight is built)."""
    parallel = ParallelConfig(dp=1, tp=tp, ep=ep)
    lac = cfg.linear_attn_config
    tp_dims = [("KDA heads (linear_attn_config.num_heads)", lac.num_heads),
               ("MLA heads (num_attention_heads)", cfg.num_attention_heads),
               ("vocab_size", cfg.vocab_size),
               ("dense MLP width (intermediate_size)", cfg.intermediate_size)]
    if cfg.num_shared_experts:
        tp_dims.append(("shared-expert width (num_shared_experts x moe_intermediate_size)",
                        cfg.num_shared_experts * cfg.moe_intermediate_size))
    for what, size in tp_dims:
        if size % parallel.tp:
            raise ParallelConfigError(f"parallel.tp: {parallel.tp} does not divide the model's {what} = {size}; "
                                      f"use a tp among {divisors(size)}")
    if cfg.num_experts % parallel.ep:
        raise ParallelConfigError(f"parallel.ep: {parallel.ep} does not divide the model's num_experts = "
                                  f"{cfg.num_experts}; use an ep among {divisors(cfg.num_experts)} that also "
                                  f"divides the world size")


def shard_plan(model: K3ForCausalLM, ctx: ParallelContext) -> ShardPlan:
    """The plan `parallelize(model, ctx)` would apply, computed from a whole (unsharded) `model` on any device, the
    model untouched: cheap enough to plan every rank of a large mesh from one meta model."""
    return _walk(model, _Planner(ctx, apply=False))


def parallelize(model: K3ForCausalLM, ctx: ParallelContext) -> ShardPlan:
    """Cut `model` (whole, LoRA already attached: adapters are cut with their bases) to this rank's shard of `ctx`,
    in place: tensors become their slices (free on the meta device; a materialised model's slices are copies, the
    whole freed), modules record their groups (tp_group, vocab_shard, expert_parallel) and adapters their gradient
    groups. Returns the plan, also kept as `model.shard_plan`. A one-rank or pure-dp `ctx` cuts nothing. Raises
    ParallelConfigError (naming parallel.tp / parallel.ep and the tensor) when a degree does not divide a split
    dimension, ValueError when the model is cut already. Build an optimizer after this call."""
    if model.shard_plan is not None and not model.shard_plan.whole:
        c = model.shard_plan.ctx
        raise ValueError(f"parallelize: this model is already cut for tp={c.tp_size}, ep={c.ep_size}; parallelize "
                         "a whole model (build it again to reshard)")
    check_mesh(model.config, ctx.tp_size, ctx.ep_size)
    shard_plan(model, ctx)  # every tensor's slice checked before the first is cut
    plan = _walk(model, _Planner(ctx, apply=True))
    model.shard_plan = plan
    return plan


def vocab_shard(model: nn.Module) -> VocabShard | None:
    """The vocabulary shard of `model`'s logits: a tensor-parallel K3's `vocab_shard`, else None (a whole-vocab
    model, e.g. an HF causal LM)."""
    return model.vocab_shard if isinstance(model, K3ForCausalLM) else None


class _Planner:
    """Records this rank's slice of each tensor it is shown (`take`) and, when `apply`, cuts the tensor and the
    module attributes that describe it."""

    def __init__(self, ctx: ParallelContext, apply: bool):
        self.ctx, self.apply = ctx, apply
        self.plan = ShardPlan(ctx)

    def take(self, key: str, p: torch.Tensor, dim: int, full: int) -> None:
        """p (a Parameter: the whole `full` along `dim`) is held as this tp rank's slice."""
        tp = self.ctx.tp_size
        if full % tp:
            raise ParallelConfigError(f"parallel.tp: {tp} does not divide '{key}' (length {full} along dim {dim}); "
                                      f"use a tp among {divisors(full)}")
        if p.shape[dim] != full:
            raise ValueError(f"parallelize: '{key}' has shape {list(p.shape)}, not the whole {full} along dim {dim}")
        s = Slice(dim, self.ctx.tp_rank * (full // tp), full // tp, full)
        self.plan.slices[key] = s
        if self.apply:
            p.data = s.of(p.data).clone(memory_format=torch.contiguous_format)

    def column(self, path: str, lin: nn.Linear) -> None:
        """Output rows split (a column-parallel linear); its adapter's B split with them, A's grads partial."""
        self._split(path, lin, 0)

    def row(self, path: str, lin: nn.Linear) -> None:
        """Input columns split (a row-parallel linear); its adapter's A split with them, B's grads partial."""
        self._split(path, lin, 1)

    def _split(self, path: str, lin: nn.Linear, dim: int) -> None:
        """`lin`'s weight split along `dim` (0: out_features, 1: in_features); of a LoRALinear's adapter, the half
        on the split side (B for 0, A for 1) is split with it and the other half's gradients are partial."""
        attr = ("out_features", "in_features")[dim]
        full = getattr(lin, attr)
        self.take(f"{path}.weight", lin.weight, dim, full)
        if isinstance(lin, LoRALinear):
            cut, other = ("lora_B", "lora_A") if dim == 0 else ("lora_A", "lora_B")
            self.take(f"{path}.{cut}.weight", getattr(lin, cut).weight, dim, full)
            if self.apply:
                setattr(getattr(lin, cut), attr, full // self.ctx.tp_size)
                mark_sharded(getattr(lin, cut).weight, "tp", dim=dim)
                mark_grad_groups(getattr(lin, other).weight, "dp", "tp")
        if self.apply:
            setattr(lin, attr, full // self.ctx.tp_size)


def _walk(model: K3ForCausalLM, planner: _Planner) -> ShardPlan:
    ctx = planner.ctx
    if ctx.tp_size > 1:
        for i, layer in enumerate(model.model.layers):
            path = f"model.layers.{i}"
            if isinstance(layer.self_attn, MLAAttention):
                _mla(f"{path}.self_attn", layer.self_attn, planner)
            else:
                _kda(f"{path}.self_attn", layer.self_attn, planner)
            if not layer.is_moe:
                _mlp(f"{path}.mlp", layer.mlp, planner)
            elif layer.block_sparse_moe.shared_experts is not None:
                _mlp(f"{path}.block_sparse_moe.shared_experts", layer.block_sparse_moe.shared_experts, planner)
        _vocab(model, planner)
    if ctx.ep_size > 1:
        for i, layer in enumerate(model.model.layers):
            if layer.is_moe:
                _experts(f"model.layers.{i}.block_sparse_moe", layer.block_sparse_moe, planner)
    return planner.plan


def _kda(path: str, m: KDAAttention, w: _Planner) -> None:
    h, k = m.num_heads, m.head_dim
    for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj"):
        w.column(f"{path}.{name}", getattr(m, name))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):  # depthwise: one channel per row
        conv = getattr(m, name)
        w.take(f"{path}.{name}.weight", conv.weight, 0, h * k)
        if w.apply:
            conv.in_channels = conv.out_channels = conv.groups = h * k // w.ctx.tp_size
    w.take(f"{path}.dt_bias", m.dt_bias, 0, h * k)
    w.take(f"{path}.A_log", m.A_log, 0, h)
    w.row(f"{path}.o_proj", m.o_proj)
    if w.apply:
        m.num_heads = h // w.ctx.tp_size
        m.tp_group = w.ctx.tp_group


def _mla(path: str, m: MLAAttention, w: _Planner) -> None:
    for name in ("q_b_proj", "kv_b_proj", "g_proj"):
        if getattr(m, name, None) is not None:
            w.column(f"{path}.{name}", getattr(m, name))
    w.row(f"{path}.o_proj", m.o_proj)
    if w.apply:
        m.num_heads //= w.ctx.tp_size
        m.tp_group = w.ctx.tp_group


def _mlp(path: str, m: SiTUMLP, w: _Planner) -> None:
    w.column(f"{path}.gate_proj", m.gate_proj)
    w.column(f"{path}.up_proj", m.up_proj)
    w.row(f"{path}.down_proj", m.down_proj)
    if w.apply:
        m.tp_group = w.ctx.tp_group


def _vocab(model: K3ForCausalLM, w: _Planner) -> None:
    """Embedding and lm_head rows [start, end) (one slice when they are tied)."""
    size = model.config.vocab_size
    embed, head = model.model.embed_tokens, model.lm_head
    tied = head.weight is embed.weight
    w.take("model.embed_tokens.weight", embed.weight, 0, size)
    if not tied:
        w.take("lm_head.weight", head.weight, 0, size)
    if w.apply:
        n = size // w.ctx.tp_size
        embed.num_embeddings = head.out_features = n
        model.model.vocab_shard = VocabShard(w.ctx.tp_rank * n, (w.ctx.tp_rank + 1) * n, size, w.ctx.tp_group)


def _experts(path: str, moe: LatentMoE, w: _Planner) -> None:
    """Experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) and their LoRA slices; the routed path made expert-parallel."""
    ctx, experts = w.ctx, moe.experts
    total = experts.total_experts
    if total % ctx.ep_size:
        raise ParallelConfigError(f"parallel.ep: {ctx.ep_size} does not divide the model's num_experts = {total}; "
                                  f"use an ep among {divisors(total)} that also divides the world size")
    if experts.num_experts != total:
        raise ValueError(f"parallelize: '{path}.experts' already holds {experts.num_experts} of {total} experts")
    held = ExpertRange(ctx.ep_rank * (total // ctx.ep_size), total // ctx.ep_size, total)
    w.plan.experts[f"{path}.experts"] = held
    for name, lora in (experts.lora or {}).items():
        for part in ("lora_A", "lora_B"):
            w.plan.slices[f"{path}.experts.lora.{name}.{part}"] = Slice(0, held.first, held.count, total)
    if not w.apply:
        return
    experts.keep_experts(held.first, held.count)
    for lora in (experts.lora or {}).values():
        for p in (lora.lora_A, lora.lora_B):
            p.data = p.data[held.first: held.first + held.count].clone()
            mark_grad_groups(p, "expert_replica")
            mark_sharded(p, "ep")
    for proj in (moe.routed_expert_down_proj, moe.routed_expert_up_proj):
        if isinstance(proj, LoRALinear):  # replicated, but fed only this rank's tp share of the tokens
            mark_grad_groups(proj.lora_A.weight, "dp", "tp")
            mark_grad_groups(proj.lora_B.weight, "dp", "tp")
    moe.expert_parallel = ExpertParallel(ctx.tp_group, ctx.ep_group, ctx.ep_size)
