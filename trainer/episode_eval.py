"""Episode-level evals: the held-out problems played as episodes of the run's environment (env=guess, tools, ...),
or by the run's agent code over the in-process server (env=agent: its `sources.EpisodePlayer`).

`evaluate_episodes(engine, tokenizer, problems, cfg, env, lora)` runs, for each problem, `cfg.samples` episodes of
the environment with the eval's sampling settings (cfg.temperature, top_p, top_k, max_new_tokens per turn), played
as training rollouts play them (`sources.episode_player`: the environment's turns through `episodes.first_turns` and
`run_turns`, states kept in the engine under env.keep_state; or the agent code, whose turn k of problem i's episode j samples
with seed (cfg.seed + i * cfg.samples + j) * 1009 + k), and scores each episode: the rewards the environment gave,
plus, when its final turn (or the agent's returned text) is left to the run's reward (StepResult.reward None:
`tools`), that turn graded by `cfg.grader`. Problem i's episode j starts with sampling seed
`cfg.seed + i * cfg.samples + j` (`seeds.eval_seed`; later turns derive theirs from it, as in rollouts), whatever the
batching.

Metrics (eval/, as the single-turn harness names them where they mean the same): avg@n (the mean episode score:
for guess, the success rate within env.max_turns turns) with its standard error over problems, pass@k and maj@k
(`evals.metrics.summarize`), answer_rate (episodes every turn of which the environment could read: no
`invalid` / `tool_call_errors` in its info, and a graded final turn with an answer), truncation_rate (episodes cut
by the context), and the episode's own: turns_mean (+ _se), end rates (done, max_turns, context, env_error,
env_timeout) and the environment's info numbers per episode (env/invalid, env/tool_calls, ...) and, for `invalid`,
per turn (invalid_turn_rate).

Data parallel (`ctx`): as `evals.harness`: replica r plays problems r, r + dp, ... in the same number of rounds on
every replica (run_turns' collectives need them all), and rank 0 gathers, scores and returns the result.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from miles_k3.envs.env import EnvConfig, EnvFactory
from miles_k3.evals.grading_pool import GradingPool
from miles_k3.evals.harness import (
    EvalConfig,
    EvalHook,
    EvalResult,
    GradedSample,
    log_eval,
    outcomes_by_problem,
    write_reports,
)
from miles_k3.evals.metrics import summarize
from miles_k3.evals.problems import Problem
from miles_k3.evals.templates import response_text
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import gather
from miles_k3.trainer.episodes import END_REASONS, Episode
from miles_k3.trainer.seeds import eval_seed
from miles_k3.trainer.sources import EpisodePlayer, PlaySettings, episode_player

log = logging.getLogger("miles_k3.evals")

INVALID_KEYS = ("invalid", "tool_call_errors")
"""Environment info numbers that mark a turn the environment could not use (guess: no number; tools: a call that
did not parse or failed)."""


@dataclass
class EpisodeRecord(GradedSample):
    """One evaluated episode (a row of results.jsonl): `response` is everything after the prompt (turns and
    observations), `extracted` the final turn's text, `finish_reason` how the episode ended (episodes.END_REASONS)."""

    turns: int = 0
    info: dict | None = None


