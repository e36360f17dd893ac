"""Episodes: the rollout of one prompt's group as turns between the policy and an environment (`miles_k3.envs`).

Token in, token out. An episode's tokens are exactly what the engine saw: the prompt, then each turn's tokens as
sampled (its stop token included), then each observation's tokens (text tokenised on its own, or ids from the
environment), appended as ids; the policy's text is decoded only for the environment to read and is never
tokenised again. Each response token carries a loss mask (1: sampled by the policy, 0: an observation), the
engine's log-prob (0 for observations), its weight version (an observation takes its turn's) and, when routes are
returned, its route: the positions that produced a turn's tokens take that turn's own routes, the others the
final turn's prefill.

Turn 1 is the group's `generate` call (n = group_size forks of one prompt: they share its prefill); each later
round is one `generate` call over every live episode (n=1, its whole conversation as the prompt). With
env.keep_state (an engine that keeps state: the native one) every episode keeps its state in the engine
(`rollout/kept_state.py`): a turn's KDA state and latent pages stay parked there until the episode's next turn,
which prefills only its new tokens (the state is recomputed, with the same result, when it gave way for memory);
an episode's kept state is released when it ends. Without it every turn recomputes the whole conversation. Under data parallelism every rank makes the same number of
calls (a max over the ranks of the live episodes decides whether another round runs; a rank with none calls
`generate` with no prompts), as lockstep needs. The default `single` environment ends every episode after its
first turn, so a single-turn rollout makes one call and no collective, as before.

The environments of the episodes that step together (a round; in partial mode, the turns that finished in one
decode step) step at once, each in a daemon thread of its own (`EnvStep`), its env.step_timeout_s counted from
when its own step starts running: a slow step never delays another's. One that raises or runs over ends its
episode (`end` "env_error" / "env_timeout": left out of the loss, counted in env/ metrics); one that runs over is
cancelled (`Environment.cancel`, from the waiting thread) and its result, if it still comes, discarded. A turn cut
by rollout.max_new_tokens is answered as any other (rollout.overlong judges each turn against that cap). Each
step's result is kept (`Episode.steps`) so that a resumed run rebuilds an environment by replaying the answers it
gave (`Environment.replay`), never by running its steps again. Under tensor parallelism the environments step on
the TP group's first rank only and the group's other ranks apply its outcomes (`step_episodes`: one broadcast per
round), so the ranks of a replica see the same observations, ends and rewards even from an environment that is not
deterministic across processes (a step that runs over on one rank only, a remote tool).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from miles_k3.envs.env import EnvConfig, EnvFactory, Environment, Single, StepResult
from miles_k3.evals.problems import Problem
from miles_k3.evals.templates import render_prompt, response_text
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import broadcast, max_over, world_of
from miles_k3.trainer.seeds import reset_seed, sampling_params, turn_seed

log = logging.getLogger("miles_k3.train")

END_REASONS = ("done", "max_turns", "context", "env_error", "env_timeout")
SINGLE_ENV = (Single, EnvConfig())
"""The default environment: one turn per rollout, graded by the run's reward."""


def multi_turn(factory: EnvFactory) -> bool:
    """Whether `factory` makes environments other than `single`'s (one turn, graded by the run's reward), asked of
    the factory `launch.build_rollouts` chose, not of the config: their episodes' env/ metrics are logged, and
    partial mode checkpoints them as episodes."""
    return factory is not Single


