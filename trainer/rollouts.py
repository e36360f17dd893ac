"""rollout.mode=sync: one step's rollouts, every sample drawn with the adapter being trained (`SyncRollouts`, a
`sources.RolloutSource`), and the rollout config (`RolloutConfig`, `PartialConfig`).

`PromptStream` walks a problem list in a seeded order, reshuffled every epoch; its `state()` (epoch, position)
goes into checkpoints so a resumed run draws the same prompts. `collect_rollouts` plays `group_size` episodes of
each prompt (`sources.EpisodePlayer`: the environment's turns through the engine's public `generate`, one turn in
the default `single` environment; or agent code) with sampling seed `seeds.group_seed(seed, draw, group_size) + j`
(draw = the prompt's index in the stream since the run began), so a resumed run also samples the same tokens. With
`dynamic_sampling`, groups whose rewards are all equal (no gradient) are dropped and more prompts are drawn, up to
`max_sampling_rounds` rounds, until `prompts_per_step` groups are kept. Scoring, overlong handling and the rollout/
metrics: `scoring.py`, shared with rollout.mode=partial (`partial.py`).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from miles_k3.envs.env import EnvConfig, EnvFactory
from miles_k3.evals.problems import Problem
from miles_k3.evals.remote_reward import remote_metrics
from miles_k3.evals.templates import template_names
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import max_over, sum_over
from miles_k3.trainer.advantages import ADVANTAGE_ESTIMATORS
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.checkpoint_files import ResumeError
from miles_k3.trainer.episodes import SINGLE_ENV, Episode, engine_counts, env_metrics, env_totals
from miles_k3.trainer.scoring import (  # noqa: F401 - overlong_penalty re-exported: the rollout API it belongs to
    env_info,
    is_flat,
    member_advantages,
    overlong_penalty,
    rollout_metrics,
    rollout_totals,
    score_episodes,
)
from miles_k3.trainer.seeds import group_seed, order_seed
from miles_k3.trainer.sources import EpisodePlayer, episode_player

OVERLONG_MODES = ("none", "mask", "penalty")
ROLLOUT_MODES = ("sync", "partial", "fleet")
STALENESS_POLICIES = ("wait", "drop", "keep")
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
    queued again (rollout.mode=partial: with fresh sampling seeds, derived from its draw and its retry count;
    rollout.mode=fleet: with the same ones). keep: no bound; every group is trained, with importance weights."""
    refill: bool = False
    """Queue a new group as each group finishes within a step's run, so that inflight_groups stay in flight while
    the engine decodes (off: the pool is topped up between steps only and drains during the run, its last decode
    steps running the groups' slowest samples at a small batch). A refilled group is queued under the version
    being served, as one topped up at the step's start. Single-turn episodes (env.max_turns 1), one process."""
    env_lag_steps: int = 8
    """Multi-turn episodes: decode steps the engine runs on while a finished turn's environment steps (in its own
    thread) before the episode's next turn joins the queue; decoding waits for a step only if it is still running
    then (perf/env_wait_s). A fixed count, not the step's end, decides when a turn is applied, so the samples do
    not depend on how long the steps take (and a resume continues exactly). 0: decoding waits for every finished
    turn's step at the end of the decode step that finished it. With nothing left to decode, the earliest turns
    are applied at once."""

    def validate(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"rollout.partial.max_staleness: must be an integer >= 0 (weight versions), got "
                             f"{self.max_staleness!r}")
        if self.policy not in STALENESS_POLICIES:
            raise ValueError(f"rollout.partial.policy: '{self.policy}' is not one of {', '.join(STALENESS_POLICIES)}")
        if isinstance(self.env_lag_steps, bool) or not isinstance(self.env_lag_steps, int) or self.env_lag_steps < 0:
            raise ValueError(f"rollout.partial.env_lag_steps: must be an integer >= 0 (decode steps), got "
                             f"{self.env_lag_steps!r}")
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
class FleetConfig:
    """rollout.mode=fleet: the rollout engines as Ray actors, each with its own copy of the frozen base
    (`trainer.fleet`, docs/guides/ray.md); Ray is the optional extra `.[ray]`."""

    engines: int = 2
    """Engine actors; each builds the base from model.path (or the seed's random init) and a native engine over it."""
    cpus_per_engine: float = 1.0
    """CPUs each engine holds (Ray's CPU resource); its torch threads: this, at least 1."""
    gpus_per_engine: float = 0.0
    """GPUs each engine holds (a fraction shares a GPU: Ray's fractional GPUs); above 0 the engine runs on CUDA."""
    max_restarts: int = 3
    """Times Ray starts an engine again after its process died (its base rebuilt from disk, then the current
    adapter); -1: no limit. Its calls go back to the queue either way."""
    start_timeout_s: float = 120.0
    """How long the engines may take to start, and a dead engine to come back, before the run stops (at the start)
    or goes on without it."""

    def validate(self) -> None:
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or self.engines < 1:
            raise ValueError(f"rollout.fleet.engines: must be an integer >= 1, got {self.engines!r}")
        if not self.cpus_per_engine > 0:
            raise ValueError(f"rollout.fleet.cpus_per_engine: must be > 0, got {self.cpus_per_engine}")
        if not self.gpus_per_engine >= 0:
            raise ValueError(f"rollout.fleet.gpus_per_engine: must be >= 0, got {self.gpus_per_engine}")
        if self.max_restarts < -1:
            raise ValueError(f"rollout.fleet.max_restarts: must be >= -1 (-1: no limit), got {self.max_restarts}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"rollout.fleet.start_timeout_s: must be > 0, got {self.start_timeout_s}")

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
    """Prompt order and sampling seeds; defaults to the run's `seed` (recipes/train.yaml sets `${seed}`: seed=S
    reseeds the whole run), rollout.seed=N sets it apart."""
    mode: str = "sync"
    """sync: every step samples its groups from scratch with the adapter it trains, and waits for the longest
    response. partial: the engine keeps rollout.partial.inflight_groups groups in flight; a step trains on the first
    prompts_per_step groups to finish, and the others are paused, kept across the weight update and continued
    under the new adapter (each token records the version that sampled it; off-policy tokens are importance
    weighted). Native engine; under parallel.dp > 1 each replica keeps and finishes its share of the groups.
    Needs trainer.old_logprobs=recompute (the default) and trainer.loss.tis on: its default, auto, is token_truncate
    under partial. fleet: the groups are sampled by rollout.fleet.engines engine actors on Ray, under the
    partial-mode rules (rollout.partial.*); the engines sample the next step's groups while the trainer trains
    (native engine, env=single, one process: `miles_k3.ray_config.check_fleet`)."""
    partial: PartialConfig = field(default_factory=PartialConfig)
    """rollout.mode=partial and fleet only."""
    fleet: FleetConfig = field(default_factory=FleetConfig)
    """rollout.mode=fleet only."""
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
        if self.mode in ("partial", "fleet"):
            self.partial.check_inflight(self.prompts_per_step)
            if self.dynamic_sampling and self.max_sampling_rounds != 1:
                raise ValueError(f"max_sampling_rounds={self.max_sampling_rounds}: rollout.mode={self.mode} trains on "
                                 "the groups that finish and leaves flat ones out (dynamic_sampling) without drawing "
                                 "rounds; set rollout.max_sampling_rounds=1")
        elif self.partial != PartialConfig():
            raise ValueError("partial: rollout.partial.* is set but rollout.mode=sync, where it does nothing; set "
                             "rollout.mode=partial or leave rollout.partial at its defaults")
        if self.mode != "fleet" and self.fleet != FleetConfig():
            raise ValueError(f"fleet: rollout.fleet.* is set but rollout.mode={self.mode}, where it does nothing; set "
                             "rollout.mode=fleet or leave rollout.fleet at its defaults")
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
        random.Random(order_seed(self.seed, epoch)).shuffle(order)
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


def collect_rollouts(engine, tokenizer, stream: PromptStream, reward_fn, cfg: RolloutConfig, lora: str | None,
                     ctx: ParallelContext = SINGLE, routes: bool | None = None,
                     env: tuple[EnvFactory | EpisodePlayer, EnvConfig] | None = None
                     ) -> tuple[list[Sample], dict[str, float]]:
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
    rollout is an episode of (`episodes.py`), or (an EpisodePlayer, its config): the player plays them (env=agent);
    None: `single`, one turn graded by `reward_fn`."""
    routes = cfg.return_routed_experts if routes is None else routes
    player = episode_player(env or SINGLE_ENV, engine, tokenizer, lora, routes, ctx)
    return play_step(player, stream, reward_fn, cfg, ctx)


def play_step(player: EpisodePlayer, stream: PromptStream, reward_fn, cfg: RolloutConfig,
              ctx: ParallelContext = SINGLE) -> tuple[list[Sample], dict[str, float]]:
    """`collect_rollouts` with the episodes played by `player`."""
    episodes: list[Episode] = []
    group = ctx.dp_group
    kept: list[tuple[int, list[Sample]]] = []  # (global group index, this replica's group)
    seen: list[list[Sample]] = []
    outcomes: list[tuple[str, bool]] = []  # (grade outcome, correct) of every graded sample
    rounds = num_kept = num_flat = num_drawn = 0
    counts_before = engine_counts(player.engine)
    while num_kept < cfg.prompts_per_step and rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
        drawn = stream.take(cfg.prompts_per_step - num_kept)
        groups, graded, eps = _sample_groups(player, drawn[ctx.dp_rank::ctx.dp_size], reward_fn, cfg)
        episodes += eps
        seen += groups
        outcomes += graded
        flat = _global_flags([is_flat(g) for g in groups], len(drawn), ctx)  # by position in `drawn`
        keep = [not (cfg.dynamic_sampling and f) for f in flat]
        index = [num_kept + sum(keep[:j]) for j in range(len(drawn))]
        kept += [(index[j], g) for j, g in zip(range(ctx.dp_rank, len(drawn), ctx.dp_size), groups) if keep[j]]
        num_flat, num_kept, num_drawn = num_flat + sum(flat), num_kept + sum(keep), num_drawn + len(drawn)
        rounds += 1
    for gi, g in kept:
        for s, a in zip(g, member_advantages(g, cfg.advantage)):
            s.advantage, s.group = a, gi
    samples = [s for _, g in kept for s in g]
    local = rollout_totals(seen, outcomes)
    multi = player.multi_turn
    if multi:
        local |= env_totals(episodes, counts_before, engine_counts(player.engine))
    totals = dict(zip(local, sum_over(list(local.values()), group)))
    counts = {"groups_kept": num_kept, "groups_drawn": num_drawn, "rounds": rounds, "flat": num_flat}
    metrics = rollout_metrics(totals, counts)
    if multi:  # the environments' info numbers, every replica's
        metrics |= env_metrics(totals, env_info(episodes, group))
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


def _sample_groups(player: EpisodePlayer, drawn: list[tuple[int, Problem]], reward_fn, cfg: RolloutConfig
                   ) -> tuple[list[list[Sample]], list[tuple[str, bool]], list[Episode]]:
    """The drawn prompts' groups as episodes played by `player` (none drawn: it plays an empty round, its part in a
    lockstep engine's calls), graded and scored: (groups of samples, the grade outcomes, the episodes)."""
    g = cfg.group_size
    episodes = player.play(drawn, [group_seed(cfg.seed, d, g) for d, _ in drawn], cfg)
    samples, outcomes = score_episodes(episodes, [p.answer for _, p in drawn for _ in range(g)], reward_fn, cfg,
                                       player.tokenizer)
    return [samples[i:i + g] for i in range(0, len(samples), g)], outcomes, episodes


class SyncRollouts:
    """rollout.mode=sync as a `RolloutSource`: each step's groups drawn from `stream` and played from scratch with
    the trainer's adapter (`play_step`; by the environment's turn loop, or `env`'s EpisodePlayer: env=agent),
    every sample on-policy (`check_on_policy`). Its state is the prompt stream's position."""

    mode = "sync"

    def __init__(self, engine, tokenizer, stream: PromptStream, reward_fn, cfg: RolloutConfig, lora: str | None,
                 ctx: ParallelContext = SINGLE, routes: bool = False,
                 env: tuple[EnvFactory | EpisodePlayer, EnvConfig] | None = None):
        self.stream, self.reward_fn, self.cfg, self.ctx = stream, reward_fn, cfg, ctx
        self.player = episode_player(env or SINGLE_ENV, engine, tokenizer, lora, routes, ctx)

    def collect(self, version: int) -> tuple[list[Sample], dict[str, float]]:
        samples, metrics = play_step(self.player, self.stream, self.reward_fn, self.cfg, self.ctx)
        check_on_policy(samples, version)
        return samples, metrics

    def state(self) -> dict:
        return {"mode": self.mode, "stream": self.stream.state()}

    def load_state(self, state: dict) -> None:
        if state["mode"] != self.mode:
            raise ResumeError(f"written by a rollout.mode={state['mode']} run, with rollouts in flight that "
                              f"rollout.mode={self.mode} cannot continue; resume with rollout.mode={state['mode']} "
                              f"(and the same rollout.{state['mode']}.*), or start a new run_dir")
        self.stream.load_state(state["stream"])

    def close(self) -> None:
        self.player.close()
