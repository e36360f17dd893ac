"""`python -m miles_k3.init_checkpoint model=k3_tiny out=DIR [seed=0] [format=bf16|mxfp4] [overwrite=false]`:
write a randomly initialised checkpoint directory of any K3 config: the random init a run draws without a
model.path (`weights.RandomInit`: the K3 init rule, `k3.init_rule`; each stored tensor drawn in blocks of rows
from generators seeded by (seed, name, block); MXFP4 experts quantized from their draw with the floor rule), so
`build_model` of the config with that seed and the checkpoint written here hold the same weights, bit for bit.
Nothing needs the whole model in memory: tensors are drawn one at a time (a routed expert's six tensors
together) and written one shard per decoder layer, then one for the embedding, head and final norms, like the
published layout. Small configs (vocab_size <= 65536) also get the project's byte-level tokenizer
(`miles_k3.model.tokenizer`), and its bos/eos/pad ids in config.json (as K3's config.json carries its own).

`hollow=true` writes the published 96-file layout of the config instead, with real safetensors headers and
index and the payload left a hole in sparse files (`miles_k3.model.hollow`): the real K3's 1.56 TB takes ~0.1 GB
of disk, enough for `python -m miles_k3.model_info model.path=DIR ...` to plan every rank's reads.
"""
from __future__ import annotations

import itertools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore

from miles_k3.config import compose_cli
from miles_k3.model.build import ModelConfig, load_k3_config
from miles_k3.model.config import K3Config
from miles_k3.model.experts import EXPERT_FORMATS
from miles_k3.model.hollow import write_hollow_checkpoint
from miles_k3.model.tokenizer import BOS, END_OF_MSG, PAD, save_small_tokenizer, special_token_ids
from miles_k3.model.weight_files import CONFIG_FILE, config_json, layer_of
from miles_k3.model.weight_sources import RandomInit
from miles_k3.model.weight_writer import WeightWriter, write_groups

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
  hollow=false                    headers only, payload a hole (sparse files, the published layout; format=mxfp4)

Example:  python -m miles_k3.init_checkpoint model=k3_tiny out=/tmp/k3_tiny_init format=mxfp4
(the real K3's read plan: model=k3 out=/tmp/k3_hollow format=mxfp4 hollow=true, then python -m miles_k3.model_info
model.path=/tmp/k3_hollow parallel.tp=8 parallel.ep=64 gpus=64)
"""
SMALL_VOCAB = 65536  # configs up to this vocabulary get the small byte-level tokenizer


@dataclass
class InitCheckpointConfig:
    """`python -m miles_k3.init_checkpoint`: a random-init checkpoint directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture (model=k3|k3_m|k3_m2|k3_nano|k3_tiny, or model.path=DIR for a config.json)."""
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
    hollow: bool = False
    """Write headers and index only, the payload a hole (sparse files in the published layout): for planning the
    reads of a model too large to hold (model=k3). Needs format=mxfp4 (the published storage)."""

    def validate(self) -> None:
        if not self.out:
            raise ValueError("out: required; pass out=DIR (the checkpoint directory to write)")
        if self.format not in EXPERT_FORMATS:
            raise ValueError(f"format: '{self.format}' is not one of {', '.join(EXPERT_FORMATS)}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        if self.max_shard_bytes is not None and self.max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes: must be > 0 or null, got {self.max_shard_bytes}")
        if self.hollow and (self.format != "mxfp4" or self.max_shard_bytes is not None):
            raise ValueError("hollow: writes the published layout (MXFP4 experts, one file per layer); set "
                             "format=mxfp4 and leave max_shard_bytes null")


def register_schema() -> None:
    ConfigStore.instance().store(name="init_checkpoint_schema", node=InitCheckpointConfig)


def init_checkpoint(cfg: K3Config, out: str | Path, seed: int = 0, expert_format: str = "bf16",
                    overwrite: bool = False, max_shard_bytes: int | None = None) -> Path:
    """Write the random init of (`cfg`, `expert_format`, `seed`) to `out` (see the module docstring); returns
    `out`. Its tensors are `weights.RandomInit`'s, so `build_model` without a path (same seed and format) holds
    exactly these weights."""
    source = RandomInit(cfg, expert_format, seed)
    with WeightWriter(out, overwrite=overwrite, max_shard_bytes=max_shard_bytes) as writer:
        token_ids = None
        if cfg.vocab_size <= SMALL_VOCAB:
            save_small_tokenizer(writer.staging, cfg.vocab_size)
            ids = special_token_ids()  # like K3's config.json: bos [BOS], eos <|end_of_msg|>, pad [PAD]
            token_ids = {"bos_token_id": ids[BOS], "eos_token_id": ids[END_OF_MSG], "pad_token_id": ids[PAD]}
        writer.write_json(CONFIG_FILE, config_json(cfg, expert_format, token_ids))
        # one shard per decoder layer, then one for the model-level tensors (layer None)
        for layer, groups in itertools.groupby(write_groups(source.specs), key=lambda g: layer_of(g[0])):
            for group in groups:
                writer.add({name: source.read(name, (slice(None),)) for name in group})
            writer.flush()
            if layer is not None:
                log.info("layer %d/%d written", layer + 1, cfg.num_hidden_layers)
    log.info("wrote %s (seed %d, experts %s)", out, seed, expert_format)
    return Path(out)


def main(argv: list[str]) -> Path:
    """Write the checkpoint of `argv`'s config (key=value overrides of recipes/init_checkpoint.yaml; --help:
    USAGE); returns its directory."""
    register_schema()
    cfg = compose_cli("init_checkpoint", argv, "miles_k3.init_checkpoint", USAGE)
    try:
        if cfg.hollow:
            return write_hollow_checkpoint(load_k3_config(cfg.model), cfg.out, overwrite=cfg.overwrite)
        return init_checkpoint(load_k3_config(cfg.model), cfg.out, cfg.seed, cfg.format, cfg.overwrite,
                               cfg.max_shard_bytes)
    except ValueError as e:  # WeightsError, ConfigError: the message names the problem and the fix
        raise SystemExit(f"miles_k3.init_checkpoint: {e}") from None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(main(sys.argv[1:]))
