"""`ModelConfig` (the `model` section of the run config) and building a `K3ForCausalLM` from it.

The architecture comes from `model.path` (a checkpoint directory, a hub id, or `builtin:<name>` for a base shipped
in the package; its `config.json`) when set, else from the shipped config `model.name`. `build_model` is the one
build of a K3: planned on the meta device for the rank's place in the mesh, then filled with the checkpoint's
slices (a hub id is first fetched into the huggingface_hub cache: config, tokenizer and text weights only) or with
a seeded random init (`weights.py`).
"""
import json
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

import torch

from miles_k3.model.config import SHIPPED_CONFIGS, ConfigError, K3Config
from miles_k3.model.experts import EXPERT_FORMATS, RoutedExperts
from miles_k3.model.k3 import CHECKPOINT_PREFIX, K3ForCausalLM
from miles_k3.model.kda_ops import BACKEND_NAMES
from miles_k3.model.lora import LoRAConfig
from miles_k3.model.weight_files import open_weights
from miles_k3.model.weight_sources import RandomInit, WeightFileReader
from miles_k3.model.weights import build_k3
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.utils.runtime import FP32_DOTS, set_fp32_dots, set_fp32_gemm_reduction

log = logging.getLogger(__name__)

# Fetched from the hub before the weights: config, index, tokenizer and its code (no weights, no images).
HUB_NON_WEIGHT_PATTERNS = ["*.json", "*.py", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass
class ModelConfig:
    name: str = "k3_tiny"
    """Shipped architecture used when `path` is null: k3 (published 2.78T), k3_m (~0.3B), k3_m2 (~0.6B, shapes
    SGLang's K3 kernels accept), k3_tiny (~3.1M), k3_nano (~1.0M, the quickstart's)."""
    path: Optional[str] = None  # noqa: UP045 (OmegaConf 2.3 structured configs need Optional)
    """A checkpoint directory, a hub id (e.g. moonshotai/Kimi-K3) or builtin:<name> (a base shipped in the
    package, e.g. builtin:k3_nano_chain_sum): its config.json defines the architecture and its weights are
    loaded."""
    dtype: str = "auto"
    """Activation/weight dtype: auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32. fp32 tensors stay fp32."""
    kda_backend: str = "auto"
    """KDA math: auto, torch_chunk, naive_recurrent, naive_chunk (CPU references), fla (CUDA kernels) or fla_fp32
    (fla with the chunked form, the trainer's and the engine's prefill, on fp32 inputs: fp32 intermediates, as the
    decode step's state; for the train/rollout log-prob gap, at some speed)."""
    fp32_dots: str = "auto"
    """Precision of the fp32 products inside Triton kernels that keep Triton's default (fla's KDA chunk kernels, the
    trainer's forward and backward and the engine's prefill): auto (Triton's: TF32 on NVIDIA), tf32, tf32x3 (three
    TF32 products, ~fp32 accuracy) or ieee (fp32 FMA; on an H200 host fla's training kernels took over 8 min to
    compile under it, docs/concepts/train-rollout-gap.md). Process-wide (TRITON_F32_DEFAULT), set when the model is built; a
    process that already compiled with another value refuses. On the CPU it changes nothing."""
    experts: str = "auto"
    """Routed-expert storage: auto (as stored in the checkpoint; mxfp4 for a random init), mxfp4 (frozen
    native MXFP4, quantized with the floor rule when the checkpoint is bf16), or bf16 (a dequantized copy, for
    references and benchmarks)."""
    fp32_lm_head: bool = False
    """Logits in fp32: the lm_head's product of the bf16 hidden state and weight is computed in fp32 and kept there,
    in the engine's decode and in the trainer's forward alike (with engine.backend=sglang: SGLang's
    enable_fp32_lm_head). In bf16 a logit near 10 is rounded to a step of 0.06 nats, independently on each side, a
    large part of the train/rollout log-prob gap (docs/concepts/train-rollout-gap.md). Costs one fp32 copy of the lm_head weight
    per forward and fp32 logits (twice bf16's memory). No effect on an fp32 model. K3 only: refused with hf_path."""
    fp32_residual: bool = False
    """Carry the residual stream in fp32 (Megatron's fp32_residual_connection, for K3's Block-AttnRes sources): the
    block sums and the partial sum stay fp32, the depth mixer reads them in fp32, and only each sublayer's RMSNorm'd
    input is rounded to bf16, once; the final hidden state reaches the lm_head unrounded. In the engine's decode and
    the trainer's forward alike: bf16 rounding of the sums, made on each side at slightly different values, is a
    part of the train/rollout log-prob gap (docs/concepts/train-rollout-gap.md). Costs fp32 copies of the residual sources
    (twice bf16's activation memory for them). No effect on an fp32 model. Native engine and K3 only: refused with
    hf_path and with engine.backend=sglang (SGLang's K3 keeps its own bf16 residual)."""
    fp32_gemm_reduction: bool = False
    """bf16 GEMMs on CUDA accumulate in fp32 throughout: cuBLAS may no longer reduce split-K partial sums in bf16
    (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction=False; torch allows it by default). Where it
    would, the result of a GEMM depends on the kernel cuBLAS picks for the shape, which differs between the engine's
    decode (a few rows) and the trainer's forward (many), by up to a bf16 rounding: a part of the train/rollout
    log-prob gap (docs/concepts/train-rollout-gap.md). Process-wide, set when the model is built; where it is already off (a
    model set it, or the caller), a model without the flag is refused. CPU GEMMs do not read it. Native engine only: refused with
    engine.backend=sglang (SGLang's scheduler process keeps torch's default)."""
    trust_remote_code: bool = False
    """Run the tokenizer code shipped in the model directory (the real K3: tokenization_kimi.py)."""
    hf_path: Optional[str] = None  # noqa: UP045
    """A Hugging Face causal-LM checkpoint directory (e.g. Qwen3) loaded with transformers instead of a K3: the
    trainer's base when SGLang serves that architecture (needs engine.backend=sglang)."""

    def validate(self) -> None:
        if self.hf_path is not None and self.path is not None:
            raise ValueError(f"hf_path: set either model.path (a K3 checkpoint) or model.hf_path (an HF "
                             f"architecture), not both (got {self.path!r} and {self.hf_path!r})")
        if self.name not in SHIPPED_CONFIGS:
            raise ValueError(f"name: unknown model '{self.name}'; choose one of {list(SHIPPED_CONFIGS)}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype: '{self.dtype}' is not one of auto, bf16, fp32")
        if self.kda_backend not in BACKEND_NAMES:
            raise ValueError(f"kda_backend: '{self.kda_backend}' is not one of {list(BACKEND_NAMES)}")
        if self.fp32_dots not in FP32_DOTS:
            raise ValueError(f"fp32_dots: '{self.fp32_dots}' is not one of {list(FP32_DOTS)}")
        if self.experts not in ("auto", *EXPERT_FORMATS):
            raise ValueError(f"experts: '{self.experts}' is not one of {['auto', *EXPERT_FORMATS]}")
        for flag in ("fp32_lm_head", "fp32_residual", "fp32_gemm_reduction", "trust_remote_code"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(  # noqa: TRY004 (config errors are ValueErrors, prefixed with the field path)
                    f"{flag}: expected true or false, got {getattr(self, flag)!r}")
        for flag, own in (("fp32_lm_head", "computes its own logits"), ("fp32_residual", "keeps its own residual")):
            if getattr(self, flag) and self.hf_path is not None:
                raise ValueError(f"{flag}: applies to K3 models (the native trainer and engine); with hf_path the "
                                 f"trainer is the transformers model, which {own}: set model.{flag}=false")


BUILTIN_PREFIX = "builtin:"
"""`model.path=builtin:<name>`: a checkpoint shipped inside the package (miles_k3/model/bases/<name>)."""


def builtin_bases() -> list[str]:
    """The names of the checkpoints shipped in the package."""
    root = resources.files("miles_k3.model").joinpath("bases")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.joinpath("config.json").is_file()) \
        if root.is_dir() else []


def _local_dir(cfg: ModelConfig) -> Path:
    """`cfg.path` as a local path: a builtin base's directory in the package, else the path as given."""
    if cfg.path.startswith(BUILTIN_PREFIX):
        name = cfg.path[len(BUILTIN_PREFIX):]
        if name not in builtin_bases():
            raise ConfigError(f"model.path={cfg.path}: no shipped base named {name!r}; shipped: "
                              f"{', '.join(builtin_bases()) or 'none'}")
        return Path(str(resources.files("miles_k3.model").joinpath("bases", name)))
    return Path(cfg.path).expanduser()


def _hub_id(cfg: ModelConfig) -> str:
    """`cfg.path` when it is not a local directory: it must look like a hub id (owner/name)."""
    path = Path(cfg.path).expanduser()
    if path.exists() or cfg.path.count("/") != 1 or cfg.path.startswith((".", "/", "~")):
        raise ConfigError(f"model.path={cfg.path}: not a directory, and not a hub id of the form owner/name")
    return cfg.path


def _hub_module(cfg: ModelConfig):
    """huggingface_hub, imported lazily (GPU hosts and local-only runs need not have it)."""
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(f"model.path={cfg.path} looks like a hub id; install huggingface_hub "
                          "or pass a local checkpoint directory") from None
    return huggingface_hub


def _hub_unavailable(cfg: ModelConfig, err: Exception) -> ConfigError:
    return ConfigError(f"model.path={cfg.path}: the hub id could not be fetched ({type(err).__name__}: "
                       f"{err}); HF_HUB_OFFLINE=1 or no network access is the likely cause: pass a local "
                       "checkpoint directory as model.path")


def load_k3_config(cfg: ModelConfig) -> K3Config:
    """The architecture: `path`'s config.json (a directory, or a hub id: config.json only) or `name`."""
    if cfg.path is None:
        return K3Config.from_name(cfg.name)
    path = _local_dir(cfg)
    if path.is_dir():
        return K3Config.from_json_file(path / "config.json")
    repo = _hub_id(cfg)
    hub = _hub_module(cfg)
    try:
        return K3Config.from_json_file(hub.hf_hub_download(repo, "config.json"))
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise _hub_unavailable(cfg, e) from None


def weights_dir(cfg: ModelConfig) -> Path:
    """The local weights directory of `cfg.path`: the directory itself, or a hub id's snapshot in the
    huggingface_hub cache with config, tokenizer files and the shards that hold text weights (vision shards
    are not fetched)."""
    path = _local_dir(cfg)
    if path.is_dir():
        return path
    repo = _hub_id(cfg)
    hub = _hub_module(cfg)
    try:
        local = Path(hub.snapshot_download(repo, allow_patterns=HUB_NON_WEIGHT_PATTERNS))
        shards = _text_weight_files(local)
        local = Path(hub.snapshot_download(repo, allow_patterns=HUB_NON_WEIGHT_PATTERNS + shards))
    except (OSError, ValueError) as e:
        raise _hub_unavailable(cfg, e) from None
    return local


def _text_weight_files(local: Path) -> list[str]:
    """Weight files of a (partially fetched) snapshot that hold `language_model.` tensors."""
    index = local / "model.safetensors.index.json"
    if not index.is_file():
        return ["model.safetensors"]
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    return sorted({f for n, f in weight_map.items() if n.startswith(CHECKPOINT_PREFIX)})


def num_params(model: K3ForCausalLM) -> int:
    """Logical parameters: every parameter once, plus MXFP4 routed experts counted decoded."""
    dense = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    return dense + sum(m.num_params() for m in model.modules()
                       if isinstance(m, RoutedExperts) and m.expert_format == "mxfp4")


def weight_source(cfg: ModelConfig, seed: int = 0):
    """Where `cfg`'s weights come from: the checkpoint of `path` (validated by its names: `open_weights`) or
    the random init of `seed` (`RandomInit`: experts MXFP4 unless `cfg.experts` is bf16); and the experts' format
    in the model (`cfg.experts`, auto: as stored)."""
    if cfg.path is not None:
        index = open_weights(weights_dir(cfg))
        return WeightFileReader(index), index.expert_format if cfg.experts == "auto" else cfg.experts
    fmt = "mxfp4" if cfg.experts == "auto" else cfg.experts
    return RandomInit(K3Config.from_name(cfg.name), fmt, seed), fmt


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, ctx: ParallelContext = SINGLE,
                lora: LoRAConfig | None = None, seed: int = 0) -> K3ForCausalLM:
    """This rank's K3 of `cfg` on `device` in `dtype` (fp32 tensors kept), frozen, with `lora` attached and its KDA
    backend resolved: planned on the meta device and cut to this rank's shard of `ctx` (`parallelize`), then
    allocated once and filled with this rank's slices of the checkpoint of `path` (only the files that hold them
    are opened), or of the random init of `seed` (the checkpoint init_checkpoint writes for it; the same weights
    on every mesh). The adapter is drawn from `seed` too (`weights.init_adapters`). The one build of train, eval,
    sft and model_info (on the meta device)."""
    set_fp32_dots(cfg.fp32_dots)  # before any kernel of this model compiles
    set_fp32_gemm_reduction(cfg.fp32_gemm_reduction)
    source, fmt = weight_source(cfg, seed)
    model = build_k3(source, fmt, device, dtype, ctx, lora, seed, cfg.kda_backend)
    model.fp32_lm_head = cfg.fp32_lm_head
    model.model.fp32_residual = cfg.fp32_residual
    log.info("model=%s: %s parameters, experts %s", cfg.path or cfg.name, f"{num_params(model):,}",
             model.expert_format)
    return model


def build_tokenizer(cfg: ModelConfig, vocab_size: int | None = None):
    """(tokenizer, stop token ids) of the model `cfg` describes: the checkpoint directory's tokenizer and its
    generation_config eos ids with `path` (or `hf_path`), else the small byte-level tokenizer of `vocab_size`
    ids (shipped configs, random init; None: the shipped config's vocab_size). Needs no model: a caller may
    build it first."""
    from miles_k3.model.tokenizer import load_tokenizer, small_tokenizer, stop_token_ids

    if cfg.hf_path is not None:
        tok = load_tokenizer(cfg.hf_path, trust_remote_code=cfg.trust_remote_code)
        return tok, stop_token_ids(tok, cfg.hf_path)
    if cfg.path is None:
        tok = small_tokenizer(K3Config.from_name(cfg.name).vocab_size if vocab_size is None else vocab_size)
        return tok, stop_token_ids(tok)
    directory = weights_dir(cfg)
    tok = load_tokenizer(directory, trust_remote_code=cfg.trust_remote_code)
    return tok, stop_token_ids(tok, directory)
