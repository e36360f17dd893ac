"""`python -m miles_k3.init_checkpoint model=k3_tiny out=DIR [seed=0] [format=bf16|mxfp4] [overwrite=false]`:
write a randomly initialised checkpoint directory of any K3 config. The weights follow
`K3ForCausalLM.reset_parameters` (linears and experts N(0, 0.02), norms 1, A_log = log U(1, 16), zero AttnRes
queries and biases; MXFP4 experts drawn per expert and quantized with the floor rule). Nothing needs the whole
model in memory: the model is laid out on the meta device, then each decoder layer is materialised alone on
the CPU (its routed experts one expert at a time), written and freed; the embedding, head and final norms come
last, like the published shard layout (shard i = layer i-1, then the globals). Each part draws from its own
generator seeded from (seed, part), so a seed reproduces the directory byte for byte. Small configs
(vocab_size <= 65536) also get the project's byte-level tokenizer (`miles_k3.tokenizer`), and its
bos/eos/pad ids in config.json (as K3's config.json carries its own).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from hydra.core.config_store import ConfigStore
from torch import nn

from miles_k3.config import compose_cli
from miles_k3.model.build import ModelConfig, load_k3_config
from miles_k3.model.checkpoint import (
    CONFIG_FILE,
    checkpoint_config,
    expected_tensors,
    meta_model,
)
from miles_k3.model.checkpoint_writer import CheckpointWriter, to_stored
from miles_k3.model.config import K3Config
from miles_k3.model.experts import EXPERT_FORMATS, PROJS, RoutedExperts
from miles_k3.model.k3 import CHECKPOINT_PREFIX, K3DecoderLayer, K3ForCausalLM
from miles_k3.tokenizer import BOS, END_OF_MSG, PAD, save_small_tokenizer, special_token_ids

log = logging.getLogger("miles_k3.init_checkpoint")

USAGE = """
python -m miles_k3.init_checkpoint [model=NAME | model.path=DIR] out=DIR [seed=N] [format=bf16|mxfp4]
Write a randomly initialised checkpoint directory (HF layout: config.json, one safetensors shard per decoder
layer, then the embedding, head and norms) of any K3 config, one layer in memory at a time; a seed gives the
same bytes every time. Configs with vocab_size <= 65536 also get the byte-level tokenizer.

Fields (InitCheckpointConfig in miles_k3/init_checkpoint.py):
  model=k3|k3_m|k3_m2|k3_nano|k3_tiny   the architecture (default k3_tiny)
  model.path=DIR|HUB_ID           a checkpoint's config.json instead
  out=DIR                         the directory to write (required), written atomically
  seed=0                          seed of the initialisation
  format=bf16|mxfp4               routed-expert storage (mxfp4: native, as published)
  overwrite=false                 replace out if it exists (once the new directory is complete)
  max_shard_bytes=null            split a layer's shard above this size (null: one shard per layer)

Example:  python -m miles_k3.init_checkpoint model=k3_tiny out=/tmp/k3_tiny_init format=mxfp4
"""
SMALL_VOCAB = 65536  # configs up to this vocabulary get the small byte-level tokenizer
_PART_STRIDE = 1 << 20  # seed * stride + part: distinct streams for up to 2^20 parts per seed


@dataclass
class InitCheckpointConfig:
    """`python -m miles_k3.init_checkpoint`: a random-init checkpoint directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture (model=k3_tiny|k3_m|k3, or model.path=DIR for a config.json)."""
    out: Optional[str] = None  # noqa: UP045 (OmegaConf 2.3 structured configs need Optional)
    """Output directory (required); written atomically."""
    seed: int = 0
    """Seed of the initialisation: the same seed gives the same bytes."""
    format: str = "bf16"
    """Routed-expert storage: bf16, or mxfp4 (native, as published; floor scale rule)."""
    overwrite: bool = False
    """Replace `out` if it exists (only once the new directory is complete)."""
    max_shard_bytes: Optional[int] = None  # noqa: UP045
    """Split a layer's shard above this size; null: one shard per layer (memory: one layer as stored)."""

    def validate(self) -> None:
        if not self.out:
            raise ValueError("out: required; pass out=DIR (the checkpoint directory to write)")
        if self.format not in EXPERT_FORMATS:
            raise ValueError(f"format: '{self.format}' is not one of {', '.join(EXPERT_FORMATS)}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        if self.max_shard_bytes is not None and self.max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes: must be > 0 or null, got {self.max_shard_bytes}")


