"""The K3 decoder: layers with Block Attention Residuals, and the causal LM with its two forward modes.

Module attribute names follow the published checkpoint, so `language_model.<key>` checkpoint tensors map onto
`K3ForCausalLM.state_dict()` keys by dropping that prefix only (`CHECKPOINT_PREFIX`).

Between layers the model carries not a residual stream but (bank, partial): completed block sums and the sum of
sublayer outputs since the current block started. Each sublayer input is a depth-softmax mixture of both
(`attn_res_mix`); a block is sealed at every layer i with i % attn_res_block_size == 0 (layer 0 seals the
embedding). Modes: `forward` (full sequence: training and prefill, optionally continuing from a `K3State` and
returning one) and `step` (one decode token per request from a `K3State`); they agree numerically.

Tensor parallelism (`miles_k3.model.parallelize`) shards the vocabulary: each rank holds
rows [start, end) of the embedding (ids outside give 0, summed over the group) and of the lm_head. `forward` then
returns this rank's logits [B, T, V/tp] (the loss is vocab-parallel: `trainer.logprobs.token_logprobs` with
`vocab_shard`); `step` returns the gathered logits [B, V] for the sampler.

Legend: B batch, T tokens, D hidden, V vocabulary.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from miles_k3.model.config import K3Config
from miles_k3.model.experts import RoutedExperts
from miles_k3.model.kda import KDAAttention
from miles_k3.model.kda_ops import KDABackend, resolve_kda_backend
from miles_k3.model.layers import RMSNorm, SiTUMLP, attn_res_mix, to_dtype
from miles_k3.model.mla import MLAAttention
from miles_k3.model.moe import LatentMoE
from miles_k3.model.state import K3State
from miles_k3.parallel.comm import copy_to, gather_from, reduce_from

if TYPE_CHECKING:
    from miles_k3.model.parallelize import ShardPlan
    from miles_k3.parallel.comm import VocabShard

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "language_model."
# Tensors the checkpoint keeps in fp32 whatever the model dtype (K3 reference, checkpoint dtypes).
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def init_rule(name: str, ndim: int) -> str:
    """How K3's init fills the tensor `name` (a state-dict or checkpoint name) of `ndim` dims: "zeros" (AttnRes
    pseudo-queries, dt_bias, the router's selection bias), "a_log" (log U(1, 16)), "conv" (U(+-W^-1/2), nn.Conv1d's
    bound for fan_in = W), "ones" (norms) or "normal" (N(0, std): linears, embeddings, experts)."""
    if name.endswith(("_res_proj.weight", "dt_bias", "e_score_correction_bias")):
        return "zeros"
    if name.endswith("A_log"):
        return "a_log"
    if name.endswith("conv1d.weight"):
        return "conv"
    return "ones" if ndim == 1 else "normal"


def fill_init_(t: torch.Tensor, rule: str, std: float = 0.02, generator: torch.Generator | None = None
               ) -> torch.Tensor:
    """Fill `t` in place by `rule` (`init_rule`), drawing from `generator` (None: torch's global RNG)."""
    if rule == "zeros":
        return t.zero_()
    if rule == "a_log":
        return t.uniform_(1, 16, generator=generator).log_()
    if rule == "conv":
        return t.uniform_(-1, 1, generator=generator).mul_(t.shape[-1] ** -0.5)
    if rule == "ones":
        return t.fill_(1.0)
    return t.normal_(0.0, std, generator=generator)


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer_id: int, expert_format: str = "bf16"):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_id = layer_id
        self.seals_block = layer_id % cfg.attn_res_block_size == 0
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attention_res_norm = RMSNorm(d, eps)
        self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
        self.mlp_res_norm = RMSNorm(d, eps)
        self.mlp_res_proj = nn.Linear(d, 1, bias=False)
        self.is_mla = cfg.is_mla_layer(layer_id)
        self.self_attn = MLAAttention(cfg) if self.is_mla else KDAAttention(cfg)
        self.is_moe = cfg.is_moe_layer(layer_id)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, expert_format)
        else:
            self.mlp = SiTUMLP(d, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def forward(self, bank: list[torch.Tensor], partial: torch.Tensor, attn_fn) -> torch.Tensor:
        """One layer. `bank` is extended in place when this layer seals a block; returns the new partial sum.

        `attn_fn(layer, x)` runs `layer.self_attn` on its normed input (the caller binds mode and state).
        """
        act = self.input_layernorm.weight.dtype  # the sublayers' dtype; partial may be fp32 (`fp32_residual`)
        x_in = attn_res_mix(bank + [partial], self.self_attention_res_norm, self.self_attention_res_proj) \
            if bank else partial
        if self.seals_block:
            bank.append(partial)
        a = attn_fn(self, self.input_layernorm(x_in, act))
        partial = to_dtype(a, partial.dtype) if self.seals_block else partial + a
        x_ffn = attn_res_mix(bank + [partial], self.mlp_res_norm, self.mlp_res_proj)
        return partial + self.ffn(self.post_attention_layernorm(x_ffn, act))


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config, expert_format: str = "bf16"):
        super().__init__()
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i, expert_format) for i in range(cfg.num_hidden_layers))
        for index, layer in enumerate(layer for layer in self.layers if layer.is_moe):
            layer.block_sparse_moe.moe_index = index
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(d, 1, bias=False)
        self.vocab_shard: VocabShard | None = None
        """The embedding rows this rank holds under tensor parallelism (None: the whole vocabulary)."""
        self.fp32_residual = False
        """Carry the residual sources (the block sums and the partial sum) in fp32 (`model.fp32_residual`): each
        sublayer's output is added to an fp32 sum, the depth mixer reads fp32 sources, and only the RMSNorm'd
        input of a sublayer is rounded to the model's dtype; the final hidden state stays fp32. No effect on an
        fp32 model."""

    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, D]; vocab-parallel: this rank's rows, ids outside them 0, summed over TP."""
        shard = self.vocab_shard
        if shard is None:
            return self.embed_tokens(input_ids_BT)
        local_BT = input_ids_BT - shard.start
        outside_BT = (local_BT < 0) | (local_BT >= shard.end - shard.start)
        x_BTD = self.embed_tokens(local_BT.masked_fill(outside_BT, 0)).masked_fill(outside_BT[..., None], 0)
        return reduce_from(x_BTD, shard.group)

    def run(self, input_ids_BT: torch.Tensor, attn_fn, recompute: bool = False) -> torch.Tensor:
        """Embedding -> layers -> output mixer -> final norm; returns the final hidden states [B, T, D] (fp32 with
        `fp32_residual`, else the model's dtype).
        `recompute`: keep only each layer's inputs for backward and recompute the rest (activation
        checkpointing; `attn_fn` then runs again during backward)."""
        partial = self.embed(input_ids_BT)
        if self.fp32_residual:
            partial = partial.float()
        bank: list[torch.Tensor] = []
        for layer in self.layers:
            partial = _checkpointed_layer(layer, bank, partial, attn_fn) if recompute \
                else layer(bank, partial, attn_fn)
        return self.norm(attn_res_mix(bank + [partial], self.output_attn_res_norm, self.output_attn_res_proj))


