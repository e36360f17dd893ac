"""`model.hf_path`: a Hugging Face causal LM as the trainer's frozen base, for `engine.backend=sglang`.

SGLang serves many architectures (Qwen3 and the other HF causal LMs it implements); with `model.hf_path` the trainer
loads the same checkpoint with `transformers` and the same LoRA modules as K3's (`miles_k3.model.lora.apply_lora`:
q/k/v/o_proj, gate/up/down_proj by name), so trainer and engine run one architecture and the GRPO loop, rewards,
evals, checkpoints (PEFT adapters) and tracking are unchanged. `HFCausalLM` registers the HF model's own children, so
module paths, parameter names and PEFT keys (`base_model.model.<HF path>.lora_A.weight`) are the HF ones that SGLang
and PEFT load.

`write_tiny_qwen3(directory)` writes the project's own tiny random Qwen3-architecture checkpoint (bf16 safetensors,
config, the small byte-level tokenizer) for tests and demos: nothing is downloaded.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from miles_k3.model.config import ConfigError

log = logging.getLogger("miles_k3.model")


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the trainer's model interface: `model(input_ids_BT, seq_lens=...)` returns an
    object with `.logits` [B, T, V] (rows right-padded: positions >= seq_lens[b] are masked out of attention)."""

    peft_prefix = "base_model.model."

    def __init__(self, hf: nn.Module):
        super().__init__()
        for name, child in hf.named_children():
            self.add_module(name, child)  # the HF paths are this module's paths (no extra prefix)
        self._hf = (hf,)  # the HF model object, not registered twice
        self.config = hf.config
        self._checkpointing = False

    @property
    def hf_model(self) -> nn.Module:
        return self._hf[0]

    @property
    def activation_checkpointing(self) -> bool:
        """transformers' own checkpointing of every decoder layer (non-reentrant). It acts only in training mode
        with gradients enabled (K3's needs gradients only), hence `load_hf_model` returns training mode."""
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        if on == self._checkpointing:
            return
        if on:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf_model.gradient_checkpointing_disable()
            self._remove_input_grad_hook()
        self._checkpointing = on

    def _remove_input_grad_hook(self) -> None:
        # transformers 5 registers an input-embedding hook at every enable and keeps it at disable (non-PEFT
        # models): without this, the step's per-micro-batch toggle adds one hook per micro-batch. transformers 4
        # registers none for a non-PEFT model, and its disable_input_require_grads then has no hook to remove.
        try:
            self.hf_model.disable_input_require_grads()
        except AttributeError:
            pass

    def forward(self, input_ids_BT: torch.Tensor, seq_lens: torch.Tensor | None = None):
        mask = None
        if seq_lens is not None:
            positions = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device)
            mask = (positions[None, :] < seq_lens[:, None].to(input_ids_BT.device)).long()
        return self.hf_model(input_ids=input_ids_BT, attention_mask=mask, use_cache=False)


def load_hf_model(path: str, device: torch.device, dtype: torch.dtype) -> HFCausalLM:
    """The checkpoint directory `path` as a frozen HFCausalLM on `device` in `dtype` (safetensors weights only), in
    training mode like a freshly built K3 model: transformers checkpoints activations only in training mode, and
    LoRA dropout acts only there. Forwards without gradients switch to eval mode themselves (the trainer's step)."""
    from transformers import AutoModelForCausalLM

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"model.hf_path: {path} is not a checkpoint directory (no config.json); point it at a "
                          "directory written by save_pretrained (config.json + *.safetensors)")
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, use_safetensors=True,
                                                  local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.hf_path: transformers cannot load {path}: {e}") from None
    hf.to(device)
    hf.requires_grad_(False)
    hf.train()  # from_pretrained returns eval mode; the trainer's model trains (see above)
    model = HFCausalLM(hf)
    log.info("model=%s (%s): %s parameters", path, type(hf).__name__, f"{sum(p.numel() for p in hf.parameters()):,}")
    return model


def write_tiny_qwen3(directory: str | Path, seed: int = 0, hidden_size: int = 128, num_layers: int = 2,
                     vocab_size: int = 512) -> Path:
    """A tiny random Qwen3ForCausalLM checkpoint (bf16 safetensors) with the small byte-level tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles_k3.model.tokenizer import BOS, EOS, PAD, save_small_tokenizer, special_token_ids

    directory = Path(directory)
    ids = special_token_ids()
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden_size // 2, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], dtype="bfloat16")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(directory), safe_serialization=True)
    save_small_tokenizer(directory, vocab_size)  # also generation_config.json: stop at <|end_of_msg|> and [EOS]
    return directory
