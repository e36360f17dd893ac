"""`python -m miles_k3.eval [recipe=aime_eval] [model.path=...] [adapter=DIR] [eval.samples=16] ...`: evaluate a
model (and optionally a PEFT LoRA adapter directory) on a dataset through the rollout engine (Hydra app); with
`engine.backend=sglang model.hf_path=DIR` through SGLang (any architecture it serves).

It composes `recipes/eval.yaml`, validates every field, builds the model, its tokenizer and the engine, loads
the adapter into the engine, runs `miles_k3.evals.harness.evaluate` and writes `results.jsonl` and `summary.json`
into `run_dir` (default `runs/eval-<time>`, beside Hydra's record), logs `eval/*` metrics and a table of
completions to the tracker (`tracking.logger=wandb`), and prints the summary as JSON.

A model is evaluated as it was trained: `eval.template`, `eval.grader` and `eval.data` that the command line
(overrides and recipe) leaves unset come from the config it was trained with (`trained_config`): an adapter's
run (the `config.yaml` beside the adapter directory: a training checkpoint's `step_N/`, an sft run's directory),
else the recipe that made the shipped base (`SHIPPED_RECIPES`). A PEFT adapter from elsewhere, or another base,
keeps the defaults. One INFO line says what was taken from where.

Under torchrun (`torchrun --nproc-per-node N -m miles_k3.eval parallel.tp=... parallel.ep=...`) every rank builds
its shard of the model as training does (`build_model` with the rank's place in the mesh: planned on the meta
device, only the rank's slices of the checkpoint read, one line per rank on rank 0) and its slice of the adapter,
and serves it from its own engine; each DP replica generates its share of the problems, and rank 0 grades, writes
the reports and prints the summary (docs/concepts/scale-out.md).
"""
import json
import logging
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from miles_k3.cli import hydra_app
from miles_k3.config import (
    RECIPES_MODULE,
    ConfigFieldError,
    exit_on_user_error,
    register_schemas,
    to_typed,
    typed_or_exit,
)
from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.graders import grader_names
from miles_k3.evals.harness import evaluate, log_eval, write_reports
from miles_k3.evals.tasks import is_task
from miles_k3.evals.worked import is_worked
from miles_k3.launch import silence_fla_cpu_warning
from miles_k3.model.adapter import CONFIG_FILE, load_adapter, read_adapter_config
from miles_k3.model.build import build_model, build_tokenizer
from miles_k3.model.kernel_config import apply_kernels
from miles_k3.model.lora import lora_state_dict
from miles_k3.model.ranks import end_ranks, start_ranks
from miles_k3.parallel.mesh import SINGLE, ParallelContext, naming_rank
from miles_k3.parallel.reduce import broadcast, world_of
from miles_k3.rollout.api import capabilities
from miles_k3.rollout.factory import POLICY, build_engine
from miles_k3.utils.runtime import resolve_device, resolve_dtype
from miles_k3.utils.tracking import Tracker

log = logging.getLogger("miles_k3.eval")
register_schemas()


def warn_random_weights(model) -> None:
    """A model without model.path or model.hf_path is its architecture's random init: its scores are noise."""
    if model.path is None and model.hf_path is None:
        log.warning("random weights: model.path and model.hf_path are unset, so model=%s is evaluated from its "
                    "random init and its scores mean nothing; set model.path=DIR (a checkpoint directory, a hub "
                    "id, or builtin:k3_nano_chain_sum, the shipped quickstart base)", model.name)


RUN_CONFIG = "config.yaml"
"""A training run's composed config, beside the adapter it saved (`checkpoints/step_N/config.yaml`; an sft run's
`run_dir/config.yaml`)."""
SHIPPED_RECIPES = {"builtin:k3_nano_chain_sum": "chain_sum_base", "builtin:k3_nano_guess": "guess_base"}
"""The recipe that made each shipped base (`python -m miles_k3.sft recipe=NAME`): what it was trained with."""
TRAINED_FIELDS = ("template", "grader", "data")
"""The eval fields a model brings from its training config when the command line leaves them unset."""
ADAPTER_HINT = ("give a PEFT adapter directory (it holds adapter_config.json), e.g. a training run's "
                "<run_dir>/checkpoints/step_N/adapter, or no adapter for the base alone")


