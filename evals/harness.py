"""The eval harness: problems -> prompts -> the rollout engine (n samples each) -> graded -> metrics and reports.

`evaluate(engine, tokenizer, problems, cfg)` renders every problem with a named template, generates
`cfg.samples` completions per problem through the engine's public `generate` (so an adapter the trainer pushed
is what gets scored), grades them in a `GradingPool` (worker processes with timeouts: the same graders as the
training reward), and returns an `EvalResult`: per-sample records and the `metrics.summarize` summary (avg@n,
unbiased pass@k, maj@k with standard errors, truncation rate, mean response length). `write_reports` writes
`results.jsonl` (one row per sample: id, sample, response, extracted answer, score, reason, ...) and
`summary.json`; `log_eval` sends `eval/*` metrics and a table of sampled completions to a tracker.
`EvalHook` runs all of it every N training steps (`eval.every_n_steps`).

Samples are reproducible: problem i's sample j uses sampling seed `cfg.seed + i * cfg.samples + j`, whatever
the batching.

Data parallel (`ctx`, a run on many ranks): each DP replica generates every dp_size-th problem (problem i on
replica i % dp_size, with problem i's seeds), in the same number of engine calls on every replica (an engine in
lockstep needs them all), and rank 0 gathers the outputs, grades them and returns the result (None on the other
ranks): the eval of one process over the same problems, dp_size times faster.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles_k3.evals.datasets import DatasetConfig
from miles_k3.evals.graders import MAX_RESPONSE_CHARS, Grade, grader_names
from miles_k3.evals.grading_pool import GradingPool
from miles_k3.evals.metrics import SampleOutcome, summarize
from miles_k3.evals.problems import Problem
from miles_k3.evals.sampling import eval_seed, sampling_params
from miles_k3.evals.templates import render_prompt, response_text, template_names
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import gather

log = logging.getLogger("miles_k3.evals")


@dataclass
class EvalConfig:
    """What to evaluate and how to sample and grade it."""

    data: DatasetConfig = field(default_factory=DatasetConfig)
    """The problems (a hub id such as HuggingFaceH4/aime_2024, or a local jsonl/json/parquet file)."""
    template: str = "boxed"
    """Prompt template: boxed (step by step, answer in \\boxed{}), plain, chat (the tokenizer's chat template)."""
    samples: int = 16
    """Completions per problem (n): avg@n, pass@k and maj@k for k <= n."""
    ks: list[int] | None = None
    """The k of pass@k / maj@k; None: powers of two below n, and n."""
    max_new_tokens: int = 1024
    """Generation cap per completion (a completion that reaches it counts as truncated)."""
    temperature: float = 0.6
    """Sampling temperature (0 = greedy)."""
    top_p: float = 0.95
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    seed: int = 0
    """Problem i's sample j uses sampling seed seed + i * samples + j."""
    grader: str = "aime"
    """aime (integer answer 0..999) or math (math-verify), or a registered grader."""
    channel: str = "auto"
    """The part of a response graded: auto, none (all), k3 (after <|open|>response<|sep|>), think (after </think>)."""
    timeout_s: float = 5.0
    """Grading time limit per response (a response over it scores 0, reason 'timeout')."""
    grading_workers: int = 1
    """Grading worker processes."""
    max_chars: int = MAX_RESPONSE_CHARS
    """A longer response is graded on its last max_chars characters."""
    batch_problems: int = 32
    """Problems per engine.generate call (each with `samples` completions)."""
    every_n_steps: int = 0
    """During training: evaluate every N optimizer steps (0 = never; also at the end when > 0)."""
    at_start: bool = False
    """During training (with every_n_steps > 0): also evaluate before the first update (step 0), for a
    before -> after comparison."""
    table_rows: int = 32
    """Sampled completions logged as a table (W&B and tables/eval_samples.jsonl)."""

    def validate(self) -> None:
        for name in ("samples", "max_new_tokens", "batch_problems", "grading_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("every_n_steps", "table_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.template not in template_names():
            raise ValueError(f"template: '{self.template}' is not one of {', '.join(template_names())}")
        if self.grader not in grader_names():
            raise ValueError(f"grader: '{self.grader}' is not one of {', '.join(grader_names())}")
        if self.ks is not None and not all(1 <= k <= self.samples for k in self.ks):
            raise ValueError(f"ks: every k must be in 1..samples ({self.samples}), got {self.ks}")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.timeout_s > 0 and self.max_chars > 0):
            raise ValueError(f"temperature/top_p/timeout_s/max_chars: need temperature >= 0, 0 < top_p <= 1, "
                             f"timeout_s > 0, max_chars > 0; got {self.temperature}, {self.top_p}, "
                             f"{self.timeout_s}, {self.max_chars}")


@dataclass
class GradedSample:
    """One graded completion (a row of results.jsonl)."""

    id: str
    sample: int
    prompt: str
    response: str
    extracted: str | None
    normalized: str | None
    gold: str
    score: float
    reason: str
    finish_reason: str
    num_tokens: int
    weight_version: int | None


@dataclass
class EvalResult:
    records: list[GradedSample]
    summary: dict[str, Any]

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """The summary's numbers as namespaced metrics (e.g. eval/avg@16, eval/pass@4_se)."""
        return {prefix + k: v for k, v in self.summary.items() if isinstance(v, (int, float))}


def evaluate(engine, tokenizer, problems: list[Problem], cfg: EvalConfig, lora: str | None = None,
             progress: bool = True, ctx: ParallelContext = SINGLE) -> EvalResult | None:
    """Generate cfg.samples completions per problem with adapter `lora` (None: the base) and grade them. On many
    ranks (`ctx`) the replicas share the problems out and rank 0 alone grades and returns (None elsewhere)."""
    if not problems:
        raise ValueError("evaluate: no problems to evaluate")
    t0 = time.perf_counter()
    prompts = [render_prompt(cfg.template, p.problem, tokenizer) for p in problems]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in prompts]
    check_prompt_lengths(problems, ids, "eval.max_new_tokens", cfg.max_new_tokens, engine.max_context,
                         "engine.max_context (SGLang: sglang.context_length, up to the model's)")
    outputs = _generate(engine, ids, cfg, lora, progress and ctx.is_main, ctx)
    if not ctx.is_main:
        return None
    responses = [response_text(tokenizer, o) for o in outputs]
    golds = [p.answer for p in problems for _ in range(cfg.samples)]
    with GradingPool(cfg.grader, timeout_s=cfg.timeout_s, workers=cfg.grading_workers, channel=cfg.channel,
                     max_chars=cfg.max_chars) as pool:
        grades = pool.grade(responses, golds)
    records = [_record(problems[i // cfg.samples], i % cfg.samples, prompts[i // cfg.samples], r, g, o)
               for i, (r, g, o) in enumerate(zip(responses, grades, outputs))]
    summary = summarize(outcomes_by_problem(records), ks=cfg.ks)
    summary.update(seconds=time.perf_counter() - t0, grader=cfg.grader, template=cfg.template,
                   temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)
    return EvalResult(records, summary)


class PromptLengthError(ValueError):
    """A problem's prompt plus its generation budget does not fit the engine's context (a user error: the message
    names the problem, its prompt's length and the settings to change)."""


def prompt_ids(problems: list[Problem], template: str, tokenizer) -> list[list[int]]:
    """Each problem's prompt as the rollouts and the harness tokenize it: the template's text, no special tokens
    added."""
    return [tokenizer.encode(render_prompt(template, p.problem, tokenizer), add_special_tokens=False)
            for p in problems]


def check_prompt_lengths(problems: list[Problem], ids: list[list[int]], budget_field: str, max_new_tokens: int,
                         max_context: int, raise_hint: str, what: str = "problem") -> None:
    """Every prompt (`ids`, one per problem) plus `max_new_tokens` (the field `budget_field`) fits in `max_context`
    tokens; else PromptLengthError naming the first problem that does not, its length, `raise_hint` (the field
    that raises the context) and `budget_field`."""
    for p, prompt in zip(problems, ids):
        if len(prompt) + max_new_tokens > max_context:
            raise PromptLengthError(f"{what} {p.id}: its prompt is {len(prompt)} tokens, and with "
                                    f"{budget_field}={max_new_tokens} that exceeds the engine's "
                                    f"max_context={max_context}; raise {raise_hint} or lower {budget_field}")


def _generate(engine, prompt_ids: list[list[int]], cfg: EvalConfig, lora: str | None, progress: bool,
              ctx: ParallelContext = SINGLE) -> list[dict] | None:
    """One engine.generate call per eval.batch_problems problems (the engine batches within a call; smaller
    calls would cost throughput), the progress bar counting samples as each call returns and redrawn every
    REDRAW_S seconds meanwhile, so its clock shows a long call is running. Data parallel: this replica's problems
    (i % dp_size == dp_rank) in as many calls as the largest share needs (the last ones possibly empty); every
    output in problem order on rank 0 (None on the others)."""
    from tqdm.auto import tqdm

    mine = list(range(ctx.dp_rank, len(prompt_ids), ctx.dp_size))
    largest = -(-len(prompt_ids) // ctx.dp_size)  # problems of the largest share (ceil)
    calls = -(-largest // cfg.batch_problems)
    outputs: list[dict] = []
    bar = tqdm(total=len(mine) * cfg.samples, desc="eval samples", unit="sample", disable=not progress)
    with bar, _redrawn(bar, REDRAW_S):
        for k in range(calls):
            batch = mine[k * cfg.batch_problems:(k + 1) * cfg.batch_problems]
            params = [sampling_params(cfg, eval_seed(cfg.seed, i, cfg.samples)) for i in batch]
            bar.set_postfix_str(f"generating batch {k + 1}/{calls} ({len(batch) * cfg.samples} samples)")
            got = engine.generate(input_ids=[prompt_ids[i] for i in batch], sampling_params=params, n=cfg.samples,
                                  return_logprob=False, lora=lora)
            bad = next((o for o in got if "error" in o), None)
            if bad is not None:
                raise RuntimeError(f"eval: the engine rejected a request: {bad['error']}")
            outputs.extend(got)
            bar.update(len(got))
    if ctx.dp_size == 1:
        return outputs if ctx.is_main else None
    shares = gather(outputs, ctx.dp_group)  # replica r's outputs: its problems r, r + dp, ... in order
    if not ctx.is_main:
        return None
    n = cfg.samples
    return [shares[i % ctx.dp_size][(i // ctx.dp_size) * n + j] for i in range(len(prompt_ids)) for j in range(n)]


REDRAW_S = 1.0
"""Seconds between redraws of the eval progress bar while an engine.generate call runs."""


@contextmanager
def _redrawn(bar, every_s: float):
    """Redraw `bar` every `every_s` seconds from a helper thread while the block runs (tqdm draws only when it is
    updated, and the engine reports nothing until a generate call returns); nothing for a disabled bar."""
    if bar.disable:
        yield
        return
    stop = threading.Event()

    def redraw() -> None:
        while not stop.wait(every_s):
            bar.refresh()

    thread = threading.Thread(target=redraw, name="eval-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _record(p: Problem, j: int, prompt: str, response: str, g: Grade, out: dict) -> GradedSample:
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    return GradedSample(p.id, j, prompt, response, g.extracted, g.normalized, p.answer, g.score, g.reason,
                        finish.get("type", "unknown"), len(out["output_ids"]), meta.get("weight_version"))


def outcomes_by_problem(records: list[GradedSample]) -> dict[str, list[SampleOutcome]]:
    """The records as `metrics.summarize` takes them: per problem id, its samples' outcomes in order."""
    out: dict[str, list[SampleOutcome]] = {}
    for r in records:
        out.setdefault(r.id, []).append(SampleOutcome(score=r.score, answer=r.normalized,
                                                      truncated=r.finish_reason == "length",
                                                      num_tokens=r.num_tokens))
    return out


# ---- reports -------------------------------------------------------------------------------------------------
def write_reports(result: EvalResult, out_dir: str | Path, extra: dict | None = None) -> Path:
    """`results.jsonl` (one row per sample) and `summary.json` (the summary, plus `extra`) in out_dir, each
    written to a temporary file and renamed into place; returns out_dir."""
    from miles_k3.utils.atomic import atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(json_line(asdict(r)) + "\n" for r in result.records)
    atomic_write_text(out / "results.jsonl", lines)
    atomic_write_text(out / "summary.json", json.dumps({**result.summary, **(extra or {})}, indent=2) + "\n")
    return out


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def json_line(row: dict) -> str:
    """`row` as one line of JSON that UTF-8 can always encode: text stays readable (ensure_ascii=False), but a
    lone surrogate (a response holding "\\ud800", read from JSON) is written as its \\uXXXX escape, which reads
    back as the same string."""
    text = json.dumps(row, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


TABLE_COLUMNS = ["id", "sample", "response", "extracted", "gold", "score", "reason"]


def log_eval(tracker, result: EvalResult, rows: int, step: int | None = None) -> None:
    """`eval/*` metrics and the first `rows` samples as the table eval/samples."""
    tracker.log(result.metrics(), step=step)
    if rows:
        table = [[r.id, r.sample, r.response, r.extracted, r.gold, r.score, r.reason] for r in result.records[:rows]]
        tracker.log_table("eval/samples", TABLE_COLUMNS, table, step=step)


class EvalHook:
    """The training loop's eval: `maybe_run(step, lora)` evaluates when step is a multiple of
    cfg.every_n_steps (or `force`), writes reports into `<run_dir>/eval/step_<step>`, logs to the tracker and
    returns the eval/ metrics (None when it did not run)."""

    def __init__(self, cfg: EvalConfig, engine, tokenizer, problems: list[Problem], run_dir: str | Path,
                 tracker=None, ctx: ParallelContext = SINGLE):
        self.cfg, self.engine, self.tokenizer, self.problems = cfg, engine, tokenizer, problems
        self.run_dir, self.tracker, self.ctx = Path(run_dir), tracker, ctx

    def due(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    def maybe_run(self, step: int, lora: str | None, force: bool = False) -> dict[str, float] | None:
        if not (force or self.due(step)):
            return None
        result = evaluate(self.engine, self.tokenizer, self.problems, self.cfg, lora=lora, progress=False,
                          ctx=self.ctx)
        if result is None:  # a rank other than 0: it generated its replica's share
            return None
        write_reports(result, self.run_dir / "eval" / f"step_{step:06d}", {"step": step})
        if self.tracker is not None:
            log_eval(self.tracker, result, self.cfg.table_rows, step=step)
        log.info("eval at step %d: %s", step, _headline(result.summary))
        return result.metrics()


def _headline(summary: dict) -> str:
    n = summary.get("samples_per_problem")
    keys = [f"avg@{n}", f"pass@{n}", f"maj@{n}", "truncation_rate"]
    return ", ".join(f"{k} {summary[k]:.4f}" for k in keys if k in summary)
