"""A training run's files without training: its config.yaml (recipes/train.yaml composed and resolved, as
train.py saves it) and an adapter of the shipped base (a fresh LoRA: B = 0, so it answers as the base) where a
checkpoint keeps it, <run_dir>/checkpoints/step_00000001/adapter."""
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from miles_k3.config import RECIPES_MODULE, register_schemas

BASE = "builtin:k3_nano_chain_sum"


def train_yaml(*overrides: str) -> str:
    """A training run's config.yaml: recipes/train.yaml composed with `overrides`, resolved, as train.py saves it."""
    register_schemas()
    with initialize_config_module(config_module=RECIPES_MODULE, version_base=None):
        raw = compose(config_name="train", overrides=list(overrides))
    return OmegaConf.to_yaml(raw, resolve=True)


def save_run(run_dir, config_text: str | None):
    """<run_dir>/checkpoints/step_00000001/adapter (the shipped base's LoRA, B = 0) and its config.yaml."""
    from miles_k3.model.adapter import save_adapter
    from miles_k3.model.build import ModelConfig, build_model
    from miles_k3.model.lora import LoRAConfig

    step = run_dir / "checkpoints" / "step_00000001"
    lora = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj"])
    model = build_model(ModelConfig(name="k3_nano", path=BASE), torch.device("cpu"), torch.float32, lora=lora)
    save_adapter(model, lora, step / "adapter", base_model_name_or_path=BASE)
    if config_text is not None:
        (step / "config.yaml").write_text(config_text)
    (run_dir / "checkpoints" / "latest").write_text(step.name + "\n")
    return step / "adapter"