def check_adapter(path: str | None) -> None:
    """`adapter=PATH` names a PEFT adapter directory; else ConfigFieldError naming the path and the fix, before
    any model is built (the directory's files are checked when it loads)."""
    if path is None:
        return
    where = Path(path)
    if not where.exists():
        raise ConfigFieldError(f"adapter: {path} does not exist; {ADAPTER_HINT}")
    if not (where / CONFIG_FILE).is_file():
        inside = [d for d in (where / "adapter", _latest_adapter(where)) if d and (d / CONFIG_FILE).is_file()]
        fix = f"did you mean adapter={inside[0]}?" if inside else ADAPTER_HINT
        raise ConfigFieldError(f"adapter: {path} holds no {CONFIG_FILE}, so it is not an adapter directory; {fix}")


def _latest_adapter(run_dir: Path) -> Path | None:
    """The adapter of a run directory's newest complete checkpoint (checkpoints/latest), if it has one."""
    latest = run_dir / "checkpoints" / "latest"
    return run_dir / "checkpoints" / latest.read_text().strip() / "adapter" if latest.is_file() else None


def trained_config(adapter: str | None, model_path: str | None) -> tuple[DictConfig, str] | None:
    """(the config a model was trained with, where it was found): with an adapter, its run's `config.yaml` beside
    the adapter directory (None: an adapter from elsewhere); without one, the recipe that made a shipped base
    (None: any other base)."""
    if adapter is not None:
        file = Path(adapter).parent / RUN_CONFIG
        if not file.is_file():
            return None
        try:
            run = OmegaConf.load(file)
        except Exception as e:  # noqa: BLE001 (YAML and OmegaConf errors alike: the file is the user's)
            raise ConfigFieldError(f"adapter: {file} (its run's config) is unreadable: {type(e).__name__}: {e}; "
                                   "set eval.template, eval.grader and eval.data yourself, or move the file") from None
        return run, f"the adapter's run config {file}"
    recipe = SHIPPED_RECIPES.get(model_path)
    if recipe is None:
        return None
    text = (resources.files(RECIPES_MODULE) / "recipe" / f"{recipe}.yaml").read_text(encoding="utf-8")
    return OmegaConf.create(text), f"recipe={recipe} (the recipe that made {model_path})"


def prompt_template(run: DictConfig) -> tuple[str, str] | None:
    """(the prompt template a single-turn run trained with, its key): rollout.template (train) or template (sft);
    None for multi-turn runs (env=guess|tools|agent render their own turns)."""
    if OmegaConf.select(run, "env.name", default="single") != "single":
        return None
    for key in ("rollout.template", "template"):
        if OmegaConf.select(run, key) is not None:
            return OmegaConf.select(run, key), key
    return None


def trained_settings(run: DictConfig) -> dict[str, tuple[Any, str]]:
    """{eval field: (value, the run's key it comes from)} for TRAINED_FIELDS: a run that evaluated
    (eval.every_n_steps > 0) was scored by its eval section; otherwise its prompt template, its reward as the
    grader (when a grader has its name) and, for a generated task, the task's held-out split. A multi-turn run
    gives nothing."""
    template = prompt_template(run)
    if template is None:
        return {}
    section = run.get("eval")
    if section is not None and (section.get("every_n_steps") or 0) > 0:
        return {name: (section[name], f"eval.{name}") for name in TRAINED_FIELDS if name in section}
    found: dict[str, tuple[Any, str]] = {"template": template}
    if OmegaConf.select(run, "reward.name") in grader_names():
        found["grader"] = (run.reward.name, "reward.name")
    source = OmegaConf.select(run, "data.source")
    if is_task(source) or is_worked(source):
        found["data"] = (OmegaConf.merge(run.data, {"split": "test"}), "data, split test")
    return found


