"""Every recipe composes and validates; bad overrides fail at once naming the field; the entry points run."""
import os
import subprocess
import sys
from importlib import resources

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from miles_k3.config import ConfigFieldError, EvalRunConfig, TrainConfig, compose_config
from miles_k3.model.build import ModelConfig
from miles_k3.sft_config import SFTConfig

RECIPES = sorted(p.name.removesuffix(".yaml")
                 for p in resources.files("miles_k3.recipes").joinpath("recipe").iterdir()
                 if p.name.endswith(".yaml"))
# entry point -> its config (recipes/<app>.yaml)
APPS = {"train": TrainConfig, "eval": EvalRunConfig, "sft": SFTConfig}


def test_recipes_are_found():
    assert {"quickstart", "aime_grpo", "aime_eval"} <= set(RECIPES)


def recipe_command(recipe: str) -> tuple[str, list[str]]:
    """(the entry point recipe/<recipe>.yaml's first line runs, the overrides it cannot run without)."""
    text = resources.files("miles_k3.recipes").joinpath(f"recipe/{recipe}.yaml").read_text()
    commands = [line for line in text.splitlines() if line.startswith("# python -m miles_k3.")]
    assert commands, f"recipe/{recipe}.yaml must start with the command that runs it"
    words = commands[0].removeprefix("# ").split()
    app = words[2].removeprefix("miles_k3.")
    assert app in APPS, f"recipe/{recipe}.yaml runs miles_k3.{app}, which has no recipes/{app}.yaml"
    assert words[3] == f"recipe={recipe}" or recipe == "quickstart", commands[0]
    return app, [w for w in words[4:] if "=" in w and not w.startswith("[")]


@pytest.fixture
def as_on_one_gpu(monkeypatch):
    """Recipes composed as on the machine they are written for (device=cuda recipes: one GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_starts_with_its_command(recipe, as_on_one_gpu):
    app, required = recipe_command(recipe)
    cfg = compose_config(app, [f"recipe={recipe}", *required])
    assert isinstance(cfg, APPS[app]) and isinstance(cfg.model, ModelConfig)


@pytest.mark.parametrize("overrides, seeds", [
    ([], (0, 0)),
    (["seed=3"], (3, 3)),
    (["seed=3", "rollout.seed=5"], (3, 5)),
    (["rollout.seed=5"], (0, 5)),
    (["recipe=agent_quickstart", "seed=2"], (2, 2)),
    (["recipe=k3_m2_reasoning", "model.path=/ckpt/k3_m2", "seed=2"], (2, 2)),
])
def test_rollout_seed_is_the_run_seed_unless_set(overrides, seeds, as_on_one_gpu):
    """seed=S reseeds the whole run: rollout.seed (prompt order, sampling seeds) follows it unless given itself."""
    cfg = compose_config("train", overrides)
    assert (cfg.seed, cfg.rollout.seed) == seeds


@pytest.mark.parametrize("recipe", [r for r in RECIPES if recipe_command(r)[0] == "train"])
def test_no_train_recipe_pins_rollout_seed(recipe, as_on_one_gpu):
    cfg = compose_config("train", [f"recipe={recipe}", *recipe_command(recipe)[1], "seed=2"])
    assert (cfg.seed, cfg.rollout.seed) == (2, 2)


def test_saved_run_config_holds_the_resolved_rollout_seed():
    """train.py writes OmegaConf.to_yaml(raw, resolve=True) as the run's config.yaml: the number, not ${seed}."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from miles_k3.cli import RECIPES_MODULE
    from miles_k3.config import register_schemas

    register_schemas()
    with initialize_config_module(config_module=RECIPES_MODULE, version_base=None):
        raw = compose(config_name="train", overrides=["seed=3"])
    assert OmegaConf.create(OmegaConf.to_yaml(raw, resolve=True)).rollout.seed == 3


def test_aime_eval_recipe_values():
    cfg = compose_config("eval", ["recipe=aime_eval", "adapter=/runs/x/adapter"])
    assert (cfg.model.path, cfg.adapter, cfg.eval.data.source) == ("moonshotai/Kimi-K3", "/runs/x/adapter",
                                                                    "HuggingFaceH4/aime_2024")
    assert (cfg.eval.samples, cfg.eval.channel, cfg.eval.grader) == (16, "k3", "aime")
    assert cfg.engine.max_context >= cfg.eval.max_new_tokens + 1024
    default = compose_config("eval")  # the shipped quickstart base, not a random init
    assert (default.model.name, default.model.path, default.adapter, default.eval.template) == (
        "k3_nano", "builtin:k3_nano_chain_sum", None, "boxed")
    random = compose_config("eval", ["model=k3_tiny"])  # an architecture without shipped weights: its random init
    assert (random.model.name, random.model.path) == ("k3_tiny", None)
    served = compose_config("eval", ["engine.backend=sglang", "model.hf_path=/ckpt/qwen3"])
    assert (served.model.path, served.model.hf_path) == (None, "/ckpt/qwen3")


