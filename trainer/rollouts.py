"""One step's rollouts: prompts from a resumable stream, G samples each through the engine's public `generate`,
rewards, group advantages, dynamic sampling and overlong handling -> `Sample`s for the trainer.

`PromptStream` walks a problem list in a seeded order, reshuffled every epoch; its `state()` (epoch, position)
goes into checkpoints so a resumed run draws the same prompts. `collect_rollouts` asks the engine for
`group_size` samples of each prompt with sampling seed `seed + draw * group_size + j` (draw = the prompt's
index in the stream since the run began), so a resumed run also samples the same tokens. With
`dynamic_sampling`, groups whose rewards are all equal (no gradient) are dropped and more prompts are drawn, up to
`max_sampling_rounds` rounds, until `prompts_per_step` groups are kept.

Overlong handling (`overlong`): `none` keeps every completion as it is; `mask` leaves completions stopped by
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
import random
from dataclasses import dataclass, field

import torch

from miles_k3.envs.env import EnvConfig, EnvFactory, Single
from miles_k3.evals.problems import Problem
from miles_k3.evals.remote_reward import remote_metrics
from miles_k3.evals.rewards import grade_outcome
from miles_k3.evals.templates import response_text, template_names
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import gather, max_over, sum_over
from miles_k3.trainer.advantages import ADVANTAGE_ESTIMATORS, group_advantages, zero_variance_groups
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.episodes import (
    Episode,
    engine_counts,
    env_metrics,
    env_totals,
    first_prompt,
    run_turns,
    session_args,
)

OVERLONG_MODES = ("none", "mask", "penalty")
ROLLOUT_MODES = ("sync", "partial")
STALENESS_POLICIES = ("wait", "drop", "keep")
GRADER_FAILURE_WARN = 0.05  # a step whose grader timeouts + errors exceed this share of its samples warns
log = logging.getLogger("miles_k3.train")


@dataclass
class PartialConfig:
    """rollout.mode=partial: how many groups stay in flight across weight updates and how stale a trained sample
    may be (`trainer.partial`)."""

    inflight_groups: int = 0
    """GRPO groups kept in the engine (running, queued, or paused across a weight update); at least
    prompts_per_step. 0: ceil(1.5 x prompts_per_step)."""
    max_staleness: int = 1
    """Weight versions a trained sample's oldest token may lag the adapter it trains: 0 is on-policy (every
    group finishes in the step it started), 1 lets a group span one push."""
    policy: str = "wait"
    """What keeps a group within max_staleness. wait: a group at the bound holds the step until it finishes (groups
    in flight are admitted before new ones). drop: a group past the bound is discarded and its prompt
    queued again (with the same sampling seeds). keep: no bound; every group is trained, with importance weights."""

    def validate(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"rollout.partial.max_staleness: must be an integer >= 0 (weight versions), got "
                             f"{self.max_staleness!r}")
        if self.policy not in STALENESS_POLICIES:
            raise ValueError(f"rollout.partial.policy: '{self.policy}' is not one of {', '.join(STALENESS_POLICIES)}")
        if isinstance(self.inflight_groups, bool) or self.inflight_groups < 0:
            raise ValueError(f"rollout.partial.inflight_groups: must be >= 0 (0: 1.5 x prompts_per_step), got "
                             f"{self.inflight_groups!r}")

    def check_inflight(self, prompts_per_step: int) -> None:
        if self.inflight_groups != 0 and self.inflight_groups < prompts_per_step:
            raise ValueError(f"rollout.partial.inflight_groups={self.inflight_groups}: fewer than "
                             f"rollout.prompts_per_step={prompts_per_step}, so a step could never finish its groups; "
                             "set it >= prompts_per_step, or 0 for 1.5 x prompts_per_step")

    def groups(self, prompts_per_step: int) -> int:
        """The number of groups kept in flight."""
        return self.inflight_groups or -(-3 * prompts_per_step // 2)


@dataclass
class RolloutConfig:
    """How a step's rollouts are sampled, rewarded and filtered."""

    prompts_per_step: int = 8
    """Prompts (GRPO groups) trained on per optimizer step."""
    group_size: int = 8
    """Samples per prompt (G)."""
    max_new_tokens: int = 512
    """Generation cap per sample."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k (-1 = off)."""
    template: str = "boxed"
    """Prompt template (evals.templates): boxed, plain or chat."""
    advantage: str = "grpo"
    """grpo (group mean/std), dr_grpo (no std), rloo (leave-one-out mean)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and draw more prompts to refill (DAPO)."""
    max_sampling_rounds: int = 4
    """Draw rounds per step with dynamic_sampling; after them the step trains on the groups it has."""
    overlong: str = "none"
    """none (every sample kept as it is), mask (samples stopped by max_new_tokens are left out of the loss, its
    normalisers and their group's baseline; multi-turn: an episode with a turn cut there, or that filled the
    context) or penalty (DAPO's soft penalty by length on every sample; multi-turn: by the episode's longest
    policy turn against the per-turn max_new_tokens, once per episode; observations never count)."""
    overlong_buffer: int = 0
    """The penalty's ramp length L_buf in tokens (penalty mode): a response of L > max_new_tokens - L_buf tokens
    gets (max_new_tokens - L_buf - L) / L_buf added to its reward (-1 at max_new_tokens; multi-turn: L is the
    episode's longest policy turn); 0: -1 for L = max_new_tokens, nothing below."""
    seed: int = 0
    """Prompt order and sampling seeds."""
    mode: str = "sync"
    """sync: every step samples its groups from scratch with the adapter it trains, and waits for the longest
    response. partial: the engine keeps rollout.partial.inflight_groups groups in flight; a step trains on the first
    prompts_per_step groups to finish, and the others are paused, kept across the weight update and continued
    under the new adapter (each token records the version that sampled it; off-policy tokens are importance
    weighted). Native engine; under parallel.dp > 1 each replica keeps and finishes its share of the groups.
    Needs trainer.old_logprobs=recompute (the default) and trainer.loss.tis on: its default, auto, is token_truncate
    under partial."""
    partial: PartialConfig = field(default_factory=PartialConfig)
    """rollout.mode=partial only."""
    log_samples: int = 4
    """Completions per step logged to the rollout/samples table (W&B and tables/rollout_samples.jsonl)."""
    return_routed_experts: bool = False
    """The engine returns each sample's routes (the top-k experts of every MoE layer at every position it
    processed, meta_info routed_experts; 2.9 MB per 1k tokens on k3) and the trainer reports
    train/route_mismatch_frac (tokens whose own top-k differs in at least one layer). trainer.routing_replay
    implies it. Native engine only."""
    release_tags: list[str] = field(default_factory=lambda: ["kv_cache", "cuda_graph"])
    """Engine memory released while the trainer steps (SGLang tags kv_cache, cuda_graph; [] keeps it all, for a
    model small enough to share the GPU; a release drops the captured decode graphs, recaptured next rollout).
    With engine.backend=sglang also weights (needs sglang.enable_weights_cpu_backup); checked against the engine
    by `TrainConfig.validate`."""

    def validate(self) -> None:
        for name in ("prompts_per_step", "max_new_tokens", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:  # a lone sample is its own baseline: advantage 0, an empty step every step
            raise ValueError(f"group_size: must be >= 2, got {self.group_size}: GRPO-family advantages "
                             f"({'/'.join(ADVANTAGE_ESTIMATORS)}) compare each sample with the other samples of "
                             "its prompt, so a group of one has advantage 0 and no step trains; set "
                             "rollout.group_size=2 or more (8 is typical)")
        if self.log_samples < 0:
            raise ValueError(f"log_samples: must be >= 0, got {self.log_samples}")
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage: '{self.advantage}' is not one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f"overlong: '{self.overlong}' is not one of {', '.join(OVERLONG_MODES)}")
        if not 0 <= self.overlong_buffer < self.max_new_tokens:
            raise ValueError(f"overlong_buffer: must be in [0, max_new_tokens), got {self.overlong_buffer}")
        if self.template not in template_names():
            raise ValueError(f"template: '{self.template}' is not one of {', '.join(template_names())}")
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(f"mode: '{self.mode}' is not one of {', '.join(ROLLOUT_MODES)}")
        if self.mode == "partial":
            self.partial.check_inflight(self.prompts_per_step)
            if self.dynamic_sampling and self.max_sampling_rounds != 1:
                raise ValueError(f"max_sampling_rounds={self.max_sampling_rounds}: rollout.mode=partial trains on the "
                                 "groups that finish and leaves flat ones out (dynamic_sampling) without drawing "
                                 "rounds; set rollout.max_sampling_rounds=1")
        elif self.partial != PartialConfig():
            raise ValueError("partial: rollout.partial.* is set but rollout.mode=sync, where it does nothing; set "
                             "rollout.mode=partial or leave rollout.partial at its defaults")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1):
            raise ValueError(f"temperature/top_p: need temperature >= 0 and 0 < top_p <= 1, got "
                             f"{self.temperature}, {self.top_p}")


