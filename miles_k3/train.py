"""`python -m miles_k3.train [recipe=aime_grpo] [overrides]`: the RL training entry point (Hydra app).

It composes `recipes/train.yaml`, validates every field, and then composes the components. Today it builds
the frozen base, attaches the LoRA adapters and stops: the rollout engine, trainer, weight sync and eval land
in their own issues, and this file grows into the loop of ARCHITECTURE.md (rollout -> reward -> advantages ->
train -> sync -> eval -> log).
"""
import logging
import random

import hydra
import numpy as np
import torch
from omegaconf import DictConfig

from miles_k3.config import ConfigFieldError, register_schemas, to_typed
from miles_k3.model.build import build_model
from miles_k3.model.lora import adapter_num_params, apply_lora
from miles_k3.runtime import resolve_device, resolve_dtype

log = logging.getLogger("miles_k3.train")
register_schemas()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@hydra.main(version_base=None, config_path="pkg://miles_k3.recipes", config_name="train")
def main(raw: DictConfig) -> None:
    try:
        cfg = to_typed(raw)
    except ConfigFieldError as e:
        raise SystemExit(f"miles_k3.train: invalid config: {e}") from None
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    model = build_model(cfg.model, device, resolve_dtype(cfg.model.dtype, device))
    apply_lora(model, cfg.lora)
    log.info("LoRA rank %d on %s: %s trainable params (the base is frozen)", cfg.lora.rank,
             ",".join(cfg.lora.targets), f"{adapter_num_params(model):,}")
    log.warning("stopping after building the model: the RL loop (engine, trainer, weight sync, eval) is not "
                "implemented yet in this version of miles_k3")


if __name__ == "__main__":
    main()
