"""`model.hf_path` (miles_k3/model/hf.py) on the CPU with the tiny Qwen3 writer: the loaded model is in training
mode, so transformers' activation checkpointing recomputes every decoder layer in backward (same gradients as
without it) and LoRA dropout acts; toggling checkpointing leaves no hooks behind."""
import pytest
import torch

from miles_k3.model.hf import load_hf_model, write_tiny_qwen3
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters

NUM_LAYERS = 2


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny", hidden_size=64, num_layers=NUM_LAYERS)


def _policy(qwen3_dir, dropout=0.0):
    model = load_hf_model(str(qwen3_dir), torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=dropout, targets=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in lora_parameters(model).items():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def test_loaded_model_is_in_training_mode(qwen3_dir):
    model = load_hf_model(str(qwen3_dir), torch.device("cpu"), torch.float32)
    assert all(m.training for m in model.modules())  # from_pretrained alone gives eval mode
    model.eval()
    assert not any(m.training for m in model.modules())


def _layer_calls_and_grads(qwen3_dir, checkpointing: bool, dropout: float):
    """({"forward": n, "backward": n} calls of the decoder layers' MLPs, LoRA gradients) of one forward+backward."""
    model = _policy(qwen3_dir, dropout)
    model.activation_checkpointing = checkpointing
    calls, phase = {"forward": 0, "backward": 0}, ["forward"]
    for layer in model.hf_model.model.layers:  # the MLP runs inside the checkpointed layer forward (forward hooks
        real = layer.mlp.forward                 # do not fire in the recomputation: its forward calls are counted)

        def counted(x, real=real):
            calls[phase[0]] += 1
            return real(x)

        layer.mlp.forward = counted
    ids = torch.randint(1, 250, (2, 10), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)  # the dropout masks
    logits = model(ids, seq_lens=torch.tensor([10, 7])).logits
    phase[0] = "backward"
    logits.log_softmax(-1)[..., 7].sum().backward()
    return calls, {n: p.grad.clone() for n, p in lora_parameters(model).items()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_recomputes_every_layer_with_the_same_gradients(qwen3_dir, dropout):
    plain_calls, plain = _layer_calls_and_grads(qwen3_dir, False, dropout)
    ckpt_calls, ckpt = _layer_calls_and_grads(qwen3_dir, True, dropout)
    assert plain_calls == {"forward": NUM_LAYERS, "backward": 0}  # off: nothing recomputed
    assert ckpt_calls == {"forward": NUM_LAYERS, "backward": NUM_LAYERS}  # on: each layer once more in backward
    assert plain.keys() == ckpt.keys() and all(g.abs().sum() > 0 for g in plain.values())
    for n in plain:  # the recomputation replays the same ops and dropout masks (RNG state restored)
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7, msg=n)


def test_lora_dropout_acts_in_training_mode_only(qwen3_dir):
    model = _policy(qwen3_dir, dropout=0.5)
    ids = torch.randint(1, 250, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.manual_seed(1)
        first = model(ids).logits
        torch.manual_seed(2)
        second = model(ids).logits
        model.eval()
        torch.manual_seed(1)
        eval_first = model(ids).logits
        torch.manual_seed(2)
        eval_second = model(ids).logits
    assert not torch.allclose(first, second)  # other dropout masks, other logits
    assert torch.equal(eval_first, eval_second)


def test_toggling_checkpointing_leaves_no_hooks(qwen3_dir):
    model = _policy(qwen3_dir)
    embeddings = model.hf_model.get_input_embeddings()
    before = len(embeddings._forward_hooks)
    for _ in range(3):  # what the step does around each micro-batch's forward
        model.activation_checkpointing = True
        model.activation_checkpointing = False
    assert len(embeddings._forward_hooks) == before
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