def _checkpointed_layer(layer: K3DecoderLayer, bank: list[torch.Tensor], partial: torch.Tensor, attn_fn
                        ) -> torch.Tensor:
    """`layer(bank, partial, attn_fn)` keeping only its inputs for backward (non-reentrant checkpoint: the RNG
    state is replayed, so LoRA dropout masks match). The bank is extended here, outside the recomputed part,
    exactly as the layer itself would extend it."""
    def run_layer(partial_in: torch.Tensor, *bank_in: torch.Tensor) -> torch.Tensor:
        return layer(list(bank_in), partial_in, attn_fn)

    out = checkpoint(run_layer, partial, *bank, use_reentrant=False)
    if layer.seals_block:
        bank.append(partial)
    return out


@dataclass
class K3Output:
    logits: torch.Tensor | None  # [B, T, V] (or [B, V] from `step`); None when not requested
    state: K3State | None


class K3ForCausalLM(nn.Module):
    """Kimi K3 text backbone + LM head. `kda_backend`: "auto" or a name from `kda_ops` (resolved per device).
    `expert_format`: routed experts as "bf16" parameters or frozen "mxfp4" storage (`experts.py`)."""

    def __init__(self, cfg: K3Config, kda_backend: str = "auto", expert_format: str = "bf16"):
        super().__init__()
        self.config = cfg
        self.expert_format = expert_format
        self.kda_backend_name = kda_backend
        self._backends: dict[str, KDABackend] = {}
        self.model = K3Model(cfg, expert_format)
        self.activation_checkpointing = False
        """Recompute each layer's activations in backward instead of keeping them (`forward` while autograd
        records, without `return_state`: training; prefill and decode are unaffected)."""
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.fp32_lm_head = False
        """Logits in fp32 (`model.fp32_lm_head`): the lm_head product of the bf16 hidden state and weight computed in
        fp32 and not rounded back to bf16 (whose step near a logit of 10 is 0.06 nats). Both sides of a run, the
        engine's decode and the trainer's forward, read the same flag (and SGLang's enable_fp32_lm_head)."""
        self.shard_plan: ShardPlan | None = None
        """What this rank holds of the model (`parallelize`); None: the whole model, never parallelized."""
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def kda_backend(self, device: torch.device) -> KDABackend:
        """The KDA backend for `device`, resolved once and logged with the reason."""
        key = torch.device(device).type
        if key not in self._backends:
            backend = resolve_kda_backend(self.kda_backend_name, torch.device(device),
                                          self.config.linear_attn_config.gate_lower_bound)
            log.info("kda=%s (%s)", backend.name, backend.reason)
            self._backends[key] = backend
        return self._backends[key]

    @property
    def vocab_shard(self) -> VocabShard | None:
        """The vocabulary rows of this rank's logits (tensor parallelism), None when they cover it all."""
        return self.model.vocab_shard

    def _logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """lm_head logits [B, T, V] (this rank's [B, T, V/tp] under TP: hidden enters through `copy_to`); fp32 with
        `fp32_lm_head`, else the model's dtype. An fp32 hidden state (`fp32_residual`) is read as it is by the fp32
        head, and rounded to the weight's dtype otherwise."""
        shard = self.vocab_shard
        x = hidden_BTD if shard is None else copy_to(hidden_BTD, shard.group)
        weight = self.lm_head.weight
        if self.fp32_lm_head and weight.dtype != torch.float32:
            with torch.autocast(x.device.type, enabled=False):  # bf16 autocast would round the product again
                return F.linear(x.float(), weight.float())
        return self.lm_head(to_dtype(x, weight.dtype))

    def forward(self, input_ids_BT: torch.Tensor, seq_lens: torch.Tensor | None = None,
                state: K3State | None = None, return_state: bool = False, return_logits: bool = True
                ) -> K3Output:
        """Full-sequence forward (training, prefill). Tokens are left-aligned; `seq_lens` [B] counts the real
        ones (default: all T). With `state`, continues each request after its `state.seq_lens` tokens.
        Returns logits [B, T, V] (None with `return_logits=False`; under TP this rank's vocabulary rows,
        [B, T, V/tp], see `vocab_shard`) and, if `return_state`, the state after each request's last real token.
        """
        b, t = input_ids_BT.shape
        backend = self.kda_backend(input_ids_BT.device)
        past = state.seq_lens if state is not None else None
        states: list = []

        def attn_fn(layer: K3DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            prev = state.layers[layer.layer_id] if state is not None else None
            if layer.is_mla:
                y, st = layer.self_attn(x, prev, past)
            else:
                y, st = layer.self_attn(x, backend, prev, seq_lens)
            if return_state:  # training keeps no state (nor its autograd graph)
                states.append(st)
            return y

        recompute = self.activation_checkpointing and torch.is_grad_enabled() and not return_state
        hidden = self.model.run(input_ids_BT, attn_fn, recompute)
        logits = self._logits(hidden) if return_logits else None  # prefill for a cache needs no logits
        if not return_state:
            return K3Output(logits, None)
        new_lens = torch.full((b,), t, device=input_ids_BT.device) if seq_lens is None else seq_lens
        total = new_lens if past is None else past + new_lens
        return K3Output(logits, K3State(total.long(), states))

    @torch.no_grad()
    def step(self, input_ids_B: torch.Tensor, state: K3State) -> K3Output:
        """One decode token per request: logits [B, V] (the whole vocabulary, gathered under TP) and the advanced
        state (KDA recurrent, MLA absorbed).
        With pooled layer states (KDA slots_B, MLA table_BT) the step updates the pools in place and reads
        nothing on the host, so it can be captured in a CUDA graph together with `experts.sync_free_experts`."""
        backend = self.kda_backend(input_ids_B.device)
        states: list = []

        def attn_fn(layer: K3DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            prev = state.layers[layer.layer_id]
            if layer.is_mla:
                y, st = layer.self_attn.step(x, prev, state.seq_lens)
            else:
                y, st = layer.self_attn(x, backend, prev, decode=True)
            states.append(st)
            return y

        logits_B1V = self._logits(self.model.run(input_ids_B[:, None], attn_fn))
        shard = self.vocab_shard
        if shard is not None:
            logits_B1V = gather_from(logits_B1V, shard.group, dim=-1, total=shard.size)
        return K3Output(logits_B1V[:, 0], K3State(state.seq_lens + 1, states))

    def empty_state(self, batch: int, device=None, dtype=None) -> K3State:
        """The state of B requests that have consumed no tokens yet."""
        device = device or self.lm_head.weight.device
        dtype = dtype or self.lm_head.weight.dtype
        layers = [layer.self_attn.empty_state(batch, device, dtype) for layer in self.model.layers]
        return K3State(torch.zeros(batch, dtype=torch.long, device=device), layers)

    # ---- parameters --------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Pretraining-style init (K3 reference / NeMo port; `init_rule`): linears and experts N(0, std), norms 1,
        A_log = log U(1, 16), dt_bias 0, AttnRes pseudo-queries 0 (so a first mix is a uniform average), drawn from
        torch's global RNG. (A run's random base is drawn per tensor instead: `weights.RandomInit`.)"""
        for name, p in self.named_parameters():
            if p.is_meta or "lora_" in name:
                continue  # meta: nothing to fill (initialising costs seconds); adapters init themselves
            fill_init_(p, init_rule(name, p.ndim), std)
        for m in self.modules():
            if isinstance(m, RoutedExperts) and m.expert_format == "mxfp4":
                m.reset_parameters(std)

    def cast(self, dtype: torch.dtype) -> K3ForCausalLM:
        """Cast to `dtype`, keeping the checkpoint's fp32 tensors (A_log, dt_bias, convs, o_norm, bias) and LoRA
        adapters fp32. MXFP4 expert storage (uint8 buffers) is untouched."""
        for name, p in self.named_parameters():
            keep_fp32 = name.endswith(FP32_PARAM_SUFFIXES) or "lora_" in name  # adapters: fp32 masters
            p.data = p.data.to(torch.float32 if keep_fp32 else dtype)
        return self
