"""`rollout.mode=partial`: rollouts that run across weight updates, with bounded staleness.

The engine keeps `rollout.partial.inflight_groups` GRPO groups in flight in its partial queue (`engine.queue`:
`rollout.api.PartialQueue`, the native engine's `rollout/partial_queue.py`; its `submit` / `run`). Each
step tops the pool up from the prompt stream, runs the engine until `prompts_per_step` groups have finished, and
trains on the groups that finished; the engine pauses the others (their state slots and latent pages are freed, so
the engine's memory can be released for the train step) and the next step continues them under the adapter the
push brought, recomputing their prompt and tokens so far first (SGLang's "retract"). Every token records the
weight version that sampled it (`Sample.token_versions`). With `rollout.partial.refill` (single-turn groups) each
group that finishes within the run queues the next draw at once, so the pool stays full while the engine decodes
instead of draining to the groups' slowest samples.

A sample's staleness when trained is the trainer's version minus its oldest token's. `max_staleness` bounds it, by
`policy`:
* wait: a group in flight at the bound holds the step until it finishes (the engine admits in queue order, so the
  groups in flight run before the new ones, which take the slots left);
* drop: a group that can no longer finish within the bound is cancelled at the start of the step and its prompt
  queued again with fresh sampling seeds (`seeds.retry_seed` of its draw and its retry count, which the checkpoint
  keeps), so a long trajectory is not regrown token for token; it never reaches the loss;
* keep: no bound: every group is trained, its stale tokens importance weighted (trainer.loss.tis).
The bound is enforced with a group's version when it was queued: its first token is that version or newer.

The loss (decoupled PPO): the ratio is taken against the trainer's log-probs at the start of the step (the
proximal policy: `trainer.old_logprobs=recompute`), and the TIS weight exp(proximal - engine) corrects each token
for the adapter that actually sampled it; config validation requires both (`config_checks.check_partial`).

Data parallel (`ctx.dp_size` > 1): each replica keeps its own pool of ceil(inflight_groups / dp) groups and its
step ends when prompts_per_step / dp of them have finished (its share of the global batch; launch checks that dp
divides prompts_per_step). Replica r draws every dp-th prompt of the global stream (draws r, r + dp, ...; the
sampling seeds come from the global draw index), so the replicas never draw the same prompt and need not agree on
how many each draws. Under tensor parallelism the ranks of a replica hold identical pools and stop at the same
decode step by construction; under expert parallelism across replicas a replica that has finished its share runs
idle forwards for the others (`parallel.lockstep`) until every replica's run ends. The kept groups' indices
(`Sample.group`) and the rollout/ metrics are global, as in the synchronous loop.

Every group is played as episodes, single-turn ones too (the `single` environment: one turn, graded by the run's
reward), as in rollout.mode=sync: a group's first turn is submitted as its `group_size` forks; when it finishes its
episodes open (`episodes.open_episodes`), their environments step, and each later turn joins the queue the engine's
run is serving. Scoring and the rollout/ metrics are `scoring.py`'s.

`state()` / `load_state()` (`sources.RolloutSource`): the pool (each group's prompt, draw index and problem, the
version it was queued at; multi-turn: each episode in flight with its environment's answers so far), this replica's
prompt stream and the engine's queue (tokens so far, their log-probs, versions and routes, sampling keys), for a
checkpoint from which `resume=auto` continues the run exactly. A resumed episode's environment is reset and told its
recorded answers (`Environment.replay`); none of its steps runs twice. A sync run's state (no groups in flight)
continues with an empty pool.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from miles_k3.envs.env import StepResult
from miles_k3.evals.problems import Problem
from miles_k3.evals.templates import response_text
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import gather, max_over, sum_over, world_of
from miles_k3.rollout.api import PartialQueue
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.checkpoint_files import ResumeError
from miles_k3.trainer.episodes import (
    SINGLE_ENV,
    EnvStep,
    Episode,
    context_limit,
    engine_counts,
    env_metrics,
    env_totals,
    keeps_state,
    kept_state_args,
    multi_turn,
    open_episodes,
    reset_group,
    start_steps,
    step_episodes,
)
from miles_k3.trainer.rollouts import RolloutConfig, reward_metrics
from miles_k3.trainer.scoring import (
    env_info,
    is_flat,
    member_advantages,
    rollout_metrics,
    rollout_totals,
    score_episodes,
)
from miles_k3.trainer.seeds import retry_seed, sampling_params, turn_seed
from miles_k3.trainer.staleness import check_versions, length_bias, p90

log = logging.getLogger("miles_k3.train")


@dataclass
class _Group:
    draw: int  # the prompt's index in the stream since the run began: its sampling seeds
    problem: Problem
    prompt: list[int]
    queued_at: int  # the trainer's weight version when it was queued
    retry: int = 0  # policy drop: how many times its prompt was dropped before (its sampling seeds: `retry_seed`)
    envs: list = field(default_factory=list)  # each episode's environment
    episodes: list[Episode] | None = None  # the group's episodes, once their first turn finished


class PartialRollouts:
    """The pool of groups in flight in `engine` and one step's rollouts from it (`collect`): rollout.mode=partial as
    a `RolloutSource`."""

    mode = "partial"

    def __init__(self, engine, tokenizer, stream, reward_fn, cfg: RolloutConfig, lora: str | None,
                 routes: bool = False, ctx: ParallelContext = SINGLE, env=None):
        self.engine, self.tokenizer, self.stream, self.reward_fn = engine, tokenizer, stream, reward_fn
        self.queue: PartialQueue = engine.queue  # config validation: an engine with `capabilities.partial_queue`
        self.cfg, self.lora, self.routes, self.ctx = cfg, lora, routes, ctx
        self.env = env or SINGLE_ENV  # (factory, EnvConfig) of the episodes
        self.multi = multi_turn(self.env[0])
        self.turns: dict[int, tuple[int, int]] = {}  # multi-turn: engine group of a later turn -> (group, episode)
        self.share = cfg.prompts_per_step // ctx.dp_size  # groups this replica finishes per step
        self.inflight = -(-cfg.partial.groups(cfg.prompts_per_step) // ctx.dp_size)  # groups this replica keeps
        self.groups: dict[int, _Group] = {}  # engine group id -> the group, in the order they were queued

    def collect(self, version: int) -> tuple[list[Sample], dict[str, float]]:
        """The step's samples (the finished groups, trained by the adapter of weight `version`) and its rollout/
        metrics; RuntimeError when a sample breaks the staleness rule (`check_versions`)."""
        pc = self.cfg.partial
        dropped = self._drop(version) if pc.policy == "drop" else []
        self._top_up(version, [(g.draw, g.problem, g.retry + 1) for g, _ in dropped])
        due = self._due(version) if pc.policy == "wait" else []  # max_staleness=0: the new groups too
        before = engine_counts(self.engine)
        finished = self._run_episodes(self.share, due, version)
        samples, metrics = self._episode_samples(finished, dropped, version, before)
        check_versions(samples, version, self.cfg)
        return samples, metrics | self._retract_metrics() | self._wait_metrics()

    # ---- the pool -------------------------------------------------------------------------------------------
    def _due(self, version: int) -> list[int]:
        return [gid for gid, g in self.groups.items() if version - g.queued_at >= self.cfg.partial.max_staleness]

    def _drop(self, version: int) -> list[tuple[_Group, list[int]]]:
        """Cancel the groups that could only be trained past the bound: a group's first turn (its forks, still
        queued) or its episodes' turns in flight, and their kept states; (group, its samples' lengths so far)."""
        late = [gid for gid, g in self.groups.items() if version - g.queued_at > self.cfg.partial.max_staleness]
        if not late:
            return []
        starting = [key for key in late if self.groups[key].episodes is None]
        lengths = self._lengths(starting) if starting else {}
        turns = [gid for gid, (key, _) in self.turns.items() if key in late]
        self.queue.cancel(starting + turns)  # all queued: a first turn or a turn that finished has left the lists
        for gid in turns:
            del self.turns[gid]
        out = []
        for key in late:
            g = self.groups.pop(key)
            if g.episodes is None:
                out.append((g, lengths.get(key, [])))
                continue
            states = [ep.state_id for ep in g.episodes if ep.state_id is not None]
            if states:
                self.engine.release_states(states)
            out.append((g, [len(ep.ids) for ep in g.episodes]))
        return out

    def _lengths(self, gids: list[int]) -> dict[int, list[int]]:
        """Each queued group's samples' response lengths so far."""
        wanted, out = set(gids), {}
        for req in self.queue.queue_state()["requests"]:
            if req["group"] in wanted:
                out.setdefault(req["group"], []).append(len(req["output"]))
        return out

    def _top_up(self, version: int, again: list[tuple[int, Problem, int]]) -> None:
        """Queue groups until `inflight_groups` are in flight: the dropped prompts first (draw, problem, retry),
        then new draws."""
        want = self.inflight - len(self.groups)
        drawn = again + ([(d, p, 0) for d, p in self._take(want - len(again))] if want > len(again) else [])
        self._queue_groups(version, drawn)

    def _queue_groups(self, version: int, drawn: list[tuple[int, Problem, int]]) -> None:
        """Submit a group of `group_size` samples for each (draw, problem, retry), queued under `version`."""
        if not drawn:
            return
        cfg, (factory, env_cfg) = self.cfg, self.env
        starts = [reset_group(factory, p, d, cfg, self.tokenizer, env_cfg) for d, p, _ in drawn]
        params = [sampling_params(cfg, self._seed(d, r)) for d, _, r in drawn]
        gids = self.queue.submit(input_ids=[prompt for _, prompt in starts], sampling_params=params,
                                 n=cfg.group_size, lora=self.lora, return_routed_experts=self.routes,
                                 **kept_state_args(self.engine, env_cfg))
        for gid, (d, p, r), (envs, prompt) in zip(gids, drawn, starts):
            self.groups[gid] = _Group(d, p, prompt, version, r, envs)

    def _seed(self, draw: int, retry: int) -> int:
        """The sampling seed of draw `draw`'s group after `retry` drops of its prompt (fork j: this + j)."""
        return retry_seed(self.cfg.seed, draw, self.cfg.group_size, retry)

    def _take(self, k: int) -> list[tuple[int, Problem]]:
        """This replica's next k prompts: every dp-th of the global stream, from draw dp_rank on."""
        dp, r = self.ctx.dp_size, self.ctx.dp_rank
        return self.stream.take(k) if dp == 1 else [self.stream.take(dp)[r] for _ in range(k)]

    # ---- episodes --------------------------------------------------------------------------------------------
    def _run_episodes(self, share: int, due: list[int], version: int) -> list[_Group]:
        """Serve the pool until `share` groups have finished every episode (and every group of `due` has): a turn
        that finishes is handed to its environment at once, and the episode's next turn joins the queue being
        served. The groups finished, in order. With one turn per episode (env.max_turns 1: no turn follows
        another) the engine stops by its own count of finished groups, and their environments step after it.

        The environments of finished turns step in threads of their own (`EnvStep`), started as the turns finish
        (`on_finished`), while the engine decodes on: a turn finished in decode step t is applied (its step's
        outcome waited for, then its next turn queued) after decode step t + rollout.partial.env_lag_steps, in the
        order the turns finished; when nothing is left to decode, the earliest turns are applied at once; when the
        step's groups have finished, every turn still stepping is applied before the run ends (its next turn waits
        in the queue for the next step). Decode steps, not the steps' timing, decide when a turn's next turn joins
        the queue, so the samples are the same however long the environments take."""
        env_cfg = self.env[1]
        limit, lag = context_limit(self.engine, env_cfg), self.cfg.partial.env_lag_steps
        done: list[int] = []
        pending: list[tuple[int, int, int, EnvStep | None]] = []  # (due tick, group, episode, its step), in order
        tick = 0  # the engine's stop checks so far: one before its first decode step, then one after each (a turn
        # that finishes in decode step k is seen at tick k and applied at the check after step k + lag)

        def apply(last_tick: float) -> None:
            """Apply the pending turns due by `last_tick`: a prefix of `pending` (its due ticks never decrease)."""
            k = sum(1 for p in pending if p[0] <= last_tick)
            if k:
                items = pending[:k]
                del pending[:k]
                self._advance([item[1:] for item in items], limit, done)

        def until() -> bool:
            nonlocal tick
            tick += 1
            apply(tick)
            while pending and not self._queued():  # nothing to decode: the earliest turns now (the run ends
                apply(pending[0][0])  # only with none stepping: one run a step)
            if len(done) < share or any(k not in done for k in due):
                return False
            apply(math.inf)  # turns still stepping: applied now, their next turns queued for the next step
            return True

        def on_finished(gid: int, records: list[dict]) -> None:
            bad = next((r for r in records if "error" in r), None)
            if bad is not None:
                raise RuntimeError(f"rollout: the engine rejected a request: {bad['error']}")
            if gid in self.turns:
                key, j = self.turns.pop(gid)
                self.groups[key].episodes[j].add_turn(records[0])
                js = [j]
            else:  # a group's first turn: its episodes begin
                g, key = self.groups[gid], gid
                g.episodes = open_episodes(g.envs, g.prompt, self._seed(g.draw, g.retry), records)
                js = list(range(len(records)))
            eps = [self.groups[key].episodes[j] for j in js]
            steps = start_steps(eps, self.tokenizer, self.ctx)
            pending.extend((tick + 1 + lag, key, j, st) for j, st in zip(js, steps))

        self.env_wait_s = 0.0  # this step's: how long the engine's run waited for environment steps
        if env_cfg.max_turns == 1:
            for gid, records in self._run_single(share, due, version):
                on_finished(gid, records)
            apply(math.inf)
        else:
            self.queue.run(until=until, on_finished=on_finished)
        return [self.groups.pop(k) for k in done]

    def _run_single(self, share: int, due: list[int], version: int) -> list[tuple[int, list[dict]]]:
        """One-turn groups: the engine's run until `share` groups (and every group of `due`) have finished; the
        groups finished, in order. rollout.partial.refill: each group that finishes queues a new draw at once
        (under the version being served), so the pool keeps inflight_groups in flight through the run."""
        if not self.cfg.partial.refill:
            return self.queue.run(finished_groups=share, must_finish=due)
        finished: list[tuple[int, list[dict]]] = []

        def on_finished(gid: int, records: list[dict]) -> None:
            finished.append((gid, records))
            self._queue_groups(version, [(d, p, 0) for d, p in self._take(1)])

        def until() -> bool:
            ids = {gid for gid, _ in finished}
            return len(finished) >= share and all(k in ids for k in due)

        self.queue.run(until=until, on_finished=on_finished)
        return finished

    def _queued(self) -> bool:
        """Whether the engine's queue holds a turn: a group's first turn not finished, or a later turn."""
        return bool(self.turns) or any(g.episodes is None for g in self.groups.values())

    def _advance(self, pending: list[tuple[int, int, EnvStep | None]], limit: int, done: list[int]) -> None:
        """The episodes of `pending` after a turn: their environments' steps applied (waited for: env_wait_s), then
        each one's next turn queued, or its end; a group whose episodes have all ended joins `done`."""
        cfg, eps = self.cfg, [self.groups[key].episodes[j] for key, j, _ in pending]
        t0 = time.perf_counter()
        go = step_episodes(eps, self.tokenizer, self.env[1], limit, self.ctx, [st for _, _, st in pending])
        self.env_wait_s += time.perf_counter() - t0
        for (key, j, _), ep, more_turns in zip(pending, eps, go):
            if not more_turns:
                if ep.state_id is not None:
                    self.engine.release_states([ep.state_id])
                    ep.state_id = None
            else:
                params = sampling_params(cfg, turn_seed(ep.seed, len(ep.outs)),
                                         min(cfg.max_new_tokens, limit - ep.length))
                more = {"keep_state": True, "states": [ep.state_id]} if keeps_state(self.engine, self.env[1]) else {}
                (gid,) = self.queue.submit([ep.prompt + ep.ids], params, n=1, lora=self.lora,
                                           return_routed_experts=self.routes, **more)
                self.turns[gid] = (key, j)
            if key not in done and all(e.end for e in self.groups[key].episodes):
                done.append(key)

    # ---- samples and metrics --------------------------------------------------------------------------------
    def _episode_samples(self, finished: list[_Group], dropped, version: int, before: dict
                         ) -> tuple[list[Sample], dict]:
        """The finished groups' episodes scored (`scoring.score_episodes`), their kept groups' samples and the
        step's rollout/ metrics (and env/ ones for an environment other than single)."""
        episodes = [ep for g in finished for ep in g.episodes]
        golds = [g.problem.answer for g in finished for _ in g.episodes]
        samples, outcomes = score_episodes(episodes, golds, self.reward_fn, self.cfg, self.tokenizer)
        n = self.cfg.group_size
        groups = [samples[i:i + n] for i in range(0, len(samples), n)]
        out, metrics = self._finish(groups, outcomes, finished, dropped, version)
        if not self.multi:
            return out, metrics
        local = env_totals(episodes, before, engine_counts(self.engine))
        totals = dict(zip(local, sum_over(list(local.values()), self.ctx.dp_group)))
        return out, metrics | env_metrics(totals, env_info(episodes, self.ctx.dp_group))

    def _finish(self, groups, outcomes, finished, dropped, version: int) -> tuple[list[Sample], dict[str, float]]:
        """The step's kept groups with their advantages, and the rollout/ metrics."""
        cfg = self.cfg
        flat = [is_flat(group) for group in groups]
        kept = [group for group, f in zip(groups, flat) if not (cfg.dynamic_sampling and f)]
        index = self._global_index(len(kept))
        for i, group in zip(index, kept):
            for s, a in zip(group, member_advantages(group, cfg.advantage)):
                s.advantage, s.group = a, i
        samples = [s for group in kept for s in group]
        local = rollout_totals(groups, outcomes)
        totals = dict(zip(local, sum_over(list(local.values()), self.ctx.dp_group)))
        num_kept, num_groups, num_flat = sum_over([len(kept), len(groups), sum(flat)], self.ctx.dp_group)
        counts = {"groups_kept": int(num_kept), "groups_drawn": max(int(num_groups), 1), "rounds": 1,
                  "flat": int(num_flat)}
        metrics = rollout_metrics(totals, counts) if totals["samples"] else {}
        return samples, metrics | self._partial_metrics(samples, groups, finished, dropped, version) | \
            reward_metrics(self.reward_fn, self.ctx)

    def _retract_metrics(self) -> dict[str, float]:
        """What the stop's retract cost and saved: the requests retracted and the tokens of state the next step
        recomputes for them (all replicas), and the MiB their slots and pages held on the fullest rank, which keeping
        them resident through the train step would have kept allocated."""
        r = self.queue.retracted
        requests, tokens = sum_over([r.requests, r.tokens], self.ctx.dp_group)
        (nbytes,) = max_over([r.bytes], world_of(self.ctx))
        return {"rollout/retracted_requests": requests, "rollout/reprefill_tokens": tokens,
                "rollout/retracted_mib": nbytes / 2**20}

    def _wait_metrics(self) -> dict[str, float]:
        """Multi-turn: perf/env_wait_s, how long the engine's run waited for environment steps (the longest of
        the ranks): a step still running rollout.partial.env_lag_steps decode steps after its turn finished."""
        if not self.multi:
            return {}
        (wait,) = max_over([self.env_wait_s], world_of(self.ctx))
        return {"perf/env_wait_s": wait}

    def _global_index(self, n: int) -> list[int]:
        """The indices among the step's kept groups of all replicas of this replica's `n` kept groups: the replicas'
        groups interleaved (first groups of replicas 0..dp-1, then second groups, ...), so that minibatches of
        consecutive indices draw on every replica."""
        dp, r = self.ctx.dp_size, self.ctx.dp_rank
        if dp == 1:
            return list(range(n))
        marks = [0.0] * dp
        marks[r] = float(n)
        return interleaved_index([int(x) for x in sum_over(marks, self.ctx.dp_group)], r)

    def _partial_metrics(self, samples, groups, finished, dropped, version: int) -> dict[str, float]:
        """rollout/ staleness, off-policy share, drops and the length bias, over every replica's groups."""
        bound = self.cfg.partial.max_staleness
        trained = [s for s in samples if s.in_loss]
        mine = {"stale": [version - min(s.token_versions) for s in trained if s.token_versions],
                "tokens": sum(len(s.token_versions) for s in trained),
                "offpolicy": sum(v < version for s in trained for v in s.token_versions),
                "lengths": [len(s.response_ids) for s in trained],
                "every": [len(s.response_ids) for group in groups for s in group],
                "dropped": [lens for _, lens in dropped],
                "carried": sum(g.queued_at < version for g in finished), "inflight": len(self.groups),
                "refilled": len(finished) if self.cfg.partial.refill else 0,  # one new group per finished one
                "again": sum(g.retry > 0 for g, _ in dropped), "retried": sum(g.retry > 0 for g in finished),
                "drops": [g.retry for g in finished] + [g.retry + 1 for g, _ in dropped]}
        parts = gather(mine, self.ctx.dp_group)
        stale, lengths, every, dropped, drops = ([x for part in parts for x in part[k]]
                                                 for k in ("stale", "lengths", "every", "dropped", "drops"))
        tokens, offpolicy = sum(part["tokens"] for part in parts), sum(part["offpolicy"] for part in parts)
        bias, rank = length_bias(every, [n for lens in dropped if any(lens) for n in lens])  # begun groups only
        out = {"rollout/staleness_mean": sum(stale) / len(stale) if stale else 0.0,
               "rollout/staleness_max": float(max(stale, default=0)),
               "rollout/offpolicy_token_frac": offpolicy / tokens if tokens else 0.0,
               "rollout/groups_dropped": float(len(dropped)),
               "rollout/drop_len_bias": bias, "rollout/drop_len_rank": rank,
               "rollout/groups_dropped_again": float(sum(part["again"] for part in parts)),
               "rollout/groups_retried": float(sum(part["retried"] for part in parts)),
               "rollout/drops_max": float(max(drops, default=0)),
               "rollout/groups_carried": float(sum(part["carried"] for part in parts)),
               "rollout/groups_inflight": float(sum(part["inflight"] for part in parts)),
               "rollout/groups_refilled": float(sum(part["refilled"] for part in parts)),
               "rollout/trained_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
               "rollout/trained_len_p90": float(p90(lengths)),
               "rollout/finished_len_mean": sum(every) / len(every) if every else 0.0,
               "rollout/finished_len_p90": float(p90(every))}
        for k in range(bound + 1):
            out[f"rollout/staleness_frac_{k}"] = sum(x == k for x in stale) / len(stale) if stale else 0.0
        if self.cfg.partial.policy == "keep":
            out["rollout/staleness_frac_over"] = sum(x > bound for x in stale) / len(stale) if stale else 0.0
        return out

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """The pool and the engine's queue, as plain data and host tensors (torch.save, weights_only loads)."""
        groups = [{"group": gid, "draw": g.draw, "id": g.problem.id, "problem": g.problem.problem,
                   "answer": g.problem.answer, "prompt": list(g.prompt), "queued_at": g.queued_at, "retry": g.retry}
                  | ({"episodes": None if g.episodes is None else [_episode_state(ep) for ep in g.episodes]}
                     if self.multi else {})
                  for gid, g in self.groups.items()]
        out = {"mode": self.mode, "groups": groups, "stream": self.stream.state(), "engine": self.queue.queue_state()}
        if self.multi:
            out["turns"] = [[gid, key, j] for gid, (key, j) in self.turns.items()]
        return out

    def load_state(self, state: dict) -> None:
        """Continue the pool of `state()`; a sync run's state (no rollouts in flight) starts an empty pool at its
        prompt stream's position."""
        if state["mode"] == "sync":
            log.info("resume: the checkpoint was written by a rollout.mode=sync run; continuing as partial with no "
                     "rollouts in flight")
            self.stream.load_state(state["stream"])
            return
        if state["mode"] != self.mode:
            raise ResumeError(f"written by a rollout.mode={state['mode']} run, which rollout.mode=partial cannot "
                              f"continue; resume with rollout.mode={state['mode']}, or start a new run_dir")
        self.groups = {int(g["group"]): _Group(int(g["draw"]), Problem(g["id"], g["problem"], g["answer"]),
                                               [int(t) for t in g["prompt"]], int(g["queued_at"]),
                                               int(g.get("retry", 0)))  # 0: saved before retries were counted
                       for g in state["groups"]}
        if "stream" in state:  # this replica's stream (under dp > 1 the replicas' positions differ)
            self.stream.load_state(state["stream"])
        if self.multi != ("turns" in state):
            raise ValueError("rollout state: saved with env=" + ("single" if "turns" not in state else "a multi-turn "
                             "environment") + f", resumed with env={self.env[1].name}; resume with the saved env")
        for g, saved in zip(self.groups.values(), state["groups"]):
            self._restore_episodes(g, saved.get("episodes"))  # single-turn groups: saved before their first turn ended
        if self.multi:
            self.turns = {int(gid): (int(key), int(j)) for gid, key, j in state["turns"]}
        self.queue.load_queue_state(state["engine"])

    def close(self) -> None:
        """Nothing to stop: the engine, and the groups it holds, are the run's."""

    def _restore_episodes(self, g: _Group, saved: list[dict] | None) -> None:
        """A group's environments rebuilt: reset as at its draw, then (each live episode of a multi-turn group) told
        the answers it gave to its turns so far (`Environment.replay`, from the checkpoint): no step runs again, so no
        tool call or program a turn wrote is repeated."""
        g.envs, prompt = reset_group(self.env[0], g.problem, g.draw, self.cfg, self.tokenizer, self.env[1])
        if prompt != g.prompt:
            raise ValueError(f"rollout state: env={self.env[1].name} gives problem {g.problem.id} another first "
                             "prompt than the saved one; its environment is not deterministic")
        if saved is None:
            return
        g.episodes = [_episode_from_state(d, env) for d, env in zip(saved, g.envs)]
        for ep in g.episodes:
            if not ep.end:
                for out, res in zip(ep.outs, ep.steps, strict=True):
                    ep.env.replay(response_text(self.tokenizer, out), res)