def register_schema() -> None:
    ConfigStore.instance().store(name="init_checkpoint_schema", node=InitCheckpointConfig)


def init_checkpoint(cfg: K3Config, out: str | Path, seed: int = 0, expert_format: str = "bf16",
                    overwrite: bool = False, max_shard_bytes: int | None = None) -> Path:
    """Write a random-init checkpoint of `cfg` to `out` (see the module docstring); returns `out`."""
    specs = expected_tensors(cfg, expert_format)
    skeleton = meta_model(cfg, expert_format)
    with CheckpointWriter(out, overwrite=overwrite, max_shard_bytes=max_shard_bytes) as writer:
        token_ids = None
        if cfg.vocab_size <= SMALL_VOCAB:
            save_small_tokenizer(writer.staging, cfg.vocab_size)
            ids = special_token_ids()  # like K3's config.json: bos [BOS], eos <|end_of_msg|>, pad [PAD]
            token_ids = {"bos_token_id": ids[BOS], "eos_token_id": ids[END_OF_MSG], "pad_token_id": ids[PAD]}
        writer.write_json(CONFIG_FILE, checkpoint_config(cfg, expert_format, token_ids))
        layers = list(skeleton.model.layers)
        for i, layer in enumerate(layers):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * _PART_STRIDE + i + 1)
                _write_layer(writer, layer, specs)
            writer.flush()
            log.info("layer %d/%d written", i + 1, len(layers))
        skeleton.model.layers = nn.ModuleList()  # the rest: embedding, head, final norms
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * _PART_STRIDE)
            skeleton.to_empty(device="cpu")
            skeleton.reset_parameters()
            _write_module(writer, skeleton, "", specs)
        del skeleton
    log.info("wrote %s (seed %d, experts %s)", out, seed, expert_format)
    return Path(out)


def _write_module(writer: CheckpointWriter, module: nn.Module, prefix: str, specs: dict) -> None:
    """Add every state-dict tensor of a materialised module, named `language_model.` + prefix + key."""
    for key, t in module.state_dict().items():
        name = CHECKPOINT_PREFIX + prefix + key
        if name in specs:  # a tied LM head is stored once
            writer.add({name: to_stored(name, t, specs[name])})


def _write_layer(writer: CheckpointWriter, layer: K3DecoderLayer, specs: dict) -> None:
    """Materialise one decoder layer on the CPU without its routed experts, init and write it; then the
    experts one at a time (each a one-expert `RoutedExperts`, initialised by its own `reset_parameters`)."""
    prefix = f"model.layers.{layer.layer_id}."
    experts = layer.block_sparse_moe.experts if layer.is_moe else None
    if experts is not None:
        layer.block_sparse_moe.experts = nn.Module()  # keep the experts on meta
    layer.to_empty(device="cpu")
    K3ForCausalLM.reset_parameters(layer)  # the model's init rule, applied to this layer's parameters
    _write_module(writer, layer, prefix, specs)
    if experts is None:
        return
    base = f"{CHECKPOINT_PREFIX}{prefix}block_sparse_moe.experts."
    for e in range(experts.num_experts):
        one = RoutedExperts(1, experts.latent, experts.inter, experts.beta, experts.linear_beta,
                            experts.expert_format)
        one.reset_parameters()
        group = {}
        for key, t in one.state_dict().items():
            assert key.startswith("0.") and key.split(".")[1] in PROJS, key
            name = base + str(e) + key[1:]
            group[name] = to_stored(name, t, specs[name])
        writer.add(group)
    layer.to_empty(device="meta")


def main(argv: list[str]) -> Path:
    """Write the checkpoint of `argv`'s config (key=value overrides of recipes/init_checkpoint.yaml; --help:
    USAGE); returns its directory."""
    register_schema()
    cfg = compose_cli("init_checkpoint", argv, "miles_k3.init_checkpoint", USAGE)
    try:
        return init_checkpoint(load_k3_config(cfg.model), cfg.out, cfg.seed, cfg.format, cfg.overwrite,
                               cfg.max_shard_bytes)
    except ValueError as e:  # CheckpointError, ConfigError: the message names the problem and the fix
        raise SystemExit(f"miles_k3.init_checkpoint: {e}") from None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(main(sys.argv[1:]))