@dataclass
class Episode:
    env: Environment
    prompt: list[int]
    seed: int  # the first turn's sampling seed; later turns derive theirs from it
    outs: list[dict] = field(default_factory=list)  # the engine's record of each turn
    starts: list[int] = field(default_factory=list)  # each turn's first position in prompt + response
    ids: list[int] = field(default_factory=list)  # response side: turns and observations
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    graded: bool = False  # the final turn is graded by the run's reward
    end: str = ""
    info: dict[str, float] = field(default_factory=dict)
    state_id: int | None = None  # the kept state its turns continue (env.keep_state), None: recomputed
    answer: str | None = None  # graded instead of the final turn's text (an agent's returned answer, env=agent)
    turns: int = 0  # policy turns when `outs` holds them as one record (env=agent); 0: one record per turn
    steps: list[StepResult] = field(default_factory=list)  # the environment's answer to each turn it stepped

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    def add_turn(self, out: dict) -> None:
        self.state_id = out["meta_info"].get("state_id")
        self.starts.append(self.length)
        self.outs.append(out)
        self.ids += list(out["output_ids"])
        self.mask += [1] * len(out["output_ids"])

    def turn_lengths(self) -> list[int]:
        """The policy's tokens in each of its turns (its stop token included; observations not counted)."""
        if not self.turns:
            return [len(o["output_ids"]) for o in self.outs]
        runs, prev = [], 0  # env=agent: the turns are one record; each is a run of loss-mask 1s
        for m in self.mask:
            if m and prev:
                runs[-1] += 1
            elif m:
                runs.append(1)
            prev = m
        return runs

    def record(self) -> dict:
        """The episode as one engine record (`output_ids`, `meta_info`): a one-turn episode's own record."""
        if len(self.outs) == 1 and len(self.ids) == len(self.outs[0]["output_ids"]):
            return self.outs[0]
        lps, unf, versions, all_versions = [], [], [], set()
        any_unf = any(o["meta_info"].get("output_token_logprobs_unfiltered") for o in self.outs)
        p = len(self.prompt)
        for k, out in enumerate(self.outs):
            meta, n_out = out["meta_info"], len(out["output_ids"])
            obs = self.ids[self.starts[k] - p + n_out:(self.starts[k + 1] if k + 1 < len(self.starts) else self.length)
                           - p]  # the observation after turn k (none after the last)
            lps += list(meta.get("output_token_logprobs", [])) + [(0.0, t) for t in obs]
            if any_unf:
                unf += list(meta.get("output_token_logprobs_unfiltered", [])) + [0.0] * len(obs)
            tv = list(meta.get("output_token_weight_versions", []))
            if tv:
                versions += tv + [tv[-1]] * len(obs)
            all_versions.update(meta.get("weight_versions") or [meta.get("weight_version", 0)])
        last = self.outs[-1]["meta_info"]
        meta = {"finish_reason": last.get("finish_reason"), "weight_versions": sorted(all_versions),
                "weight_version": max(all_versions), "output_token_logprobs": lps,
                "output_token_weight_versions": versions, "routed_experts": self._routes()}
        if any_unf:
            meta["output_token_logprobs_unfiltered"] = unf
        return {"output_ids": list(self.ids), "meta_info": meta}

    def _routes(self) -> torch.Tensor | None:
        """The final turn's routes (every position but the last, its prefill recomputing the earlier ones), with
        the positions that produced each earlier turn's tokens taken from that turn's own call."""
        routes = [o["meta_info"].get("routed_experts") for o in self.outs]
        if any(r is None for r in routes):
            return None
        out = routes[-1].clone()
        for k, r in enumerate(routes[:-1]):
            a, b = self.starts[k] - 1, self.starts[k] + len(self.outs[k]["output_ids"]) - 1
            out[a:b] = r[a:b]
        return out


def first_prompt(env: Environment, problem: Problem, draw: int, seed: int, template: str, tokenizer) -> str:
    """The episode's first prompt text: the environment's, else the rollout template's rendering of the problem.
    Every member of a group resets with the same rng seed (the draw's), so a group shares its prompt. An environment
    that is not an `Environment` is refused here, where every episode's environment starts."""
    if not isinstance(env, Environment):
        raise TypeError(f"env: {type(env).__name__} is not a miles_k3.envs.env.Environment; subclass it (its "
                        "cancel() and replay() have defaults: an environment overrides them to stop a step that runs "
                        "past env.step_timeout_s, and to resume without running its steps again)")
    text = env.reset(problem, random.Random(reset_seed(seed, draw)))
    return render_prompt(template, problem.problem, tokenizer) if text is None else text


def reset_group(factory: EnvFactory, problem: Problem, draw: int, settings, tokenizer, env_cfg: EnvConfig
                ) -> tuple[list[Environment], list[int]]:
    """A group's `settings.group_size` fresh environments, reset for draw `draw` (`first_prompt`, with
    settings.seed and settings.template), and the ids of the first prompt they share."""
    envs = [factory() for _ in range(settings.group_size)]
    texts = {first_prompt(e, problem, draw, settings.seed, settings.template, tokenizer) for e in envs}
    if len(texts) != 1:
        raise ValueError(f"env={env_cfg.name}: reset gave the members of problem {problem.id}'s group different "
                         "prompts; a group shares its prompt (reset gets the same rng seed for each)")
    return envs, tokenizer.encode(texts.pop(), add_special_tokens=False)


