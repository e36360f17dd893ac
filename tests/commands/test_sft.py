"""`python -m miles_k3.sft` on k3_tiny (CPU): full-parameter SFT learns a tiny addition table, its saved
checkpoint loads back with the trained model's logits, evaluation through the rollout engine sees the trained
weights; lora mode changes only the adapter and writes a loadable PEFT directory; two runs write the same
bytes; bad configs fail naming the field.

Every test runs torch on one thread: the machine's 2 cores are shared, and two contended threads make a
k3_tiny step many times slower (a run's bytes are reproducible for a given thread count either way).
"""
import copy
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from miles_k3.config import ConfigFieldError, compose_config
from miles_k3.model.build import ModelConfig, build_model, build_tokenizer
from miles_k3.model.lora import lora_state_dict
from miles_k3.model.weight_files import stored_dtype
from miles_k3.sft import train_sft

TABLE = {"2+3=": "5", "4+4=": "8", "1+6=": "7", "3+0=": "3"}  # prompt (plain template) -> answer


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data(tmp_path) -> str:
    path = tmp_path / "add.jsonl"
    path.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in TABLE.items()))
    return str(path)


def _cfg(tmp_path, out: str, *extra: str):
    return compose_config("sft", [f"data.source={_data(tmp_path)}", f"run_dir={tmp_path / out}",
                                  "device=cpu", "batch_size=4", "log_every=5", "optim.lr=3e-3", *extra])


EVAL = ("eval.max_new_tokens=4", "engine.max_context=32", "engine.memory_budget_bytes=2097152")