def explicit_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys a command line sets: each override's key, and with `recipe=NAME` every key the recipe's
    file sets."""
    keys: set[str] = set()
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        keys.add(override.key_or_group)
        if override.key_or_group == "recipe" and isinstance(override.value(), str):
            text = (resources.files(RECIPES_MODULE) / "recipe" / f"{override.value()}.yaml").read_text("utf-8")
            keys |= _dotted_keys(OmegaConf.to_container(OmegaConf.create(text)))
    return keys


def _dotted_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        if key == "defaults" and not prefix:
            continue
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= _dotted_keys(value, f"{prefix}{key}.")
    return keys


def _is_set(field: str, explicit: set[str]) -> bool:
    """`field` (dotted) is set by the command line: named, or one of its parents or children named."""
    return any(k == field or k.startswith(field + ".") or field.startswith(k + ".") for k in explicit)


def adopt_trained_settings(raw: DictConfig, overrides: Sequence[str]) -> None:
    """Fill raw's `eval.template`, `eval.grader` and `eval.data` that `overrides` (and their recipe) leave unset
    from the config the model was trained with (`trained_config`), and log one line saying what came from where.
    eval.data is taken whole unless eval.data.source is set; other eval.data.* overrides apply on top of it."""
    check_adapter(raw.adapter)
    found = trained_config(raw.adapter, raw.model.path)
    if found is None:
        return
    run, where = found
    explicit = explicit_keys(overrides)
    taken = []
    for name, (value, key) in trained_settings(run).items():
        if name == "data":
            if _is_set("eval.data.source", explicit):
                continue
            _replace_data(raw, value, explicit, where)
            taken.append(f"eval.data.source={value.source} split={value.split} (its {key})")
        elif not _is_set(f"eval.{name}", explicit):
            OmegaConf.update(raw, f"eval.{name}", value)
            taken.append(f"eval.{name}={value} (its {key})")
    if taken:
        log.info("evaluated as trained, from %s: %s; an override of any of them wins", where, ", ".join(taken))


def _replace_data(raw: DictConfig, data: DictConfig, explicit: set[str], where: str) -> None:
    keep = {k: OmegaConf.select(raw, k) for k in explicit if k.startswith("eval.data.")}
    try:
        raw.eval.data = OmegaConf.merge(OmegaConf.structured(DatasetConfig), data)
    except Exception as e:  # noqa: BLE001 (OmegaConf's validation errors: a config of another version)
        raise ConfigFieldError(f"eval.data: {where} has a data section this version cannot read ({e}); give "
                               "eval.data.source=... (and its fields) yourself") from None
    for key, value in keep.items():
        OmegaConf.update(raw, key, value, force_add=True)


def compose_eval(overrides: Sequence[str] = ()) -> Any:
    """The EvalRunConfig `python -m miles_k3.eval OVERRIDES` runs: recipes/eval.yaml composed with the overrides,
    the model's trained settings adopted where they leave them (`adopt_trained_settings`), every field validated."""
    register_schemas()
    with initialize_config_module(config_module=RECIPES_MODULE, version_base=None):
        raw = compose(config_name="eval", overrides=list(overrides))
    adopt_trained_settings(raw, overrides)
    return to_typed(raw)


def eval_engine(cfg, ctx: ParallelContext = SINGLE, device: torch.device | None = None):
    """(engine, tokenizer, adapter name or None) for an EvalRunConfig. Native: this rank's shard of the model (`ctx`:
    its place in the mesh, SINGLE for one process) is built here on `device` (None: cfg.device resolved) with the
    adapter's LoRA, the adapter directory loaded into it (the rank's slice of each tensor) and served by the rank's
    engine; sglang: SGLang serves the checkpoint directory, and the adapter directory
    (checked by `read_adapter`; no model is built in this process) is pushed as sglang.push resolves for its targets:
    as a LoRA adapter, its PEFT tensors as they are, or merged (a K3 adapter SGLang's K3 LoRA cannot serve):
    W0 + s * B @ A from the checkpoint's own W0, written once before the first request."""
    check_adapter(cfg.adapter)
    if not capabilities(cfg.engine.backend).in_process_model:
        from miles_k3.model.adapter import read_adapter
        from miles_k3.weight_sync.sglang import merged_from_checkpoint

        lora_cfg, tensors = read_adapter(cfg.adapter) if cfg.adapter else (None, None)
        tokenizer, stop_ids = build_tokenizer(cfg.model)  # a checkpoint directory's own tokenizer
        engine = build_engine(cfg, None, tokenizer, stop_ids, lora=lora_cfg, adapter=tensors,
                              merge=lambda t: merged_from_checkpoint(cfg.model.path, lora_cfg, t))
        return engine, tokenizer, None if lora_cfg is None else POLICY
    model, lora_cfg = eval_model(cfg, ctx, device)
    tokenizer, stop_ids = build_tokenizer(cfg.model, model.config.vocab_size)
    engine = build_engine(cfg, model, tokenizer, stop_ids, lora=lora_cfg, ctx=ctx,
                          adapter=None if lora_cfg is None else lora_state_dict(model))
    return engine, tokenizer, None if lora_cfg is None else POLICY


