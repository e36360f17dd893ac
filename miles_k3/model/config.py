"""`K3Config`: the Kimi K3 text-backbone configuration under its *published* `config.json` key names.

One loader serves the real checkpoint (`moonshotai/Kimi-K3`, whose `config.json` nests these keys under
`text_config`) and our shipped configs (SHIPPED_CONFIGS: `k3`, `k3_m`, `k3_m2`, `k3_nano`, `k3_tiny`, in
`configs/*.json`). The 1-based layer lists of `linear_attn_config` are converted once, here, to 0-based
`kda_layer_ids` / `mla_layer_ids` and checked to partition the layers. Every value is validated when the config is built; a bad file fails with the key named.
Keys we do not model (token ids, `rope_theta`, `quantization_config`, ...) are kept verbatim and written back.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SHIPPED_CONFIGS = ("k3", "k3_m", "k3_m2", "k3_tiny", "k3_nano")


class ConfigError(ValueError):
    """A model config value is missing or invalid; the message names the key and the fix."""


@dataclass(frozen=True)
class LinearAttnConfig:
    """`linear_attn_config`: the KDA layers and which layers are full (MLA) attention instead."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    use_full_rank_gate: bool
    gate_lower_bound: float
    kda_layers: tuple[int, ...]  # 1-based, as published
    full_attn_layers: tuple[int, ...]  # 1-based, as published


@dataclass(frozen=True)
class K3Config:
    """Kimi K3 text backbone. Field names are the published `config.json` keys; see `configs/k3.json`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    linear_attn_config: LinearAttnConfig
    # MLA (full attention layers)
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    # FFN: dense layers then LatentMoE
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    num_shared_experts: int
    latent_moe_use_norm: bool
    moe_router_activation_func: str
    moe_renormalize: bool
    routed_scaling_factor: float
    topk_method: str
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    hidden_act: str
    activation_situ_beta: float
    activation_situ_linear_beta: float | None
    # residual stream, norms, embeddings
    attn_res_block_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived (0-based), computed once -------------------------------------------------------
    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i - 1 for i in self.linear_attn_config.kda_layers)

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i - 1 for i in self.linear_attn_config.full_attn_layers)

    def is_mla_layer(self, layer_id: int) -> bool:
        return layer_id in self.mla_layer_ids

    def is_moe_layer(self, layer_id: int) -> bool:
        """DeepSeek rule: dense for the first `first_k_dense_replace` layers, then MoE every `moe_layer_freq`."""
        return layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0

    # ---- I/O ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> K3Config:
        """Build and validate from a published-style dict (flat, or nested under `text_config`)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        raw = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
        known = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            if f.name not in raw:
                if f.name == "activation_situ_linear_beta":
                    values[f.name] = None  # null or absent: the up branch is not capped
                    continue
                hint = difflib.get_close_matches(f.name, [k for k in raw if k not in known], n=1)
                did = f" (found '{hint[0]}': a typo?)" if hint else ""
                raise ConfigError(f"{source}: missing key '{f.name}'{did}; add it as in the published K3 config")
            values[f.name] = raw[f.name]
        values["linear_attn_config"] = _parse_linear_attn(raw["linear_attn_config"], source)
        values["extra"] = {k: copy.deepcopy(v) for k, v in raw.items() if k not in known}
        cfg = cls(**values)
        cfg.validate(source)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The published-style flat dict (1-based layer lists), including the preserved extra keys."""
        out = dict(copy.deepcopy(self.extra))
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if isinstance(value, LinearAttnConfig):
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(value).items()}
            out[f.name] = value
        return out

    @classmethod
    def from_json_file(cls, path: str | Path) -> K3Config:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file; a model directory must contain config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e}); fix or re-download the file") from None
        return cls.from_dict(raw, source=str(path))

    def save(self, path: str | Path) -> None:
        """Write `config.json` (published key names) atomically: a crash never leaves half a file."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def from_name(cls, name: str) -> K3Config:
        """One of the shipped configs: `k3` (published 2.78T), `k3_m` (~0.3B), `k3_m2` (~0.6B, shapes SGLang's K3
        kernels accept), `k3_tiny` (~3.1M), `k3_nano` (~1M)."""
        if name not in SHIPPED_CONFIGS:
            raise ConfigError(f"unknown model config '{name}'; choose one of {', '.join(SHIPPED_CONFIGS)}")
        text = resources.files("miles_k3.model").joinpath(f"configs/{name}.json").read_text()
        return cls.from_dict(json.loads(text), source=f"miles_k3/model/configs/{name}.json")

    # ---- validation ---------------------------------------------------------------------------------
    def validate(self, source: str) -> None:
        """Check types, ranges and the structural features this implementation supports."""
        _check_types(self, source)
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size", "num_experts",
                    "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
                    "attn_res_block_size", "moe_layer_freq", "max_position_embeddings"]
        for key in positive:
            _require(getattr(self, key) > 0, source, key, "must be > 0")
        _require(self.qk_rope_head_dim >= 0, source, "qk_rope_head_dim", "must be >= 0")
        _require(self.num_shared_experts >= 0, source, "num_shared_experts", "must be >= 0")
        _require(0 <= self.first_k_dense_replace <= self.num_hidden_layers, source, "first_k_dense_replace",
                 "must be in [0, num_hidden_layers]")
        _require(self.num_experts_per_token <= self.num_experts, source, "num_experts_per_token",
                 f"must be <= num_experts ({self.num_experts})")
        _require(self.rms_norm_eps > 0, source, "rms_norm_eps", "must be > 0")
        _require(self.routed_scaling_factor > 0, source, "routed_scaling_factor", "must be > 0")
        _require(self.num_key_value_heads == self.num_attention_heads, source, "num_key_value_heads",
                 "must equal num_attention_heads (MLA has no grouped KV heads)")
        supported = {"hidden_act": "situ", "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
                     "mla_use_nope": True}
        for key, want in supported.items():
            _require(getattr(self, key) == want, source, key, f"only {want!r} is implemented (as in K3)")
        _require(self.num_expert_group == 1 and self.topk_group == 1, source, "num_expert_group",
                 "grouped top-k with more than one group is not implemented; K3 uses 1 group (plain top-k)")
        _require(self.activation_situ_beta > 0, source, "activation_situ_beta", "must be > 0")
        if self.activation_situ_linear_beta is not None:
            _require(self.activation_situ_linear_beta > 0, source, "activation_situ_linear_beta",
                     "must be > 0 or null")
        _validate_linear_attn(self, source)