class PromptStream:
    """Problems in a seeded order, reshuffled each epoch; `take(k)` the next k; `state()` / `load_state()`."""

    def __init__(self, problems: list[Problem], seed: int):
        if not problems:
            raise ValueError("PromptStream: no problems to train on")
        self.problems, self.seed = problems, seed
        self.epoch, self.pos, self.drawn = 0, 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[tuple[int, Problem]]:
        """The next k problems, each with its draw index (counting from the start of the run)."""
        out = []
        for _ in range(k):
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append((self.drawn, self.problems[self._order[self.pos]]))
            self.pos, self.drawn = self.pos + 1, self.drawn + 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "drawn": self.drawn}

    def load_state(self, state: dict) -> None:
        self.epoch, self.pos, self.drawn = int(state["epoch"]), int(state["pos"]), int(state["drawn"])
        self._order = self._shuffled(self.epoch)


def collect_rollouts(engine, tokenizer, stream: PromptStream, reward_fn, cfg: RolloutConfig,
                     lora: str | None, ctx: ParallelContext = SINGLE,
                     routes: bool | None = None,
                     env: tuple[EnvFactory, EnvConfig] | None = None) -> tuple[list[Sample], dict[str, float]]:
    """`prompts_per_step` groups of `group_size` samples (fewer when dynamic sampling ran out of rounds), with
    rewards and advantages; metrics under rollout/.

    Data parallel (ctx.dp_size > 1): prompts_per_step is the global batch. Every replica draws the same prompts
    from its own copy of the stream and samples every dp_size-th of them (drawn[dp_rank::dp_size]: a group never
    spans replicas; the sampling seeds come from the global draw index, so a prompt's samples do not depend on
    which replica runs it). Which groups are kept, each kept group's Sample.group (its index among the step's
    kept groups, as one process numbers them) and the metrics are global; the samples returned are this
    replica's. Every replica calls engine.generate once per sampling round, with or without prompts of its own
    (an engine in lockstep needs every rank's calls). `routes` (default cfg.return_routed_experts): the samples
    carry the engine's routes (Sample.routed_experts). `env`: (factory, its config) of the environment each
    rollout is an episode of (`episodes.py`); None: `single`, one turn graded by `reward_fn`."""
    routes = cfg.return_routed_experts if routes is None else routes
    env = env or SINGLE_ENV
    episodes: list[Episode] = []
    group = ctx.dp_group
    kept: list[tuple[int, list[Sample]]] = []  # (global group index, this replica's group)
    seen: list[list[Sample]] = []
    outcomes: list[tuple[str, bool]] = []  # (grade outcome, correct) of every graded sample
    rounds = num_kept = num_flat = num_drawn = 0
    counts_before = engine_counts(engine)
    while num_kept < cfg.prompts_per_step and rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
        drawn = stream.take(cfg.prompts_per_step - num_kept)
        mine = drawn[ctx.dp_rank::ctx.dp_size]
        if mine:
            groups, graded, eps = _sample_groups(engine, tokenizer, mine, reward_fn, cfg, lora, routes, env, ctx)
            episodes += eps
        else:  # no prompt of its own this round: generate calls still (lockstep: its part in the others' forwards)
            groups, graded = [], []
            engine.generate(input_ids=[], n=cfg.group_size, lora=lora)
            run_turns(engine, tokenizer, [], cfg, env[1], lora, routes, ctx)
        seen += groups
        outcomes += graded
        flat = _global_flags([_is_flat(g) for g in groups], len(drawn), ctx)  # by position in `drawn`
        keep = [not (cfg.dynamic_sampling and f) for f in flat]
        index = [num_kept + sum(keep[:j]) for j in range(len(drawn))]
        kept += [(index[j], g) for j, g in zip(range(ctx.dp_rank, len(drawn), ctx.dp_size), groups) if keep[j]]
        num_flat, num_kept, num_drawn = num_flat + sum(flat), num_kept + sum(keep), num_drawn + len(drawn)
        rounds += 1
    for gi, g in kept:
        for s, a in zip(g, _advantages(g, cfg.advantage)):
            s.advantage, s.group = a, gi
    samples = [s for _, g in kept for s in g]
    local = _totals(seen, outcomes)
    multi = env[1].name != "single"
    if multi:
        local |= env_totals(episodes, counts_before, engine_counts(engine))
    totals = dict(zip(local, sum_over(list(local.values()), group)))
    counts = {"groups_kept": num_kept, "groups_drawn": num_drawn, "rounds": rounds, "flat": num_flat}
    metrics = _metrics(totals, counts)
    if multi:  # the environments' info numbers, every replica's
        info: dict[str, float] = {}
        for part in gather([ep.info for ep in episodes], group):
            for d in part:
                for k, v in d.items():
                    info[k] = info.get(k, 0.0) + v
        metrics |= env_metrics(totals, info)
    return samples, metrics | reward_metrics(reward_fn, ctx)