def eval_model(cfg, ctx: ParallelContext = SINGLE, device: torch.device | None = None):
    """(this rank's K3 of an EvalRunConfig with `cfg.adapter` loaded, the adapter's LoRAConfig or None): built as
    training builds it (`build_model`: for `ctx`, only the rank's slices of the checkpoint read) on `device` (None:
    cfg.device resolved), with the adapter's LoRA planned and cut with its base, then the rank's slice of each
    adapter tensor loaded (`load_adapter`)."""
    device = device or resolve_device(cfg.device)
    apply_kernels(cfg.kernels, device)
    lora_cfg = read_adapter_config(Path(cfg.adapter)) if cfg.adapter else None
    model = build_model(cfg.model, device, resolve_dtype(cfg.model.dtype, device), ctx, lora_cfg, cfg.seed)
    if lora_cfg is not None:
        load_adapter(model, cfg.adapter)
    return model, lora_cfg


def run(cfg) -> dict | None:
    """The whole evaluation of an EvalRunConfig; returns the summary (with the output paths). Under torchrun every
    rank calls it: each builds its shard and generates its replica's share, rank 0 grades, writes and returns the
    summary, the others return None (the process group stays up: `end_ranks` at the command's end)."""
    torch.manual_seed(cfg.seed)
    check_adapter(cfg.adapter)
    warn_random_weights(cfg.model)
    problems = load_problems(cfg.eval.data)  # a bad dataset fails before the model is built
    in_process = capabilities(cfg.engine.backend).in_process_model  # sglang: no model here, one process (validated)
    ctx, device = start_ranks(cfg.model, cfg.parallel, cfg.device) if in_process else (SINGLE, None)
    with naming_rank(ctx):
        engine, tokenizer, lora = eval_engine(cfg, ctx, device)
        run_dir = Path(broadcast(cfg.run_dir or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}", world_of(ctx)))
        try:
            result = evaluate(engine, tokenizer, problems, cfg.eval, lora=lora, ctx=ctx)
        finally:
            engine.close()  # SGLang's scheduler subprocesses end with the run
    if not ctx.is_main:
        return None
    extra = {"model": cfg.model.hf_path or cfg.model.path or cfg.model.name, "adapter": cfg.adapter,
             "data": cfg.eval.data.source, "backend": cfg.engine.backend, "results": str(run_dir / "results.jsonl")}
    write_reports(result, run_dir, extra)
    with Tracker(cfg.tracking, run_dir, config={"eval": str(cfg.eval), "model": extra["model"]}) as tracker:
        log_eval(tracker, result, cfg.eval.table_rows)
    return {**result.summary, **extra, "summary": str(run_dir / "summary.json")}


@hydra_app("miles_k3.eval", "eval")
def main(raw: DictConfig) -> None:
    silence_fla_cpu_warning()
    with exit_on_user_error("miles_k3.eval"):
        adopt_trained_settings(raw, HydraConfig.get().overrides.task)
    cfg = typed_or_exit(raw, "miles_k3.eval")
    with exit_on_user_error("miles_k3.eval"):
        summary = run(cfg)
    end_ranks()
    if summary is not None:  # rank 0's (under torchrun the others generated their share)
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
