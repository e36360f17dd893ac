"""Scoring a round of rollouts, whoever produced it (`rollouts.SyncRollouts`, `partial.PartialRollouts`): each episode
as a `Sample` with its reward (`score_episodes`), group advantages over the members in the loss, and the rollout/
metrics from sums that the data-parallel replicas add up.

Overlong handling (`rollout.overlong`): `none` keeps every completion as it is; `mask` leaves completions stopped by
max_new_tokens out of training altogether: they contribute nothing to the loss, its normalisers or their group's
baseline (the group's advantages and its zero-variance test are computed over the members that ended on their
own; a group with fewer than two such members has no signal); `penalty` is DAPO's soft overlong penalty, applied
by length to EVERY completion, truncated or not: 0 up to L_max - L_buf tokens (L_max = max_new_tokens, L_buf =
overlong_buffer), then (L_max - L_buf - L) / L_buf, falling linearly to -1 at L_max. In a multi-turn episode
max_new_tokens caps each policy turn, so L is the episode's longest turn (its own sampled tokens; observations never
count), and the episode takes that one turn's penalty, once: a turn cut at max_new_tokens costs -1, as a response
cut there does, and an episode of short turns costs nothing however long it grows. Likewise an episode is truncated
(and `mask` leaves it out) when any of its turns was cut, or it filled the context.

Grading outcomes are counted per step: `rollout/grader_timeout_rate` and `rollout/grader_error_rate` (grader
timeouts and failures, both scored 0: a silent zero reward otherwise) and `rollout/accuracy` (the share of
correct answers: the reward without its format bonus or penalties; not logged when the reward graded no sample, as
in multi-turn episodes that their environment scores); a step whose grading failures exceed
GRADER_FAILURE_WARN of its samples logs a warning. A sample whose reward could not be computed at all
(`RewardResult.failed`: the remote judge failed it) is no 0: it is left out of the loss, its group's baseline,
`rollout/reward_mean` and `rollout/accuracy`, and counted in `rollout/reward_failed`.
"""
from __future__ import annotations

import logging
import math

import torch

from miles_k3.evals.rewards import grade_outcome
from miles_k3.evals.templates import response_text
from miles_k3.parallel.reduce import gather
from miles_k3.trainer.advantages import group_advantages, zero_variance_groups
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.episodes import Episode

GRADER_FAILURE_WARN = 0.05  # a step whose grader timeouts + errors exceed this share of its samples warns
log = logging.getLogger("miles_k3.train")


def score_episodes(episodes: list[Episode], golds: list[str], reward_fn, cfg, tokenizer
                   ) -> tuple[list[Sample], list[tuple[str, bool]]]:
    """Each episode as a `Sample` (its tokens, loss mask, log-probs, versions) with its reward: the environment's,
    and the run's reward of its final turn (or agent's answer) against its gold where the environment leaves it to
    the reward; an episode the environment failed or whose reward failed is out of the loss. Also the grade
    outcomes of the graded ones. `cfg`: the RolloutConfig (overlong handling)."""
    graded = [i for i, ep in enumerate(episodes) if ep.graded]
    results = reward_fn([episodes[i].answer if episodes[i].answer is not None else
                         response_text(tokenizer, episodes[i].outs[-1]) for i in graded],
                        [golds[i] for i in graded]) if graded else []
    by_episode = dict(zip(graded, results))
    samples = []
    for i, ep in enumerate(episodes):
        r = by_episode.get(i)
        reward = ep.reward if r is None else (ep.reward + r.score if ep.reward else r.score)
        s = to_sample(ep.prompt, ep.record(), reward, cfg, ep.turn_lengths())
        if 0 in ep.mask:
            s.loss_mask = list(ep.mask)
        cut = any((o["meta_info"].get("finish_reason") or {}).get("type") == "length" for o in ep.outs)
        if ep.end == "context" or cut:  # a turn cut at its max_new_tokens, or the context full: truncated
            s.truncated = True
            s.in_loss = s.in_loss and cfg.overlong != "mask"
        s.reward_failed = r is not None and r.failed
        if ep.end in ("env_error", "env_timeout") or s.reward_failed:
            s.in_loss = False  # no trustworthy reward: out of the loss and its group's baseline
        samples.append(s)
    return samples, [("failed" if r.failed else grade_outcome(r), bool(r.correct)) for r in results]