def _parse_linear_attn(raw: Any, source: str) -> LinearAttnConfig:
    where = f"{source}: linear_attn_config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object")
    values = {}
    for f in dataclasses.fields(LinearAttnConfig):
        if f.name not in raw:
            raise ConfigError(f"{where}: missing key '{f.name}'")
        value = raw[f.name]
        if f.name in ("kda_layers", "full_attn_layers"):
            if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                      for i in value):
                raise ConfigError(f"{where}.{f.name}: expected a list of 1-based layer numbers")
            value = tuple(value)
        values[f.name] = value
    unknown = sorted(set(raw) - set(values))
    if unknown:
        log.warning("%s: keys not used by miles_k3, kept as-is: %s", where, unknown)
    return LinearAttnConfig(**values)


def _validate_linear_attn(cfg: K3Config, source: str) -> None:
    lac = cfg.linear_attn_config
    where = "linear_attn_config"
    for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
        value = getattr(lac, key)
        _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, source,
                 f"{where}.{key}", "must be a positive integer")
    _require(lac.use_full_rank_gate is True, source, f"{where}.use_full_rank_gate",
             "only the full-rank output gate (K3) is implemented")
    _require(isinstance(lac.gate_lower_bound, (int, float)) and not isinstance(lac.gate_lower_bound, bool)
             and -20.0 <= lac.gate_lower_bound < 0, source, f"{where}.gate_lower_bound",
             "must be a number in [-20, 0) (K3: -5.0); the unbounded Kimi-Linear gate is not implemented")
    n = cfg.num_hidden_layers
    for key in ("kda_layers", "full_attn_layers"):
        ids = getattr(lac, key)
        bad = [i for i in ids if not 1 <= i <= n]
        _require(not bad, source, f"{where}.{key}", f"layer numbers are 1-based in [1, {n}]; got {bad}")
        _require(len(set(ids)) == len(ids), source, f"{where}.{key}", "has duplicates")
    both = set(lac.kda_layers) & set(lac.full_attn_layers)
    _require(not both, source, where, f"layers {sorted(both)} are in both kda_layers and full_attn_layers")
    missing = set(range(1, n + 1)) - set(lac.kda_layers) - set(lac.full_attn_layers)
    _require(not missing, source, where, f"layers {sorted(missing)} are in neither kda_layers nor "
             "full_attn_layers; the two lists must partition 1..num_hidden_layers")


def _check_types(cfg: K3Config, source: str) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("extra", "linear_attn_config"):
            continue
        want = f.type if isinstance(f.type, str) else f.type.__name__
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "float | None": value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
        }[want]
        _require(ok, source, f.name, f"expected {want}, got {value!r}")


def _require(ok: bool, source: str, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{source}: '{key}' {message}")