_EPISODE_FIELDS = ("prompt", "seed", "outs", "starts", "ids", "mask", "reward", "graded", "end", "info", "state_id")


def _episode_state(ep: Episode) -> dict:
    """An episode in flight as plain data and host tensors (its engine records as they are, and its environment's
    answers: `steps`)."""
    return {k: getattr(ep, k) for k in _EPISODE_FIELDS} | {"steps": [
        {"observation": r.observation, "reward": r.reward, "done": r.done, "info": dict(r.info)} for r in ep.steps]}


def _episode_from_state(d: dict, env) -> Episode:
    if "steps" not in d:
        raise ValueError("rollout state: a multi-turn episode in flight was saved without its environment's answers "
                         "(a checkpoint of before they were kept); resuming it would run its environment's steps "
                         "again: start a new run (resume=none, or another run_dir) from its adapter")
    steps = [StepResult(r["observation"], r["reward"], r["done"], dict(r["info"])) for r in d["steps"]]
    saved = {"state_id": d.get("session")} | d  # "session": the kept state's id, as checkpoints before the rename say
    return Episode(env, **{k: saved[k] for k in _EPISODE_FIELDS}, steps=steps)


def interleaved_index(counts: list[int], r: int) -> list[int]:
    """Replica r's groups' indices when replica q contributes counts[q] groups and the groups are numbered round by
    round (every replica's first group, in replica order, then every second group, ...)."""
    return [sum(min(c, i) for c in counts) + sum(c > i for c in counts[:r]) for i in range(counts[r])]