def to_sample(prompt: list[int], out: dict, reward: float, cfg, turn_lengths: list[int] | None = None) -> Sample:
    """The engine's record `out` as a Sample; `turn_lengths`: the policy's tokens in each turn of a multi-turn
    episode (None: one turn, all of `out`), whose longest takes the overlong penalty."""
    meta = out["meta_info"]
    truncated = (meta.get("finish_reason") or {}).get("type") == "length"
    ids = list(out["output_ids"])
    if cfg.overlong == "penalty":
        longest = len(ids) if turn_lengths is None else max(turn_lengths, default=0)
        reward += overlong_penalty(longest, cfg.max_new_tokens, cfg.overlong_buffer)
    versions = meta.get("weight_versions") or [meta.get("weight_version", 0)]
    return Sample(list(prompt), ids, [lp for lp, _ in meta.get("output_token_logprobs", [])], reward,
                  weight_version=min(versions), weight_version_max=max(versions), truncated=truncated,
                  in_loss=not (truncated and cfg.overlong == "mask"),
                  unfiltered_logprobs=list(meta.get("output_token_logprobs_unfiltered", [])),
                  routed_experts=meta.get("routed_experts"),
                  token_versions=list(meta.get("output_token_weight_versions", [])))


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong penalty of a response of `length` tokens: 0 up to L_max - L_buf tokens, then
    (L_max - L_buf - length) / L_buf, down to -1 at L_max (and below it for longer responses: clamped at -1);
    with no buffer, -1 from L_max on."""
    if buffer == 0:
        return -1.0 if length >= max_new_tokens else 0.0
    free = max_new_tokens - buffer
    return 0.0 if length <= free else max(-1.0, (free - length) / buffer)


def is_flat(group: list[Sample]) -> bool:
    """No learning signal: the rewards of the group's in-loss members are all equal (or fewer than two are in
    the loss)."""
    members = [s.reward for s in group if s.in_loss]
    return len(members) < 2 or bool(zero_variance_groups(torch.tensor(members), len(members))[0])


def member_advantages(group: list[Sample], estimator: str) -> list[float]:
    """The group's advantages, its baseline over the members in the loss only; 0 for the others."""
    members = [i for i, s in enumerate(group) if s.in_loss]
    out = [0.0] * len(group)
    if len(members) >= 2:
        adv = group_advantages(torch.tensor([group[i].reward for i in members]), len(members), estimator)
        for i, a in zip(members, adv.tolist()):
            out[i] = a
    return out


def rollout_totals(seen: list[list[Sample]], outcomes: list[tuple[str, bool]]) -> dict[str, float]:
    """The sums the rollout/ metrics are made of (summed over DP replicas before they are divided)."""
    flat = [s for g in seen for s in g]
    gaps = [u - f for s in flat if s.unfiltered_logprobs
            for f, u in zip(s.rollout_logprobs, s.unfiltered_logprobs)]
    return {"samples": len(flat), "reward": sum(s.reward for s in flat if not s.reward_failed),
            "reward_failed": sum(s.reward_failed for s in flat),
            "response_len": sum(len(s.response_ids) for s in flat), "truncated": sum(s.truncated for s in flat),
            "gaps": len(gaps), "gap": sum(gaps), "graded": len(outcomes),
            "timeouts": sum(o == "timeout" for o, _ in outcomes), "errors": sum(o == "error" for o, _ in outcomes),
            "correct": sum(c for _, c in outcomes)}


def rollout_metrics(t: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """The step's rollout/ metrics from the (global) sums `t` and group counts; shares of grader timeouts, grader
    errors and correct answers among the graded samples; warns when timeouts + errors exceed
    GRADER_FAILURE_WARN."""
    scored = t["samples"] - t["reward_failed"]  # a sample whose reward failed has none: not a 0 in the mean
    out = {"rollout/reward_mean": t["reward"] / scored if scored else math.nan,
           "rollout/reward_failed": float(t["reward_failed"]),
           "rollout/response_len_mean": t["response_len"] / t["samples"],
           "rollout/truncated_frac": t["truncated"] / t["samples"],
           "rollout/groups_kept": float(counts["groups_kept"]), "rollout/groups_drawn": float(counts["groups_drawn"]),
           "rollout/sampling_rounds": float(counts["rounds"])}
    if t["gaps"]:  # top-p / top-k: the sampled tokens' log-probs under the filtered vs the full distribution
        out["rollout/logprob_filter_gap"] = -t["gap"] / t["gaps"]
    n = max(t["graded"], 1)
    timeouts, errors = t["timeouts"] / n, t["errors"] / n  # a failed reward is neither (rollout/reward_failed)
    if timeouts + errors > GRADER_FAILURE_WARN:
        log.warning("rollout: %.0f%% of this step's samples were not graded (%.0f%% timeouts, %.0f%% grader errors) "
                    "and scored 0: raise reward.timeout_s or reward.workers, or check the gold answers (a "
                    "grader error on the gold is a dataset problem)", 100 * (timeouts + errors), 100 * timeouts,
                    100 * errors)
    judged = t["graded"] - t["reward_failed"]
    if judged > 0:  # none when every episode's reward came from its environment (guess): no accuracy, not 0
        out["rollout/accuracy"] = t["correct"] / judged
    return {**out, "rollout/grader_timeout_rate": timeouts, "rollout/grader_error_rate": errors,
            "rollout/frac_zero_std": counts["flat"] / counts["groups_drawn"]}


def env_info(episodes: list[Episode], group) -> dict[str, float]:
    """The environments' info numbers (`StepResult.info`) summed over these episodes of every replica of `group`:
    `episodes.env_metrics` divides them per episode."""
    info: dict[str, float] = {}
    for part in gather([ep.info for ep in episodes], group):
        for d in part:
            for k, v in d.items():
                info[k] = info.get(k, 0.0) + v
    return info