def reward_metrics(reward_fn, ctx: ParallelContext = SINGLE) -> dict[str, float]:
    """The reward's own metrics since the last step, over every replica (the remote reward's error rate, retries
    and seconds in calls: `pop_counts` summed over the replicas, the seconds their maximum), or none."""
    pop = getattr(reward_fn, "pop_counts", None)
    if pop is None:
        return {}
    counts = pop()
    keys = [k for k in counts if k != "seconds"]
    summed = dict(zip(keys, sum_over([counts[k] for k in keys], ctx.dp_group)))
    (seconds,) = max_over([counts["seconds"]], ctx.dp_group)
    return remote_metrics(summed | {"seconds": seconds})


def _global_flags(flags: list[bool], n: int, ctx: ParallelContext) -> list[bool]:
    """The flags of all `n` groups drawn this round, by position, from each replica's flags of its own groups
    (positions dp_rank, dp_rank + dp_size, ...)."""
    if ctx.dp_size == 1:
        return list(flags)
    marks = [0.0] * n
    for j, f in zip(range(ctx.dp_rank, n, ctx.dp_size), flags):
        marks[j] = float(f)
    return [bool(m) for m in sum_over(marks, ctx.dp_group)]


def check_on_policy(samples: list[Sample], version: int) -> None:
    """The loop is synchronous: every token of every sample must have been drawn with weight version `version`
    (the trainer's adapter). Raises RuntimeError naming the first sample that was not (a push that landed during
    a rollout, or an engine serving another adapter), since the loss takes the samples as on-policy."""
    for i, s in enumerate(samples):
        if s.weight_version != version or s.weight_version_max != version:
            raise RuntimeError(f"rollout: sample {i} was drawn with weight versions {s.weight_version}.."
                               f"{s.weight_version_max}, the trainer's adapter is version {version}; the engine "
                               "must serve the trainer's adapter during the whole rollout")


