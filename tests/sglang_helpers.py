"""What the SGLang backend's CPU tests share: the HF test policy's LoRA, the policy, its PEFT tensors, an
`SGLangEngine` over the recorded-interface double (`tests/sglang_double.py`), the trainer's probe log-probs (with
and without the adapter), LoRA B set to noise, and a greedy continuation by full forwards."""
import functools

import torch
from lora_helpers import hf_policy

from miles_k3.model.lora import LoRAConfig, lora_parameters
from miles_k3.rollout.sglang_backend import SGLangConfig, SGLangEngine
from tests.sglang_double import FakeSGLangEngine

LORA = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"])


def policy(qwen3_dir, seed=0):
    return hf_policy(qwen3_dir, LORA, seed=seed)


def peft_of(model):
    from miles_k3.model.adapter import peft_tensors

    return {n: t.detach() for n, t in peft_tensors(model).items()}


def double_engine(model=None, cfg=None, **kw):
    factory = functools.partial(FakeSGLangEngine, model=model, **kw)
    return SGLangEngine(cfg or SGLangConfig(), "/ckpt/tiny", lora=LORA, seed=7, stop_token_ids=[257],
                        engine_cls=factory)


def trainer_logprobs(trainer, ids, adapter=True):
    from miles_k3.model.lora import adapters_disabled
    from miles_k3.trainer.step import sequence_logprobs

    if adapter:
        return sequence_logprobs(trainer, ids)
    with adapters_disabled(trainer):
        return sequence_logprobs(trainer, ids)


def set_lora_b(trainer, std, seed=3):
    """LoRA B of `trainer` set to N(0, std) (0: zeros): the adapter's effect, an optimizer step's worth."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(lora_parameters(trainer).items()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def greedy(model, ids, max_new, stop):
    """The model's greedy continuation of ids (full forwards), at most max_new tokens, ending at stop."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new):
            tok = int(model(torch.tensor([seq]), seq_lens=torch.tensor([len(seq)])).logits[0, -1].argmax())
            seq.append(tok)
            if tok == stop:
                break
    return seq[len(ids):]