@pytest.mark.slow
def test_full_sft_learns_saves_a_loadable_checkpoint_and_eval_sees_the_trained_weights(tmp_path):
    steps = 20
    cfg = _cfg(tmp_path, "full", f"steps={steps}", f"eval.every_n_steps={steps}", "eval.at_start=true",
               f"eval.data.source={_data(tmp_path)}", *EVAL)
    result = train_sft(cfg)

    # The loss falls clearly (step 1 is the random init's ~ln(512) per token), and it is logged.
    assert len(result.losses) == steps and result.losses[0] > 4.0
    assert result.final_loss < 0.25 * result.losses[0], result.losses
    rows = [json.loads(x) for x in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20]
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s"} <= set(train_rows[0])

    # Evaluation (greedy) through the engine built before training, which shares the model's tensors: before
    # the first update (eval.at_start) no answer is right, after the last every one is: it sees the trained
    # weights.
    assert sorted(result.evals) == [0, steps]
    assert result.evals[0]["eval/avg@1"] == 0.0 and result.evals[steps]["eval/avg@1"] == 1.0
    assert result.engine.weight_version == steps
    assert "eval avg@1 0.0000 -> 1.0000" in result.summary_line()

    # The checkpoint directory (with its tokenizer) loads back; its logits equal the trained model's once the
    # trained weights are rounded to their stored dtypes (bf16, fp32 families kept): the same numbers, so
    # exactly equal.
    raw = json.loads((result.saved / "config.json").read_text())  # the published nested form SGLang serves
    assert (raw["architectures"], raw["model_type"], raw["dtype"]) == (["KimiK3ForConditionalGeneration"],
                                                                       "kimi_k3", "bfloat16")
    text = raw["text_config"]
    assert text["model_type"] == "kimi_linear" and text["hidden_size"] == result.model.config.hidden_size
    assert "quantization_config" not in raw and "quantization_config" not in text  # bf16 experts
    saved = ModelConfig(path=str(result.saved))
    loaded = build_model(saved, torch.device("cpu"), torch.float32)
    assert loaded.expert_format == "bf16"
    tok, stop = build_tokenizer(saved, loaded.config.vocab_size)
    assert stop == build_tokenizer(ModelConfig(), loaded.config.vocab_size)[1]  # the same eos as trained with
    assert tok.get_vocab() == result.tokenizer.get_vocab()
    rounded = copy.deepcopy(result.model)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            stored = torch.float32 if stored_dtype(name, p.dtype) == "F32" else torch.bfloat16
            p.copy_(p.to(stored).to(p.dtype))
    ids = torch.tensor([tok.encode("2+3=5 1+6=7", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, rounded(ids).logits)
        # bf16 storage changes the logits only slightly (mean |diff| 0.006 seen, a few up to 0.35): the loaded
        # model is the trained one, and it predicts the same token at every position.
        got, trained = loaded(ids).logits, result.model(ids).logits
        assert (got - trained).abs().mean() < 0.02
        assert torch.equal(got.argmax(-1), trained.argmax(-1))


def test_lora_sft_changes_only_the_adapter_and_writes_a_loadable_peft_directory(tmp_path, monkeypatch):
    from miles_k3 import sft
    from miles_k3.model.adapter import load_adapter

    seen = {}

    def spy(*args, **kwargs):  # the base as built (the adapter attached by build_model is not base)
        model = build_model(*args, **kwargs)
        seen["base"] = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
        return model
    monkeypatch.setattr(sft, "build_model", spy)
    cfg = _cfg(tmp_path, "lora", "mode=lora", "steps=3", "lora.rank=4", "optim.lr=1e-2",
               "eval.every_n_steps=3", f"eval.data.source={_data(tmp_path)}", *EVAL)
    result = train_sft(cfg)

    assert result.model.expert_format == "mxfp4"  # lora mode keeps the frozen MXFP4 base
    after = result.model.state_dict()
    base_names = [n for n in after if "lora_" not in n]
    assert sorted(base_names) == sorted(seen["base"])
    assert all(torch.equal(after[n], seen["base"][n]) for n in base_names)  # the base bytes did not change
    adapter = lora_state_dict(result.model)
    assert any(n.endswith("lora_B.weight") and t.abs().sum() > 0 for n, t in adapter.items())  # B starts at 0
    # The adapter evaluated was the trained one (pushed into the engine before the eval).
    pushed = result.engine.adapters.buffers("policy")
    assert all(torch.equal(pushed[n], t) for n, t in adapter.items()) and result.engine.weight_version == 3
    assert "eval/avg@1" in result.eval_metrics

    assert result.saved == tmp_path / "lora/adapter" and not (tmp_path / "lora/model").exists()
    fresh = build_model(ModelConfig(), torch.device("cpu"), torch.float32)
    lora_cfg = load_adapter(fresh, result.saved)
    assert (lora_cfg.rank, sorted(lora_cfg.targets)) == (4, sorted(cfg.lora.targets))
    loaded = lora_state_dict(fresh)
    assert loaded.keys() == adapter.keys() and all(torch.equal(loaded[n], t) for n, t in adapter.items())


def test_two_identical_runs_write_identical_bytes(tmp_path):
    def run(out: str) -> dict[str, str]:
        result = train_sft(_cfg(tmp_path, out, "steps=2", "optim.weight_decay=0.1"))
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(result.saved.iterdir())}

    first, second = run("a"), run("b")
    assert "model.safetensors" in first and first == second


@pytest.mark.parametrize("override, field", [
    ("mode=bogus", "mode"),
    ("steps=0", "steps"),
    ("batch_size=0", "batch_size"),
    ("template=no_such_template", "template"),
    ("model.experts=mxfp4", "model.experts"),
    ("optim.lr=0", "optim.lr"),
    ("model.hf_path=/ckpt/qwen3", "model.hf_path"),  # sft builds K3 models: an ignored hf_path would train a K3
])
def test_bad_values_fail_naming_the_field(override, field):
    with pytest.raises(ConfigFieldError, match=rf"^{field}: "):
        compose_config("sft", [override])


def test_mxfp4_experts_are_fine_for_an_adapter():
    assert compose_config("sft", ["mode=lora", "model.experts=mxfp4"]).model.experts == "mxfp4"


def test_existing_result_is_refused_before_any_work(tmp_path):
    (tmp_path / "run/model").mkdir(parents=True)
    with pytest.raises(ConfigFieldError, match=r"^run_dir: .*run/model already exists"):
        train_sft(_cfg(tmp_path, "run", "steps=1"))


def test_entry_point_user_error_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "miles_k3.sft", f"data.source={tmp_path}/missing.jsonl",
                           f"run_dir={tmp_path}/run", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("miles_k3.sft: data.source: no such file"), proc.stderr


@pytest.mark.slow
def test_entry_point_in_a_fresh_directory_writes_one_tree(tmp_path):
    """Run in a fresh working directory: everything, Hydra's record included, lands in the default run_dir
    (no ./outputs), the config it saves names that directory, and fla's CPU warning is not printed."""
    _data(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "miles_k3.sft", "data.source=add.jsonl", "model=k3_tiny",
                           "device=cpu", "steps=1", "batch_size=4", "eval.every_n_steps=1",
                           "eval.data.source=add.jsonl", *EVAL], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Triton is not supported" not in proc.stderr and "{'mem/" not in proc.stdout
    assert not (tmp_path / "outputs").exists()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("sft-")
    for name in (".hydra/config.yaml", "sft.log", "config.yaml", "metrics.jsonl", "model/config.json"):
        assert (run_dir / name).exists(), name
    assert f"run_dir: runs/{run_dir.name}\n" in (run_dir / "config.yaml").read_text()