def open_episodes(envs: list[Environment], prompt: list[int], seed: int, records: list[dict]) -> list[Episode]:
    """A group's episodes after their first turn: fork j (the engine's record `records[j]`, sampled with seed +
    j) in the environment `envs[j]`."""
    episodes = [Episode(env, prompt, seed + j) for j, env in enumerate(envs)]
    for ep, record in zip(episodes, records):
        ep.add_turn(record)
    return episodes


def first_turns(engine, tokenizer, drawn: list[tuple[int, Problem]], seeds: list[int], settings, factory: EnvFactory,
                env_cfg: EnvConfig, lora: str | None, routes: bool = False) -> list[Episode]:
    """Every drawn problem's group after its first turn (the one starter of sync rollouts and episode evals;
    partial mode submits the same groups, `reset_group`, and opens them as they finish): one `generate` call,
    `settings.group_size` forks of each group's prompt sampled from `seeds` (group k's fork j: seeds[k] + j).
    No problem: the call is made all the same (a rank of a lockstep engine takes part in the others' forwards)."""
    groups = [reset_group(factory, p, d, settings, tokenizer, env_cfg) for d, p in drawn]
    n = settings.group_size
    outs = engine.generate(input_ids=[prompt for _, prompt in groups],
                           sampling_params=[sampling_params(settings, seed) for seed in seeds] or None, n=n,
                           return_logprob=True, lora=lora, return_routed_experts=routes,
                           **kept_state_args(engine, env_cfg))
    bad = next((o for o in outs if "error" in o), None)
    if bad is not None:
        ids = [o["meta_info"]["state_id"] for o in outs if "state_id" in o.get("meta_info", {})]
        if ids:
            engine.release_states(ids)
        raise RuntimeError(f"rollout: the engine rejected a request: {bad['error']}")
    return [ep for k, ((envs, prompt), seed) in enumerate(zip(groups, seeds))
            for ep in open_episodes(envs, prompt, seed, outs[k * n:(k + 1) * n])]


def keeps_state(engine, env_cfg: EnvConfig) -> bool:
    """Whether episodes keep their state in the engine between turns (multi-turn, env.keep_state, an engine that
    keeps state: `capabilities.keeps_state`)."""
    return env_cfg.max_turns > 1 and env_cfg.keep_state and engine.capabilities.keeps_state


def kept_state_args(engine, env_cfg: EnvConfig) -> dict:
    """The first turn's `generate` arguments for kept state ({} when episodes recompute every turn)."""
    return {"keep_state": True} if keeps_state(engine, env_cfg) else {}


def context_limit(engine, env_cfg: EnvConfig) -> int:
    """An episode's tokens at most: env.max_total_tokens within the engine's context (0 for one turn: the first
    turn's request was checked by the engine)."""
    if env_cfg.max_turns == 1:
        return 0
    return min(env_cfg.max_total_tokens or engine.max_context, engine.max_context)


def run_turns(engine, tokenizer, episodes: list[Episode], cfg, env_cfg: EnvConfig, lora, routes: bool,
              ctx: ParallelContext = SINGLE) -> None:
    """Steps every episode's environment after its first turn (already added) and runs further turns until every
    episode has ended, on every rank (see the module docstring). Every episode's kept state is released when it
    ends (and all of them if this raises)."""
    limit = context_limit(engine, env_cfg)
    keep = keeps_state(engine, env_cfg)
    try:
        for turn in range(1, env_cfg.max_turns + 1):
            live = [ep for ep, go in zip(episodes, step_episodes(episodes, tokenizer, env_cfg, limit, ctx)) if go]
            _close(engine, [ep for ep in episodes if ep.end])
            if turn == env_cfg.max_turns:
                break
            if not (max_over([float(len(live))], world_of(ctx))[0] if ctx.distributed else live):
                break  # no episode left on any rank
            params = [sampling_params(cfg, turn_seed(ep.seed, turn), min(cfg.max_new_tokens, limit - ep.length))
                      for ep in live]
            more = {"keep_state": True, "states": [ep.state_id for ep in live]} if keep else {}
            outs = engine.generate(input_ids=[ep.prompt + ep.ids for ep in live], sampling_params=params or None,
                                   n=1, return_logprob=True, lora=lora, return_routed_experts=routes, **more)
            bad = next((o for o in outs if "error" in o), None)
            if bad is not None:
                raise RuntimeError(f"rollout: the engine rejected a turn: {bad['error']}")
            for ep, out in zip(live, outs):
                ep.add_turn(out)
    finally:
        _close(engine, episodes)