def evaluate_episodes(engine, tokenizer, problems: list[Problem], cfg: EvalConfig,
                      env: tuple[EnvFactory | EpisodePlayer, EnvConfig], lora: str | None = None,
                      ctx: ParallelContext = SINGLE) -> EvalResult | None:
    """cfg.samples episodes per problem with adapter `lora`, scored (see the module docstring); None on ranks
    other than 0. `env`: (the environment's factory, or the player of env=agent; the environment's config)."""
    if not problems:
        raise ValueError("evaluate_episodes: no problems to evaluate")
    t0 = time.perf_counter()
    env_cfg = env[1]
    player = episode_player(env, engine, tokenizer, lora, ctx=ctx)
    settings, n = PlaySettings.of_eval(cfg), cfg.samples
    mine = list(range(ctx.dp_rank, len(problems), ctx.dp_size))
    largest = -(-len(problems) // ctx.dp_size)  # problems of the largest share (ceil)
    calls = -(-largest // cfg.batch_problems)
    played: list[tuple[int, int, Episode]] = []  # (problem, sample, episode)
    for k in range(calls):  # every replica plays as many rounds (an empty one too: run_turns' collectives)
        batch = mine[k * cfg.batch_problems:(k + 1) * cfg.batch_problems]
        episodes = player.play([(i, problems[i]) for i in batch], [eval_seed(cfg.seed, i, n) for i in batch], settings)
        played += [(i, j, episodes[b * n + j]) for b, i in enumerate(batch) for j in range(n)]
    rows = [_row(i, problems[i], j, ep, tokenizer) for i, j, ep in played]
    if ctx.dp_size > 1:
        parts = gather(rows, ctx.dp_group)
        if not ctx.is_main:
            return None
        rows = sorted((r for part in parts for r in part), key=lambda r: (r["i"], r["sample"]))
    graded = [k for k, r in enumerate(rows) if r["graded"]]
    grades = {}
    if graded:
        with GradingPool(cfg.grader, timeout_s=cfg.timeout_s, workers=cfg.grading_workers, channel=cfg.channel,
                         max_chars=cfg.max_chars) as pool:
            grades = dict(zip(graded, pool.grade([rows[k]["last"] for k in graded],
                                                 [rows[k]["gold"] for k in graded])))
    records = [_record(r, grades.get(k)) for k, r in enumerate(rows)]
    summary = summarize(outcomes_by_problem(records), ks=cfg.ks)
    summary |= episode_summary(records)
    summary.update(seconds=time.perf_counter() - t0, env=env_cfg.name, max_turns=env_cfg.max_turns,
                   grader=cfg.grader, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)
    return EvalResult(records, summary)


def _row(i: int, p: Problem, j: int, ep: Episode, tokenizer) -> dict:
    """What rank 0 needs of an episode (plain values, gathered across replicas). The final turn's text, or an
    agent's returned answer (env=agent, whose `outs` hold all its turns as one record: `ep.turns`)."""
    last = ep.answer if ep.answer is not None else response_text(tokenizer, ep.outs[-1])
    return {"i": i, "id": p.id, "sample": j, "prompt": tokenizer.decode(ep.prompt, skip_special_tokens=False),
            "response": tokenizer.decode(ep.ids, skip_special_tokens=False), "last": last, "gold": p.answer,
            "reward": ep.reward, "graded": ep.graded, "end": ep.end, "turns": ep.turns or len(ep.outs),
            "info": dict(ep.info), "num_tokens": sum(ep.mask),
            "weight_version": ep.outs[-1]["meta_info"].get("weight_version")}


def _record(r: dict, grade) -> EpisodeRecord:
    """The episode's score: its rewards, plus its final turn's grade when the run's reward grades it."""
    score, reason, extracted, normalized = float(r["reward"]), r["end"], r["last"].strip(), None
    if grade is not None:
        score += grade.score
        reason, extracted, normalized = grade.reason, grade.extracted, grade.normalized
    elif not any(r["info"].get(k, 0.0) for k in INVALID_KEYS):
        normalized = extracted  # every turn was one the environment could read
    if grade is not None and any(r["info"].get(k, 0.0) for k in INVALID_KEYS):
        normalized = None
    return EpisodeRecord(r["id"], r["sample"], r["prompt"], r["response"], extracted, normalized, r["gold"], score,
                         reason, r["end"], r["num_tokens"], r["weight_version"], turns=r["turns"], info=r["info"])


def episode_summary(records: list[EpisodeRecord]) -> dict[str, float]:
    """turns_mean (+ its standard error over problems), how episodes ended, the environment's info numbers per
    episode (env/<key>) and invalid turns per turn."""
    by_problem: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        by_problem.setdefault(r.id, []).append(r)
    per = np.array([np.mean([r.turns for r in rs]) for rs in by_problem.values()], dtype=float)
    out = {"turns_mean": float(per.mean()),
           "turns_mean_se": float(per.std(ddof=1) / np.sqrt(len(per))) if len(per) > 1 else 0.0}
    for reason in END_REASONS:
        out[f"end_{reason}_rate"] = sum(r.finish_reason == reason for r in records) / len(records)
    keys = sorted({k for r in records for k in (r.info or {})})
    for k in keys:
        out[f"env/{k}"] = sum((r.info or {}).get(k, 0.0) for r in records) / len(records)
    if "invalid" in keys:
        out["invalid_turn_rate"] = sum((r.info or {}).get("invalid", 0.0) for r in records) / sum(r.turns for r in records)
    return out


class EpisodeEvalHook(EvalHook):
    """The training loop's eval of a multi-turn environment (`env`: factory and config): `maybe_run` as EvalHook's,
    playing the held-out problems as episodes (`evaluate_episodes`)."""

    def __init__(self, cfg: EvalConfig, engine, tokenizer, problems: list[Problem], run_dir, tracker=None,
                 ctx: ParallelContext = SINGLE, *, env: tuple[EnvFactory, EnvConfig]):
        super().__init__(cfg, engine, tokenizer, problems, run_dir, tracker, ctx)
        self.env = env

    def maybe_run(self, step: int, lora: str | None, force: bool = False) -> dict[str, float] | None:
        if not (force or self.due(step)):
            return None
        result = evaluate_episodes(self.engine, self.tokenizer, self.problems, self.cfg, self.env, lora, self.ctx)
        if result is None:
            return None
        write_reports(result, self.run_dir / "eval" / f"step_{step:06d}", {"step": step})
        if self.tracker is not None:
            log_eval(self.tracker, result, self.cfg.table_rows, step=step)
        s, n = result.summary, self.cfg.samples
        log.info("eval at step %d (%s episodes): avg@%d %.4f (se %.4f), turns %.2f, well-formed %.4f%s", step,
                 s["env"], n, s[f"avg@{n}"], s[f"avg@{n}_se"], s["turns_mean"], s["answer_rate"],
                 f", invalid turns {s['invalid_turn_rate']:.4f}" if "invalid_turn_rate" in s else "")
        return result.metrics()
