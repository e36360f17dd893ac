"""The rollout engine on CUDA: CUDA-graph decode replays exactly the static step it captured, and its
logprobs match the trainer-side full-sequence forward. Run with `python -m pytest -m gpu tests`."""
import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.rollout.engine import EngineConfig, RolloutEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [300], list(range(40, 70))]


@pytest.fixture(scope="module")
def trainer():
    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg, kda_backend="fla", expert_format="mxfp4").cast(torch.bfloat16).eval()
    lora = LoRAConfig(rank=8, alpha=16.0, targets=["q_proj", "o_proj", "kv_b_proj", "w1", "w2", "w3"])
    apply_lora(model, lora)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model, lora


def _engine(model, lora, decode):
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=128, page_size=16,
                                               decode=decode), lora=lora)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), lora)
    return engine


def test_graph_decode_replays_the_static_step_exactly(trainer):
    model, lora = trainer
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5}
    runs = {}
    for decode in ("static", "graph"):
        engine = _engine(model, lora, decode)
        runs[decode] = [engine.generate(input_ids=PROMPTS, sampling_params=params, n=2, lora=name)
                        for name in ("policy", None)]
        assert engine.decode_mode == decode
    assert runs["graph"] == runs["static"]  # same kernels, same inputs: bitwise equal tokens and logprobs


def test_graph_decode_logprobs_match_the_trainer_forward(trainer):
    model, lora = trainer
    engine = _engine(model, lora, "auto")
    assert engine.decode_mode == "graph"
    res = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 1.0, "max_new_tokens": 10,
                                                              "sampling_seed": 1}, lora="policy")
    worst = 0.0
    for prompt, r in zip(PROMPTS, res):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + r["output_ids"]], device="cuda")).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        ref = torch.tensor([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r["output_ids"])])
        got = torch.tensor([lp for lp, _ in r["meta_info"]["output_token_logprobs"]])
        worst = max(worst, (got - ref).abs().max().item())
    print(f"graph decode vs trainer forward, bf16: max |logprob diff| {worst:.2e}")
    assert worst < 5e-2  # bf16 weights and activations, different kernels (absorbed vs naive MLA, chunk vs step)
