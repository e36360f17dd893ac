"""`python -m miles_k3.eval [recipe=aime_eval] [model.path=...] [adapter=DIR] [eval.samples=16] ...`: evaluate a
model (and optionally a PEFT LoRA adapter directory) on a dataset through the rollout engine (Hydra app); with
`engine.backend=sglang model.hf_path=DIR` through SGLang (any architecture it serves).

It composes `recipes/eval.yaml`, validates every field, builds the model, its tokenizer and the engine, loads
the adapter into the engine, runs `miles_k3.evals.harness.evaluate` and writes `results.jsonl` and `summary.json`
into `run_dir` (default `runs/eval-<time>`, beside Hydra's record), logs `eval/*` metrics and a table of
completions to the tracker (`tracking.logger=wandb`), and prints the summary as JSON.
"""
import json
import logging
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from miles_k3.adapter import load_adapter
from miles_k3.config import exit_on_user_error, register_schemas, typed_or_exit
from miles_k3.evals.datasets import load_problems
from miles_k3.evals.harness import evaluate, log_eval, write_reports
from miles_k3.launch import silence_fla_cpu_warning
from miles_k3.model.build import build_model, build_tokenizer
from miles_k3.model.kernel_config import apply_kernels
from miles_k3.model.lora import lora_state_dict
from miles_k3.rollout.factory import POLICY, build_engine
from miles_k3.runtime import resolve_device, resolve_dtype
from miles_k3.tracking import Tracker

log = logging.getLogger("miles_k3.eval")
register_schemas()


def warn_random_weights(model) -> None:
    """A model without model.path or model.hf_path is its architecture's random init: its scores are noise."""
    if model.path is None and model.hf_path is None:
        log.warning("random weights: model.path and model.hf_path are unset, so model=%s is evaluated from its "
                    "random init and its scores mean nothing; set model.path=DIR (a checkpoint directory, a hub "
                    "id, or builtin:k3_nano_chain_sum, the shipped quickstart base)", model.name)


def eval_engine(cfg):
    """(engine, tokenizer, adapter name or None) for an EvalRunConfig. Native: the model is built here and the
    adapter directory applied to it; sglang: SGLang serves the checkpoint directory, and the adapter directory
    (checked by `read_adapter`; no model is built in this process) is pushed as sglang.push resolves for its targets:
    as a LoRA adapter, its PEFT tensors as they are, or merged (a K3 adapter SGLang's K3 LoRA cannot serve):
    W0 + s * B @ A from the checkpoint's own W0, written once before the first request."""
    if cfg.engine.backend == "sglang":
        from miles_k3.adapter import read_adapter
        from miles_k3.weight_sync.sglang import merged_from_checkpoint

        lora_cfg, tensors = read_adapter(cfg.adapter) if cfg.adapter else (None, None)
        tokenizer, stop_ids = build_tokenizer(cfg.model)  # a checkpoint directory's own tokenizer
        engine = build_engine(cfg, None, tokenizer, stop_ids, lora=lora_cfg, adapter=tensors,
                              merge=lambda t: merged_from_checkpoint(cfg.model.path, lora_cfg, t))
        return engine, tokenizer, None if lora_cfg is None else POLICY
    device = resolve_device(cfg.device)
    apply_kernels(cfg.kernels, device)
    model = build_model(cfg.model, device, resolve_dtype(cfg.model.dtype, device))
    tokenizer, stop_ids = build_tokenizer(cfg.model, model.config.vocab_size)
    lora_cfg = load_adapter(model, cfg.adapter) if cfg.adapter else None
    engine = build_engine(cfg, model, tokenizer, stop_ids, lora=lora_cfg,
                          adapter=None if lora_cfg is None else lora_state_dict(model))
    return engine, tokenizer, None if lora_cfg is None else POLICY


def run(cfg) -> dict:
    """The whole evaluation of an EvalRunConfig; returns the summary (with the output paths)."""
    torch.manual_seed(cfg.seed)
    warn_random_weights(cfg.model)
    problems = load_problems(cfg.eval.data)  # a bad dataset fails before the model is built
    engine, tokenizer, lora = eval_engine(cfg)
    run_dir = Path(cfg.run_dir or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        result = evaluate(engine, tokenizer, problems, cfg.eval, lora=lora)
    finally:
        engine.close()  # SGLang's scheduler subprocesses end with the run
    extra = {"model": cfg.model.hf_path or cfg.model.path or cfg.model.name, "adapter": cfg.adapter,
             "data": cfg.eval.data.source, "backend": cfg.engine.backend, "results": str(run_dir / "results.jsonl")}
    write_reports(result, run_dir, extra)
    with Tracker(cfg.tracking, run_dir, config={"eval": str(cfg.eval), "model": extra["model"]}) as tracker:
        log_eval(tracker, result, cfg.eval.table_rows)
    return {**result.summary, **extra, "summary": str(run_dir / "summary.json")}


@hydra.main(version_base=None, config_path="pkg://miles_k3.recipes", config_name="eval")
def main(raw: DictConfig) -> None:
    silence_fla_cpu_warning()
    cfg = typed_or_exit(raw, "miles_k3.eval")
    with exit_on_user_error("miles_k3.eval"):
        summary = run(cfg)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
