"""`ModelConfig` (the `model` section of the run config) and building a `K3ForCausalLM` from it.

The architecture comes from `model.path` (a checkpoint directory or a hub id; its `config.json`) when set, else
from the shipped config `model.name`. `build_model` initialises the weights randomly; it does not read a
checkpoint's tensors.
"""
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from miles_k3.model.config import SHIPPED_CONFIGS, ConfigError, K3Config
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.kda_ops import BACKEND_NAMES

log = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    name: str = "k3_tiny"
    """Shipped architecture used when `path` is null: k3 (published 2.78T), k3_m (~0.3B), k3_tiny (~3.1M)."""
    path: Optional[str] = None  # noqa: UP045 (OmegaConf 2.3 structured configs need Optional)
    """A checkpoint directory or a hub id (e.g. moonshotai/Kimi-K3); its config.json defines the architecture."""
    dtype: str = "auto"
    """Activation/weight dtype: auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32. fp32 tensors stay fp32."""
    kda_backend: str = "auto"
    """KDA math: auto, torch_chunk, naive_recurrent, naive_chunk (CPU references) or fla (CUDA kernels)."""

    def validate(self) -> None:
        if self.name not in SHIPPED_CONFIGS:
            raise ValueError(f"name: unknown model '{self.name}'; choose one of {list(SHIPPED_CONFIGS)}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype: '{self.dtype}' is not one of auto, bf16, fp32")
        if self.kda_backend not in BACKEND_NAMES:
            raise ValueError(f"kda_backend: '{self.kda_backend}' is not one of {list(BACKEND_NAMES)}")


def load_k3_config(cfg: ModelConfig) -> K3Config:
    """The architecture: `path`'s config.json (directory, or hub id fetched with huggingface_hub) or `name`."""
    if cfg.path is None:
        return K3Config.from_name(cfg.name)
    path = Path(cfg.path).expanduser()
    if path.is_dir():
        return K3Config.from_json_file(path / "config.json")
    if path.exists() or cfg.path.count("/") != 1 or cfg.path.startswith((".", "/", "~")):
        raise ConfigError(f"model.path={cfg.path}: not a directory, and not a hub id of the form owner/name")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ConfigError(f"model.path={cfg.path} looks like a hub id; install huggingface_hub "
                          "(pip install 'miles-k3[hub]') or pass a local checkpoint directory") from None
    return K3Config.from_json_file(hf_hub_download(cfg.path, "config.json"))


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> K3ForCausalLM:
    """A randomly initialised K3 on `device` in `dtype` (fp32 tensors kept), with its KDA backend resolved."""
    k3 = load_k3_config(cfg)
    with torch.device(device):
        model = K3ForCausalLM(k3, kda_backend=cfg.kda_backend).cast(dtype)
    if device.type != "meta":
        model.kda_backend(device)  # resolve and log the backend choice now, not at the first forward
    log.info("model=%s: %s parameters", cfg.path or cfg.name, f"{sum(p.numel() for p in model.parameters()):,}")
    return model