def test_default_and_aime_recipe_values():
    default = compose_config("train")
    assert (default.model.name, default.model.path, default.device) == ("k3_nano", "builtin:k3_nano_chain_sum",
                                                                        "cpu")
    assert default.steps > 0 and default.eval.at_start and default.eval.data.split == "test"
    assert default.eval.data.size >= 200 and default.eval.samples == 4  # the held-out avg@4 of the quickstart
    overridden = compose_config("train", ["recipe=aime_grpo", "model.path=/ckpt/k3", "seed=7"])
    assert (overridden.model.name, overridden.model.path, overridden.seed) == ("k3", "/ckpt/k3", 7)
    assert (default.reward.name, default.reward.format_bonus) == ("integer", 0.0)
    rewarded = compose_config("train", ["reward=math", "reward.format_bonus=0.1", "reward.channel=k3"])
    assert (rewarded.reward.name, rewarded.reward.format_bonus, rewarded.reward.channel) == ("math", 0.1, "k3")
    assert compose_config("train", ["sync.readback=true"]).sync.readback is True


def test_aime_grpo_recipe_values_and_required_checkpoint():
    cfg = compose_config("train", ["recipe=aime_grpo", "model.path=/ckpt/kimi-k3"])
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.rollout.group_size) == (32, 64, 8)
    assert {"q_proj", "kv_b_proj", "gate_proj", "down_proj"} <= set(cfg.lora.targets)  # attention + shared MLPs
    assert not {"w1", "w2", "w3"} & set(cfg.lora.targets)  # routed experts stay frozen MXFP4 without adapters
    loss = cfg.trainer.loss
    assert (loss.eps_low, loss.eps_high, loss.aggregation) == (0.2, 0.28, "token_mean")
    assert cfg.trainer.optim.lr == 2e-5 and cfg.trainer.activation_checkpointing
    assert (cfg.data.source, cfg.data.problem_field, cfg.data.answer_field) == (
        "BytedTsinghua-SIA/DAPO-Math-17k", "prompt.0.content", "reward_model.ground_truth")
    assert (cfg.reward.name, cfg.reward.channel, cfg.rollout.template) == ("math", "k3", "chat_plain")
    assert (cfg.eval.data.source, cfg.eval.grader, cfg.eval.channel, cfg.eval.samples) == (
        "HuggingFaceH4/aime_2024", "aime", "k3", 16)
    assert cfg.engine.max_context >= max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens) + 2048
    with pytest.raises(ConfigFieldError, match=r"^model.path: required for model 'k3'"):
        compose_config("train", ["recipe=aime_grpo"])
    with pytest.raises(ConfigFieldError, match=r"^model.path: required for model 'k3'"):
        compose_config("eval", ["model=k3"])
    assert compose_config("model_info", ["model=k3"]).model.path is None  # sizing needs no weights


@pytest.mark.parametrize("override, field", [
    ("model.dtype=fp8", "model.dtype"),
    ("model.kda_backend=cuda_magic", "model.kda_backend"),
    ("model.fp32_dots=bf16x3", "model.fp32_dots"),
    ("trainer.autocast_bf16=auto", "trainer.autocast_bf16"),
    ("model.name=k4", "model.name"),
    ("device=tpu", "device"),
    ("reward.name=vibes", "reward.name"),
    ("reward.format_bonus=-1", "reward.format_bonus"),
    ("reward.channel=telepathy", "reward.channel"),
])
def test_bad_values_fail_naming_the_field(override, field):
    with pytest.raises(ConfigFieldError, match=rf"^{field}: "):
        compose_config("train", [override])


def test_settings_that_would_do_nothing_are_refused():
    sglang = ["engine.backend=sglang", "model.path=null", "model.hf_path=/ckpt/qwen3"]
    assert compose_config("train", sglang).sync.readback is False  # the defaults are fine
    with pytest.raises(ConfigFieldError, match=r"^sync.readback: does nothing with engine.backend=sglang .* "
                                               r"remove the sync: overrides"):
        compose_config("train", [*sglang, "sync.readback=true"])
    with pytest.raises(ConfigFieldError, match=r"^trainer.loss.tis: with trainer.old_logprobs=rollout .* exactly 1"):
        compose_config("train", ["trainer.old_logprobs=rollout", "trainer.loss.tis=token_truncate"])
    assert compose_config("train", ["trainer.old_logprobs=rollout"]).trainer.loss.tis == "none"


