"""`rollout.mode=fleet`: the rollouts of a fleet of engine actors on Ray (`rollout.fleet.EngineFleet`), as a
`sources.RolloutSource`, with the partial-mode rules (trainer/partial.py) carried over.

The pool: `rollout.partial.inflight_groups` GRPO groups not trained yet, numbered by a group id in the order they
were queued. Queued groups are sent in calls (a batch of groups, one `generate` on one engine) under the adapter
the fleet serves at that moment, so every group is sampled under one version and each of its tokens records it
(`Sample.token_versions`), with the engine's log-probs for the decoupled correction (`trainer.old_logprobs=
recompute` and TIS, as in partial mode). A step (`collect(version)`):

1. pushes the trainer's adapter of `version` into Ray's object store once; every engine loads it in place after
   the calls it holds and acknowledges it with (version, checksum), checked against what was pushed;
2. policy drop: drops the groups sampled more than rollout.partial.max_staleness versions ago (their prompts
   queued again, same sampling seeds); tops the pool up from the prompt stream and sends the queued groups, split
   into one call per engine;
3. waits for the groups it trains: the prompts_per_step oldest (lowest ids), and, policy wait, every group at the
   bound (one that could not be trained next step); which groups a step trains never depends on timing, so a run
   is deterministic and a resumed one continues exactly;
4. scores them as partial mode does (`scoring.py`), then, with max_staleness >= 1 (or policy keep), tops the pool
   up and sends the new calls under `version` before returning: the engines sample while the trainer trains, and
   those groups are trained at the next step, one version behind.

An engine's death loses nothing: the calls it held come back from the fleet as lost, their groups (same ids) are
queued again and sent at once to the engines that are up, under the newest adapter; a group's result is accepted
only from the call it was last sent in, and a group leaves the pool when it is trained, so none is trained twice.
rollout/fleet_* metrics count the deaths, the groups sent again and the tokens they sampled again.

`state()` / `load_state()`: the pool (each group's prompt stream draw, its records once its call came back), the
calls in flight (their payloads and versions, and those versions' adapter tensors, from the object store) and the
prompt stream. A resumed run first sends the saved calls again, as they were, under their saved versions (the same
tokens as the uninterrupted run), then pushes its own adapter. env=single only (validated: `check_fleet`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles_k3.evals.problems import Problem
from miles_k3.rollout.fleet import EngineFleet, FleetSpec
from miles_k3.rollout.fleet_actor import Fault
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.checkpoint_files import ResumeError
from miles_k3.trainer.episodes import SINGLE_ENV, multi_turn, open_episodes, reset_group, step_episodes
from miles_k3.trainer.rollouts import reward_metrics
from miles_k3.trainer.scoring import (
    is_flat,
    member_advantages,
    rollout_metrics,
    rollout_totals,
    score_episodes,
)
from miles_k3.trainer.seeds import group_seed, sampling_params
from miles_k3.trainer.staleness import check_versions

log = logging.getLogger("miles_k3.train")
FAULTS: dict[int, tuple[Fault, ...]] = {}
"""Chaos faults by engine index, given to the engines a FleetRollouts starts (tests set it; empty in runs)."""


@dataclass
class _Group:
    gid: int
    draw: int  # the prompt's index in the stream since the run began: its sampling seeds
    problem: Problem
    prompt: list[int]
    envs: list
    version: int | None = None  # the adapter version its call samples under (None: queued, not sent)
    call: int | None = None  # the call it was last sent in
    records: list | None = None  # its engine records, once that call came back
    requeued: bool = False  # sent again after an engine died with it


@dataclass
class _Call:
    gids: list[int]
    payload: dict
    version: int


def served_adapter(engine, name: str) -> Callable[[int], dict[str, torch.Tensor]]:
    """The trainer's adapter of a weight version, as the colocated native engine serves it after the loop's push
    (its buffers of adapter `name`); a RuntimeError when the engine serves another version."""

    def adapter(version: int) -> dict[str, torch.Tensor]:
        if engine.weight_version != version:
            raise RuntimeError(f"rollout.fleet: asked for adapter version {version}, the trainer's engine serves "
                               f"{engine.weight_version}")
        return engine.adapters.buffers(name)

    return adapter


def fleet_spec(fc) -> FleetSpec:
    """The EngineFleet of a `FleetConfig` (rollout.fleet)."""
    return FleetSpec(fc.engines, fc.cpus_per_engine, fc.gpus_per_engine, fc.max_restarts, fc.start_timeout_s)


class FleetRollouts:
    """rollout.mode=fleet as a `RolloutSource` (see the module docstring). `run_cfg`: the run config (the engines
    build its base; its rollout section is this producer's); `adapter(version)`: the trainer's adapter tensors of
    that version; `env`: (factory, EnvConfig), single only. The engines start here: one that fails to start stops
    the run with its error."""

    mode = "fleet"

    def __init__(self, run_cfg, adapter: Callable[[int], dict[str, torch.Tensor]], tokenizer, stream, reward_fn,
                 env=None, faults: dict[int, tuple[Fault, ...]] | None = None):
        self.cfg, self.adapter, self.tokenizer, self.stream = run_cfg.rollout, adapter, tokenizer, stream
        self.reward_fn, self.env = reward_fn, env or SINGLE_ENV
        if multi_turn(self.env[0]):
            raise ValueError(f"env={self.env[1].name}: rollout.mode=fleet plays single-turn groups only; use env=single "
                             "or rollout.mode=partial")
        self.inflight = self.cfg.partial.groups(self.cfg.prompts_per_step)
        self.groups: dict[int, _Group] = {}  # the pool, by group id (dict order: id order)
        self.calls: dict[int, _Call] = {}  # calls in flight
        self.next_gid = self.next_call = 0
        self.replay: dict[int, dict[str, torch.Tensor]] = {}  # a checkpoint's versions of its calls in flight
        self.trained: list[tuple[int, int]] = []  # (group id, prompt draw) of each group trained, in order
        self._step = {"requeued_groups": 0, "requeued_tokens": 0}
        self._seen = {"failovers": 0, "push_bytes": 0}
        self.fleet = EngineFleet(run_cfg, fleet_spec(self.cfg.fleet), FAULTS if faults is None else faults)
        self.fleet.start()

    def collect(self, version: int) -> tuple[list[Sample], dict[str, float]]:
        """The step's samples (trained by the adapter of weight `version`) and its rollout/ metrics; RuntimeError
        when a sample breaks the staleness rule (`staleness.check_versions`)."""
        pc = self.cfg.partial
        self._send_replay()
        if self.fleet.version != version:
            self.fleet.push(version, self.adapter(version))
        dropped = self._drop(version) if pc.policy == "drop" else []
        self._top_up([(g.draw, g.problem) for g in dropped])
        self._send(version, self.cfg.fleet.engines)
        wanted = self._wanted(version)
        self._serve(wanted)
        finished = [self.groups.pop(gid) for gid in wanted]
        self.trained += [(g.gid, g.draw) for g in finished]
        samples, metrics = self._samples(finished, dropped, version)
        check_versions(samples, version, self.cfg)
        if pc.policy == "keep" or pc.max_staleness >= 1:  # sampled while the trainer trains, trained next step
            self._top_up([])
            self._send(version, self.cfg.fleet.engines)
        self._take(self.fleet.wait(block=False))  # what has ended meanwhile: deaths counted, engines back
        self.fleet.forget({c.version for c in self.calls.values()})
        return samples, metrics | self._fleet_metrics()

    # ---- the pool --------------------------------------------------------------------------------------------
    def _wanted(self, version: int) -> list[int]:
        """The groups this step trains: the prompts_per_step oldest, and (policy wait) every group at the bound."""
        pc = self.cfg.partial
        out = set(list(self.groups)[:self.cfg.prompts_per_step])
        if pc.policy == "wait":
            out |= {gid for gid, g in self.groups.items()
                    if version - (version if g.version is None else g.version) >= pc.max_staleness}
        return sorted(out)

    def _drop(self, version: int) -> list[_Group]:
        """Policy drop: the groups sampled more than max_staleness versions before `version`, out of the pool (a
        result still to come for one is ignored)."""
        late = [gid for gid, g in self.groups.items()
                if g.version is not None and version - g.version > self.cfg.partial.max_staleness]
        return [self.groups.pop(gid) for gid in late]

    def _top_up(self, again: list[tuple[int, Problem]]) -> None:
        """Queue groups until `inflight` are in the pool: `again` (dropped prompts, same draws) first, then new
        draws."""
        want = self.inflight - len(self.groups)
        drawn = again + (self.stream.take(want - len(again)) if want > len(again) else [])
        for d, p in drawn:
            envs, prompt = reset_group(self.env[0], p, d, self.cfg, self.tokenizer, self.env[1])
            self.groups[self.next_gid] = _Group(self.next_gid, d, p, prompt, envs)
            self.next_gid += 1

    def _send(self, version: int, parts: int) -> None:
        """Send the queued groups (id order) under adapter `version`, split into `parts` calls of consecutive
        groups."""
        queued = [g for g in self.groups.values() if g.call is None and g.records is None]
        n, g_size = len(queued), self.cfg.group_size
        for k in range(min(parts, n)):
            chunk = queued[k * n // parts:(k + 1) * n // parts]
            payload = {"prompts": [g.prompt for g in chunk], "n": g_size,
                       "params": [sampling_params(self.cfg, group_seed(self.cfg.seed, g.draw, g_size)) for g in chunk]}
            self._send_call(self.next_call, [g.gid for g in chunk], payload, version)
            self.next_call += 1

    def _send_call(self, cid: int, gids: list[int], payload: dict, version: int) -> None:
        self.fleet.send(cid, payload, version)
        self.calls[cid] = _Call(gids, payload, version)
        for gid in gids:
            g = self.groups.get(gid)
            if g is not None:
                g.call, g.version = cid, version

    def _serve(self, wanted: list[int]) -> None:
        """Take the fleet's results until every group of `wanted` has its records."""
        while any(self.groups[gid].records is None for gid in wanted):
            if not self._take(self.fleet.wait()):  # it returns nothing only when nothing is in flight
                raise RuntimeError("rollout.fleet: the step waits for groups, but no call is in flight")

    def _take(self, ended: list[tuple[int, dict | None]]) -> bool:
        """The calls that ended, taken (a lost one's groups queued again and sent at once to the engines that are
        up, under the newest adapter); whether any had."""
        for cid, result in ended:
            call = self.calls.pop(cid)
            if result is None:
                self._requeue(call, cid)
            else:
                self._accept(call, cid, result)
        if any(g.call is None and g.records is None for g in self.groups.values()):
            self._send(self.fleet.version, max(1, self.fleet.alive))
        return bool(ended)

    def _requeue(self, call: _Call, cid: int) -> None:
        for gid in call.gids:
            g = self.groups.get(gid)
            if g is not None and g.call == cid and g.records is None:
                g.call, g.version, g.requeued = None, None, True
                self._step["requeued_groups"] += 1

    def _accept(self, call: _Call, cid: int, result: dict) -> None:
        """A call's records, each taken by its group if the group is still in the pool and waits for this call."""
        for gid, records in zip(call.gids, result["records"], strict=True):
            g = self.groups.get(gid)
            if g is None or g.call != cid or g.records is not None:
                continue
            g.records = records
            if g.requeued:
                self._step["requeued_tokens"] += sum(len(r["output_ids"]) for r in records)

    def _send_replay(self) -> None:
        """A resumed run's calls in flight at its checkpoint, sent again as they were, under their versions."""
        if not self.replay:
            return
        for version in sorted(self.replay):
            self.fleet.push(version, self.replay[version])
            for cid, call in self.calls.items():
                if call.version == version:
                    self.fleet.send(cid, call.payload, version)
        self.replay = {}

    # ---- samples and metrics -----------------------------------------------------------------------------
    def _samples(self, finished: list[_Group], dropped: list[_Group], version: int
                 ) -> tuple[list[Sample], dict[str, float]]:
        """The finished groups' episodes (one turn each) scored, the kept groups' advantages, the rollout/
        metrics."""
        cfg, n = self.cfg, self.cfg.group_size
        episodes = []
        for g in finished:
            eps = open_episodes(g.envs, g.prompt, group_seed(cfg.seed, g.draw, n), g.records)
            step_episodes(eps, self.tokenizer, self.env[1], 0)  # single: graded by the run's reward, then ended
            episodes += eps
        golds = [g.problem.answer for g in finished for _ in range(n)]
        samples, outcomes = score_episodes(episodes, golds, self.reward_fn, cfg, self.tokenizer)
        groups = [samples[i:i + n] for i in range(0, len(samples), n)]
        flat = [is_flat(group) for group in groups]
        kept = [group for group, f in zip(groups, flat) if not (cfg.dynamic_sampling and f)]
        for i, group in enumerate(kept):
            for s, a in zip(group, member_advantages(group, cfg.advantage)):
                s.advantage, s.group = a, i
        totals = rollout_totals(groups, outcomes)
        counts = {"groups_kept": len(kept), "groups_drawn": max(len(groups), 1), "rounds": 1, "flat": sum(flat)}
        metrics = rollout_metrics(totals, counts) if totals["samples"] else {}
        out = [s for group in kept for s in group]
        return out, metrics | self._staleness(out, finished, dropped, version) | reward_metrics(self.reward_fn)

    def _staleness(self, samples: list[Sample], finished: list[_Group], dropped: list[_Group], version: int
                   ) -> dict[str, float]:
        """rollout/ staleness and off-policy share of the trained samples, groups dropped and carried."""
        bound = self.cfg.partial.max_staleness
        trained = [s for s in samples if s.in_loss and s.token_versions]
        stale = [version - min(s.token_versions) for s in trained]
        tokens = sum(len(s.token_versions) for s in trained)
        off = sum(v < version for s in trained for v in s.token_versions)
        out = {"rollout/staleness_mean": sum(stale) / len(stale) if stale else 0.0,
               "rollout/staleness_max": float(max(stale, default=0)),
               "rollout/offpolicy_token_frac": off / tokens if tokens else 0.0,
               "rollout/groups_dropped": float(len(dropped)),
               "rollout/groups_carried": float(sum(g.version < version for g in finished))}
        for k in range(bound + 1):
            out[f"rollout/staleness_frac_{k}"] = sum(x == k for x in stale) / len(stale) if stale else 0.0
        if self.cfg.partial.policy == "keep":
            out["rollout/staleness_frac_over"] = sum(x > bound for x in stale) / len(stale) if stale else 0.0
        return out

    def _fleet_metrics(self) -> dict[str, float]:
        """rollout/fleet_*: engine deaths seen this step, the groups sent again and the completion tokens they
        sampled again (counted when they finish), the engines up, the adapter MiB put into the object store; and
        rollout/groups_inflight, the pool the engines go on with while the trainer trains."""
        c = self.fleet.counts
        out = {"rollout/fleet_failovers": float(c.failovers - self._seen["failovers"]),
               "rollout/fleet_requeued_groups": float(self._step["requeued_groups"]),
               "rollout/fleet_requeued_tokens": float(self._step["requeued_tokens"]),
               "rollout/fleet_engines_up": float(self.fleet.alive),
               "rollout/groups_inflight": float(len(self.groups)),
               "rollout/fleet_push_mib": (c.push_bytes - self._seen["push_bytes"]) / 2**20}
        self._seen = {"failovers": c.failovers, "push_bytes": c.push_bytes}
        self._step = {"requeued_groups": 0, "requeued_tokens": 0}
        return out

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """The pool ("groups"), the prompt stream and, under "engine" (what the engines hold), the calls in flight
        with their versions' adapters, as plain data and host tensors (torch.save, loaded with weights_only)."""
        import ray

        groups = [{"group": gid, "draw": g.draw, "id": g.problem.id, "problem": g.problem.problem,
                   "answer": g.problem.answer, "prompt": list(g.prompt),
                   "version": -1 if g.version is None else g.version, "call": -1 if g.call is None else g.call,
                   "records": g.records} for gid, g in self.groups.items()]
        calls = [{"call": cid, "gids": list(c.gids), "payload": c.payload, "version": c.version}
                 for cid, c in self.calls.items()]
        versions = sorted({c.version for c in self.calls.values()})
        adapters = {v: self.replay[v] if v in self.replay else ray.get(self.fleet.pushed[v].ref) for v in versions}
        return {"mode": self.mode, "stream": self.stream.state(), "groups": groups,
                "engine": {"calls": calls, "adapters": adapters, "next_gid": self.next_gid,
                           "next_call": self.next_call}}

    def load_state(self, state: dict) -> None:
        """Continue the pool of `state()`; a sync run's state (nothing in flight) starts an empty pool at its prompt
        stream's position. The saved calls in flight are sent again at the first `collect`."""
        if state["mode"] == "sync":
            log.info("resume: the checkpoint was written by a rollout.mode=sync run; continuing as fleet with no "
                     "rollouts in flight")
            self.stream.load_state(state["stream"])
            return
        if state["mode"] != self.mode:
            raise ResumeError(f"written by a rollout.mode={state['mode']} run, whose rollouts in flight "
                              f"rollout.mode=fleet cannot continue; resume with rollout.mode={state['mode']}, or "
                              "start a new run_dir")
        self.stream.load_state(state["stream"])
        self.groups = {}
        for d in state["groups"]:
            self.groups[int(d["group"])] = self._group_of(d)
        fleet = state["engine"]
        self.calls = {int(c["call"]): _Call([int(x) for x in c["gids"]], c["payload"], int(c["version"]))
                      for c in fleet["calls"]}
        self.replay = {int(v): dict(t) for v, t in fleet["adapters"].items()}
        self.next_gid, self.next_call = int(fleet["next_gid"]), int(fleet["next_call"])

    def _group_of(self, d: dict) -> _Group:
        problem = Problem(d["id"], d["problem"], d["answer"])
        envs, prompt = reset_group(self.env[0], problem, int(d["draw"]), self.cfg, self.tokenizer, self.env[1])
        if prompt != list(d["prompt"]):
            raise ResumeError(f"rollout state: problem {problem.id} renders another first prompt than the saved one "
                              "(another rollout.template or tokenizer); resume with the run's settings")
        version, call = int(d["version"]), int(d["call"])
        return _Group(int(d["group"]), int(d["draw"]), problem, prompt, envs, None if version < 0 else version,
                      None if call < 0 else call, d["records"])

    def close(self) -> None:
        """Stop the engines (and Ray, when the fleet started it)."""
        self.fleet.close()