def _is_flat(group: list[Sample]) -> bool:
    """No learning signal: the rewards of the group's in-loss members are all equal (or fewer than two are in
    the loss)."""
    members = [s.reward for s in group if s.in_loss]
    return len(members) < 2 or bool(zero_variance_groups(torch.tensor(members), len(members))[0])


def _advantages(group: list[Sample], estimator: str) -> list[float]:
    """The group's advantages, its baseline over the members in the loss only; 0 for the others."""
    members = [i for i, s in enumerate(group) if s.in_loss]
    out = [0.0] * len(group)
    if len(members) >= 2:
        adv = group_advantages(torch.tensor([group[i].reward for i in members]), len(members), estimator)
        for i, a in zip(members, adv.tolist()):
            out[i] = a
    return out


def _sample_groups(engine, tokenizer, drawn, reward_fn, cfg: RolloutConfig, lora, routes: bool = False,
                   env: tuple[EnvFactory, EnvConfig] | None = None,
                   ctx: ParallelContext = SINGLE) -> tuple[list[list[Sample]], list[tuple[str, bool]], list[Episode]]:
    """The drawn prompts' groups as episodes (`episodes.py`; the default `single` environment: one turn each),
    graded and scored: (groups of samples, the grade outcomes, the episodes)."""
    factory, env_cfg = env or SINGLE_ENV
    seeds = [cfg.seed * 1_000_003 + d * cfg.group_size for d, _ in drawn]
    g = cfg.group_size
    if getattr(factory, "plays_episodes", False):  # env=agent: agent code plays them (`miles_k3.agent`)
        episodes = factory.play(drawn, seeds, cfg)
    else:
        episodes = _first_turns(engine, tokenizer, drawn, seeds, cfg, lora, routes, factory, env_cfg)
        run_turns(engine, tokenizer, episodes, cfg, env_cfg, lora, routes, ctx)
    samples, outcomes = score_episodes(episodes, [p.answer for _, p in drawn for _ in range(g)], reward_fn, cfg,
                                       tokenizer)
    return [samples[i:i + g] for i in range(0, len(samples), g)], outcomes, episodes