def test_engine_backend_is_one_switch_checked_against_the_run():
    """engine.backend (train and eval; sft evaluates natively only): the value, the model it can serve and the
    memory tags train may release are checked with the config, each naming engine.backend."""
    hf = ["model.path=null", "model.hf_path=/ckpt/qwen3"]
    assert compose_config("train", ["engine.backend=sglang", *hf]).engine.backend == "sglang"
    assert compose_config("eval", ["engine.backend=sglang", *hf]).engine.backend == "sglang"
    assert compose_config("train").engine.backend == compose_config("eval").engine.backend == "native"
    for app in ("train", "eval", "sft"):
        with pytest.raises(ConfigFieldError, match=r"^engine.backend: 'vllm' is not one of native, sglang$"):
            compose_config(app, ["engine.backend=vllm"])
    with pytest.raises(ConfigFieldError, match=r"^model.hf_path: an HF architecture is served by SGLang only; set "
                                               r"engine.backend=sglang"):
        compose_config("train", hf)
    with pytest.raises(ConfigFieldError, match=r"^rollout.release_tags: \['weights'\] are not native engine memory "
                                               r"tags \(kv_cache, cuda_graph; engine.backend=native\)$"):
        compose_config("train", ["rollout.release_tags=[weights]"])
    with pytest.raises(ConfigFieldError, match=r"^rollout.release_tags: releasing weights needs "
                                               r"sglang.enable_weights_cpu_backup=true"):
        compose_config("train", ["engine.backend=sglang", *hf, "rollout.release_tags=[weights]"])
    tags = ["engine.backend=sglang", *hf, "rollout.release_tags=[weights]", "sglang.enable_weights_cpu_backup=true"]
    assert compose_config("train", tags).rollout.release_tags == ["weights"]
    with pytest.raises(ConfigFieldError, match=r"^engine.backend: python -m miles_k3.sft evaluates through the "
                                               r"native engine"):
        compose_config("sft", ["engine.backend=sglang"])


def test_unknown_keys_and_bad_types_fail_while_composing():
    with pytest.raises(ConfigCompositionException, match="model.lr"):
        compose_config("train", ["model.lr=1e-3"])
    with pytest.raises((ValidationError, ConfigCompositionException), match="seed"):
        compose_config("train", ["seed=abc"])
    with pytest.raises(ConfigCompositionException, match="recipe"):
        compose_config("train", ["recipe=no_such_recipe"])
    with pytest.raises(ConfigCompositionException, match="reward"):
        compose_config("train", ["reward=no_such_reward"])
    for removed in ("sync.transport=local", "sync.buffer_mb=64", "sync.checksum=false", "sync.timeout_s=30"):
        with pytest.raises(ConfigCompositionException, match=removed.partition("=")[0]):  # the ipc / dist fields
            compose_config("train", [removed])
    with pytest.raises((ConfigKeyError, ConfigCompositionException), match="tp"):
        compose_config("model_info", ["parallel.tp=two"])
    with pytest.raises(ConfigFieldError, match="^parallel.tp: must be an integer >= 1"):
        compose_config("model_info", ["parallel.tp=0"])
    with pytest.raises(ConfigFieldError, match=r"^gpus: 12 is not parallel.dp x parallel.tp = 1 x 8"):
        compose_config("model_info", ["parallel.tp=8", "parallel.dp=1", "gpus=12"])
    with pytest.raises(ConfigFieldError, match="^model.hf_path: model_info sizes K3 configs"):
        compose_config("model_info", ["model.hf_path=/ckpt/qwen3"])


@pytest.mark.slow
def test_train_entry_point_runs_the_embedded_default(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "miles_k3.train", "steps=0", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out  # steps=0: the shipped base and its adapter built, then a dry-run stop
    assert "kda=torch_chunk" in out and "model=builtin:k3_nano_chain_sum: 970,916 parameters, experts mxfp4" in out
    bad = subprocess.run([sys.executable, "-m", "miles_k3.train", "model.dtype=fp8", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert bad.returncode != 0 and "model.dtype" in bad.stderr
    (tmp_path / "p.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n')
    for override, message in ((f"data.source={tmp_path}/missing.jsonl", "data.source: no such file"),
                              (f"resume={tmp_path}/no_ckpt", "resume=")):
        user = subprocess.run([sys.executable, "-m", "miles_k3.train", "steps=1", f"data.source={tmp_path}/p.jsonl",
                               "data.problem_field=null", override,
                               f"run_dir={tmp_path}/run", f"hydra.run.dir={tmp_path}"],
                              capture_output=True, text=True, env=env, timeout=300, check=False)
        assert user.returncode == 1 and "Traceback" not in user.stderr, user.stderr
        assert user.stderr.strip().splitlines()[-1].startswith(f"miles_k3.train: {message}"), user.stderr


def test_model_path_hub_id_fetches_only_config_json(tmp_path, monkeypatch):
    """A hub id goes through huggingface_hub.hf_hub_download(repo, "config.json"); other bad paths fail clearly."""
    import types

    from miles_k3.model.build import load_k3_config
    from miles_k3.model.config import ConfigError, K3Config

    K3Config.from_name("k3_m").save(tmp_path / "config.json")
    calls = []
    fake = types.ModuleType("huggingface_hub")
    fake.hf_hub_download = lambda repo, name: calls.append((repo, name)) or str(tmp_path / name)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    cfg = load_k3_config(ModelConfig(path="moonshotai/Kimi-K3"))
    assert calls == [("moonshotai/Kimi-K3", "config.json")] and cfg.hidden_size == 768
    with pytest.raises(ConfigError, match="not a directory, and not a hub id"):
        load_k3_config(ModelConfig(path=str(tmp_path / "missing" / "dir")))