def _close(engine, episodes: list[Episode]) -> None:
    """Release the kept states of these episodes (their parked slots and pages freed)."""
    ids = [ep.state_id for ep in episodes if ep.state_id is not None]
    if ids:
        engine.release_states(ids)
    for ep in episodes:
        ep.state_id = None


class EnvStep:
    """One environment step, running from the moment it is made in a daemon thread of its own (a step that never
    returns holds no worker another step waits for, and does not keep the process alive), or, for an environment
    whose step is instant (`Environment.instant_step`: `single`), run here at once, its outcome kept. `outcome`
    waits for it until env.step_timeout_s after it started running."""

    def __init__(self, env: Environment, turn: str):
        self.env = env
        self._t0 = 0.0
        self._result: StepResult | tuple[str, str] = ("env_error", "no result")
        if env.instant_step:  # no thread, no events: 256 threads and their events cost ~20 ms a step on 2 cores
            self._ended = None
            self._result = self._step(turn)
            return
        self._started, self._ended = threading.Event(), threading.Event()
        threading.Thread(target=self._run, args=(turn,), name="env-step", daemon=True).start()

    def _run(self, turn: str) -> None:
        self._t0 = time.monotonic()
        self._started.set()
        self._result = self._step(turn)
        self._ended.set()

    def _step(self, turn: str) -> StepResult | tuple[str, str]:
        try:
            return self.env.step(turn)
        except Exception as e:  # noqa: BLE001 (an environment's bug ends its episode, not the run)
            return ("env_error", f"{type(e).__name__}: {e}")

    def outcome(self, timeout_s: float) -> StepResult | tuple[str, str]:
        """The step's StepResult, ("env_error", what it raised), or ("env_timeout", "") when it has not ended
        `timeout_s` seconds after it started; then it is cancelled (`Environment.cancel`) and whatever it returns
        later is discarded. Plain values: a TP group broadcasts them."""
        if self._ended is None:  # an instant step: ended when it was made
            return self._result
        self._started.wait()
        if self._ended.wait(max(0.0, self._t0 + timeout_s - time.monotonic())):
            return self._result
        try:
            self.env.cancel()
        except Exception as e:  # noqa: BLE001 (the episode ends either way)
            log.warning("env: cancelling a step that ran past env.step_timeout_s raised %s: %s", type(e).__name__, e)
        return ("env_timeout", "")


def steps_envs(ctx: ParallelContext) -> bool:
    """Whether this rank steps the environments: under tensor parallelism the TP group's first rank only."""
    return ctx.tp_size == 1 or ctx.tp_group is None or ctx.tp_rank == 0


def start_steps(episodes: list[Episode], tokenizer, ctx: ParallelContext = SINGLE) -> list[EnvStep | None]:
    """Each live episode's environment step on its last turn, started at once (None for an ended episode, and for
    every episode on a rank that does not step the environments)."""
    here = steps_envs(ctx)
    return [EnvStep(ep.env, response_text(tokenizer, ep.outs[-1])) if here and not ep.end else None
            for ep in episodes]