def score_episodes(episodes: list[Episode], golds: list[str], reward_fn, cfg: RolloutConfig, tokenizer
                   ) -> tuple[list[Sample], list[tuple[str, bool]]]:
    """Each episode as a `Sample` (its tokens, loss mask, log-probs, versions) with its reward: the environment's,
    and the run's reward of its final turn (or agent's answer) against its gold where the environment leaves it to
    the reward; an episode the environment failed or whose reward failed is out of the loss. Also the grade
    outcomes of the graded ones."""
    graded = [i for i, ep in enumerate(episodes) if ep.graded]
    results = reward_fn([episodes[i].answer if episodes[i].answer is not None else
                         response_text(tokenizer, episodes[i].outs[-1]) for i in graded],
                        [golds[i] for i in graded]) if graded else []
    by_episode = dict(zip(graded, results))
    samples = []
    for i, ep in enumerate(episodes):
        r = by_episode.get(i)
        reward = ep.reward if r is None else (ep.reward + r.score if ep.reward else r.score)
        s = _sample(ep.prompt, ep.record(), reward, cfg, ep.turn_lengths())
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


def _first_turns(engine, tokenizer, drawn, seeds, cfg: RolloutConfig, lora, routes: bool, factory,
                 env_cfg: EnvConfig) -> list[Episode]:
    """Every drawn prompt's group after its first turn: one `generate` call, n = group_size forks of each prompt."""
    envs = [[factory() for _ in range(cfg.group_size)] for _ in drawn]
    prompts = []
    for (d, p), group in zip(drawn, envs):
        texts = {first_prompt(e, p, d, cfg.seed, cfg.template, tokenizer) for e in group}
        if len(texts) != 1:
            raise ValueError(f"env={env_cfg.name}: reset gave the members of problem {p.id}'s group different "
                             "prompts; a group shares its prompt (reset gets the same rng seed for each)")
        prompts.append(tokenizer.encode(texts.pop(), add_special_tokens=False))
    params = [{"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
               "top_k": cfg.top_k, "sampling_seed": seed} for seed in seeds]
    outs = engine.generate(input_ids=prompts, sampling_params=params, n=cfg.group_size, return_logprob=True,
                           lora=lora, return_routed_experts=routes, **session_args(engine, env_cfg))
    bad = next((o for o in outs if "error" in o), None)
    if bad is not None:
        ids = [o["meta_info"]["session_id"] for o in outs if "session_id" in o.get("meta_info", {})]
        if ids:
            engine.close_sessions(ids)
        raise RuntimeError(f"rollout: the engine rejected a request: {bad['error']}")
    g = cfg.group_size
    episodes = [Episode(envs[i // g][i % g], prompts[i // g], seeds[i // g] + i % g) for i in range(len(outs))]
    for ep, out in zip(episodes, outs):
        ep.add_turn(out)
    return episodes


SINGLE_ENV = (Single, EnvConfig())
"""The default environment: one turn per rollout, graded by the run's reward."""


def _sample(prompt: list[int], out: dict, reward: float, cfg: RolloutConfig,
            turn_lengths: list[int] | None = None) -> Sample:
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


def _totals(seen: list[list[Sample]], outcomes: list[tuple[str, bool]]) -> dict[str, float]:
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


def _metrics(t: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
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