def step_episodes(episodes: list[Episode], tokenizer, env_cfg: EnvConfig, limit: int, ctx: ParallelContext = SINGLE,
                  steps: list[EnvStep | None] | None = None) -> list[bool]:
    """The environments' answers to the episodes' last turns (`steps`, as `start_steps` started them; None: started
    here), applied (`apply_outcome`; those already ended stay ended): True for each episode that goes on to another
    turn. Under tensor parallelism only the TP group's first rank steps the environments; one broadcast gives the
    group's other ranks its outcomes, which they apply as their own."""
    tp = ctx.tp_size > 1 and ctx.tp_group is not None
    outcomes = None
    if steps_envs(ctx):
        steps = start_steps(episodes, tokenizer, ctx) if steps is None else steps
        outcomes = [None if st is None else st.outcome(env_cfg.step_timeout_s) for st in steps]
    if tp:
        outcomes = broadcast(outcomes, ctx.tp_group)
    return [not ep.end and apply_outcome(ep, o, tokenizer, env_cfg, limit) for ep, o in zip(episodes, outcomes)]


def apply_outcome(ep: Episode, res: StepResult | tuple[str, str], tokenizer, env_cfg: EnvConfig, limit: int) -> bool:
    """The episode after its environment's step `res` on its last turn (`EnvStep.outcome`): the observation
    appended, or its end; True when it goes on to another turn."""
    if isinstance(res, tuple):
        ep.end = res[0]
        if ep.end == "env_timeout":
            log.warning("env=%s: a step ran past env.step_timeout_s=%s; its episode ends (env/timeout_rate)",
                        env_cfg.name, env_cfg.step_timeout_s)
        else:
            log.warning("env=%s: a step raised %s; its episode ends (env/error_rate)", env_cfg.name, res[1])
        return False
    ep.steps.append(res)
    for k, v in res.info.items():
        ep.info[k] = ep.info.get(k, 0.0) + float(v)
    if res.done:
        ep.graded = res.reward is None
        ep.reward += 0.0 if res.reward is None else float(res.reward)
        ep.end = "done"
        return False
    ep.reward += float(res.reward or 0.0)
    if len(ep.outs) == env_cfg.max_turns:
        ep.end = "max_turns"
        return False
    obs = res.observation
    obs_ids = list(obs) if isinstance(obs, list) else tokenizer.encode(obs, add_special_tokens=False)
    if ep.length + len(obs_ids) >= limit:  # no room for the observation and one more token
        ep.end = "context"
        return False
    ep.ids += obs_ids
    ep.mask += [0] * len(obs_ids)
    return True


def engine_counts(engine) -> dict[str, float]:
    """The native engine's prefill and kept-state counters now ({} for an engine that keeps no state, so has none):
    `env_totals` takes the difference over a step's rollouts."""
    if not engine.capabilities.keeps_state:
        return {}
    stats = engine.kept_state_stats
    return {"env_prefill_tokens": float(stats["prefill_tokens"]), "env_kept_tokens": float(stats["kept_tokens"]),
            "env_recomputed_turns": float(stats["recomputed"]), "env_restored_turns": float(stats["restored"])}


def env_totals(episodes: list[Episode], before: dict[str, float] | None = None,
               after: dict[str, float] | None = None) -> dict[str, float]:
    """Sums for the env/ metrics (summed over replicas before they are divided); `before` / `after`: the engine's
    counters around the rollouts (`engine_counts`)."""
    out = {"env_episodes": float(len(episodes)),
           "env_turns": float(sum(ep.turns or len(ep.outs) for ep in episodes))}
    out |= {k: after[k] - before[k] for k in (before or {})}
    for reason in END_REASONS:
        out[f"env_end_{reason}"] = float(sum(ep.end == reason for ep in episodes))
    return out


def env_metrics(t: dict[str, float], info: dict[str, float]) -> dict[str, float]:
    """env/ metrics from the (global) sums: turns per episode, how episodes ended, and the environment's info
    numbers per episode."""
    n = max(t["env_episodes"], 1.0)
    out = {"env/turns_mean": t["env_turns"] / n, "env/error_rate": t["env_end_env_error"] / n,
           "env/timeout_rate": t["env_end_env_timeout"] / n, "env/max_turns_rate": t["env_end_max_turns"] / n,
           "env/context_rate": t["env_end_context"] / n}
    if "env_prefill_tokens" in t:
        out |= {"env/prefill_tokens_mean": t["env_prefill_tokens"] / n, "env/kept_tokens_mean": t["env_kept_tokens"] / n,
                "env/recomputed_turns_mean": t["env_recomputed_turns"] / n,
                "env/restored_turns_mean": t["env_restored_turns"] / n}
    return out | {f"env/{k}": v / n for k, v in info.items()}
