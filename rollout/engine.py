"""The embedded rollout engine: an `sglang.Engine`-shaped API (`rollout.api.Engine`) over the trainer's own K3
base tensors. This is the facade: requests in, records out; the scheduler (`scheduler.py`: admission, forks,
preemption, the run loop, no torch) drives the runner (`runner.py`: pools, graphs, sampling, route recording).

`RolloutEngine(model, EngineConfig(...), lora=LoRAConfig(...))` shares every base tensor of `model` (no copy)
and holds its own LoRA buffers, one preallocated set per loaded adapter name. `generate` runs continuous
batching on two fixed pools (`memory.py`): a KDA state slot per running request and paged MLA latents. A
request's state always covers all its tokens but the last; each scheduler step feeds every running request its
last token (one batched step per adapter) and samples the next (`sampling.sample`: noise keyed by
(seed, position), batch-invariant). New prompts are prefilled once, in batched chunks, then forked into their
`n` samples (KDA state copied, full MLA pages shared). When pages run out, the youngest running request is
preempted and later recomputed from its tokens (its noise keys do not change, so neither do its samples). A
bad request gets an error entry; the others are served.

Partial rollouts (off-policy mode): `submit` queues groups (a prompt's `n` samples) in a queue of the engine's own,
kept across calls; `run` serves it until K groups have finished, then retracts the unfinished requests (their slots
and pages freed, their tokens, log-probs, versions and routes kept on the host) to the front of the queue, and the
next `run`, after a push, recomputes them from their tokens under the new weights. Each output token records the
weight version that sampled it (`output_token_weight_versions`). `generate` never serves or touches the queue.

Decode modes (`EngineConfig.decode`): eager (the reference: `model.step` on pooled copies), static and graph
(`graph_decode.py`: a fixed-shape step writing the pools directly, captured per batch bucket on CUDA).

Tensor parallelism: over a model cut by `parallelize` (the engine is given the same `ctx`), every rank of the TP group runs this engine on the
same prompts with its own shard (its pools hold its KDA heads; the MLA latents are replicated). Each step's
logits are gathered over the vocabulary, so every rank samples the same tokens, and drawn sampling seeds are
rank 0's: the ranks schedule identically and enter every collective together. CUDA-graph decode is not used
under tp > 1 (auto decodes eagerly, saying why).

Expert parallelism across DP replicas (`ctx`: EP groups that span replicas): the replicas' engines serve
different prompts, so every forward runs in lockstep (`parallel.lockstep`): a rank votes busy before each of its
forwards, and one whose `generate` has run out of work runs idle one-token forwards while another is busy. Every
rank then calls `generate` the same number of times (a rank with no prompts of its own calls it with none).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.lora import LoRAConfig
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.rollout.adapters import AdapterBank, share_base
from miles_k3.rollout.api import (
    BACKEND_CAPABILITIES,
    Record,
    VersionedEngine,
    check_tags,
    error_record,
    sample_meta,
)
from miles_k3.rollout.engine_config import EngineConfig
from miles_k3.rollout.push_copy import check_tensors
from miles_k3.rollout.requests import Request, generate_requests
from miles_k3.rollout.runner import ModelRunner
from miles_k3.rollout.sampling import FinishReason, SamplingParams
from miles_k3.rollout.scheduler import Scheduler


class RolloutEngine(VersionedEngine):
    """generate / load_lora_adapter_from_tensors / update_weights_from_tensor / weight_version / flush_cache /
    pause_generation / continue_generation / release_memory_occupation / resume_memory_occupation / close
    (`rollout.api.Engine`), and the partial rollouts' queue (native only): submit / run / cancel / queued_groups /
    queue_state / load_queue_state."""

    backend = "native"
    capabilities = BACKEND_CAPABILITIES[backend]  # kept state, the partial queue, routes, timing, ...
    push = None  # a push copies the adapter's tensors, under the model's names, into its buffers
    push_needs_memory = False  # ... so no request runs

    def __init__(self, model: K3ForCausalLM, config: EngineConfig | None = None, lora: LoRAConfig | None = None,
                 tokenizer: Any = None, ctx: ParallelContext = SINGLE):
        """`ctx`: the run's place of this rank (a sharded `model`: its forwards are collectives; with EP groups
        spanning DP replicas they run in lockstep with the other ranks' engines)."""
        self.config = config or EngineConfig()
        self.config.validate()
        self.cfg = model.config
        self.tokenizer = tokenizer
        self.model = share_base(model, ctx)  # planned for ctx: expert LoRA below is sized for the held experts
        self.ctx = ctx
        self.lora_config = lora
        self.adapters = AdapterBank(self.model, lora)
        self.runner = ModelRunner(self.model, self.config, self.adapters, ctx, lambda: self.weight_version,
                                  tokenizer)
        self._lock = threading.RLock()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self.scheduler = Scheduler(self.runner, self._lock, self._unpaused)
        self._rids = itertools.count()
        self._released: set[str] = set()  # memory tags released and not resumed yet
        self._active = 0  # generate() / run() calls in flight (other threads may pause, push weights, release)
        # partial rollouts (submit / run): the queued groups' entries (a group, or a retracted request alone), the
        # samples already finished of each group not finished yet (by group id: n and {index: request}), the next
        # group id, and whether a run() is serving the queue
        self._queue: deque[list[Request]] = deque()
        self._groups: dict[int, tuple[int, dict[int, Request]]] = {}
        self._next_group = 0
        self._serving = False

    # ---- what the runner and the scheduler hold, read by callers and tests ------------------------------------
    @property
    def max_context(self) -> int:
        """Prompt + completion tokens a request may hold."""
        return self.config.max_context

    @property
    def num_slots(self) -> int:
        """Requests that run at once (KDA state slots)."""
        return self.runner.num_slots

    @property
    def decode_mode(self) -> str:
        return self.runner.decode_mode

    @property
    def kda(self):
        return self.runner.kda

    @property
    def cache(self):
        return self.runner.cache

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def lockstep(self):
        return self.runner.lockstep

    @property
    def retracted(self):
        """The requests the last `run` retracted at its stop (`runner.Retracted`: how many, the tokens of state the
        next run recomputes, the bytes of the slots and pages they held)."""
        return self.runner.retracted

    @property
    def num_preempted(self) -> int:
        """Requests preempted (and later recomputed) for lack of latent pages."""
        return self.scheduler.num_preempted

    @property
    def timing(self) -> dict[str, float]:
        """Wall seconds spent in prefill, in decode and in the tail of decode (fewer than a quarter of a run's
        requests unfinished), and the decode steps, over the engine's life (`scheduler.RunTiming`)."""
        return self.scheduler.timing.as_dict()

    # ---- public API --------------------------------------------------------------------------------
    def generate(self, input_ids: list[list[int]] | None = None, prompts: list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, n: int = 1, return_logprob: bool = True,
                 lora: str | list[str | None] | None = None, return_routed_experts: bool = False,
                 keep_state: bool = False, sessions: list[int | None] | None = None) -> list[Record]:
        """Samples for every prompt: `n` per prompt, in order (prompt i's sample j at i * n + j).

        Each entry: `output_ids`, `meta_info` {finish_reason, prompt_tokens, completion_tokens,
        cached_tokens, weight_version (the newest the sample saw), weight_versions (all, sorted, the prefill's too),
        output_token_logprobs [(logprob, token_id)] if return_logprob (of the distribution sampled from: filtered
        when top-p / top-k / min-p filter), and then output_token_logprobs_unfiltered [logprob] (the same tokens under
        the unfiltered distribution) for a request that filters, routed_experts if return_routed_experts: the
        top-k expert ids of every MoE layer at every position the engine processed, the prompt and every output
        token but the last (int16 tensor [prompt + completion - 1, MoE layers, top_k], `miles_k3.model.routing`;
        a preempted request keeps the routes its tokens were sampled with)}, or
        `error` (with finish_reason {"type": "abort"}) for a request that was rejected. Sample j of a prompt
        with `sampling_seed` s uses seed s + j, so a fork equals n separate requests with those seeds.

        Sessions (`sessions.py`): with `keep_state`, every sample's state (KDA slot, latent pages) is parked when it
        finishes, under the session id in its `meta_info["session_id"]` (a new id per sample, or the id it
        continued). `sessions[i]` (n=1): prompt i is session `sessions[i]`'s next turn: its tokens so far (the
        previous turn's prompt + output ids) followed by the new ones; only the new ones are prefilled (the state is
        recomputed instead when it gave way for memory, or the weights, adapter or route recording changed). A
        session continued without `keep_state` ends with that turn; `close_sessions` ends the others.
        """
        ids, params, loras = generate_requests(input_ids, prompts, sampling_params, n, lora, self.tokenizer,
                                               self._released)
        if return_routed_experts and not self.runner.num_moe:
            raise ValueError("return_routed_experts: this model has no MoE layers, so there are no routes")
        if sessions is not None and len(sessions) != len(ids):
            raise ValueError(f"sessions: one entry per prompt ({len(ids)}), got {len(sessions)}")
        results: list[dict | None] = [None] * (len(ids) * n)
        groups = deque()
        for i, (p, sp, name) in enumerate(zip(ids, params, loras)):
            try:
                with self._lock:
                    group = self._make_group(i, n, p, sp, name, return_routed_experts)
                    self._attach_session(group, None if sessions is None else sessions[i], keep_state)
                groups.append(group)
            except ValueError as e:
                for j in range(n):
                    results[i * n + j] = error_record(str(e))
        self._active += 1
        try:
            self.scheduler.run(groups, lambda req: results.__setitem__(req.index, self._result(req, return_logprob)))
        finally:
            self._active -= 1
            if not self._active:  # every request of every call has its routes in its result
                self.runner.route_log.clear()
        return results

    def close_sessions(self, session_ids: Iterable[int]) -> None:
        """End these sessions (their parked state freed); an id not open is a ValueError naming it (the ids before
        it are closed)."""
        with self._lock:
            for sid in session_ids:
                self.runner.sessions.close(sid)

    @property
    def session_stats(self) -> dict[str, int]:
        """Sessions parked, continued on kept state, dropped for memory, recomputed; the kept positions those
        continued turns did not prefill, and every position prefilled over the engine's life (`prefill_tokens`)."""
        return self.runner.sessions.stats.as_dict() | {"prefill_tokens": self.runner.prefill_tokens}

    def _attach_session(self, group: list[Request], sid: int | None, keep: bool) -> None:
        """Make the group's requests sessions (keep: parked when they finish) and, for a session's next turn, hand
        its head the parked slot and pages (or recompute: see `generate`)."""
        store = self.runner.sessions
        if sid is None:
            for req in group:
                req.session = store.new_id() if keep else None
            return
        head = group[0]
        where = f"request {head.index}"
        if len(group) != 1:
            raise ValueError(f"{where}: continuing session {sid} takes n=1, got n={len(group)}")
        if not store.known(sid):
            store.claim(sid)  # the ValueError naming the open sessions
        parked = store.peek(sid)
        if parked is not None and head.prompt[:len(parked.tokens)] != parked.tokens:
            k = next((i for i, (a, b) in enumerate(zip(head.prompt, parked.tokens)) if a != b),
                     min(len(head.prompt), len(parked.tokens)))
            raise ValueError(f"{where}: its prompt does not extend session {sid}'s tokens (they differ from position "
                             f"{k} of {len(parked.tokens)}); a turn's prompt is the session's previous prompt and "
                             "output ids as returned, then the new tokens")
        if parked is not None and len(head.prompt) == len(parked.tokens):
            raise ValueError(f"{where}: session {sid}'s next prompt adds no token to its {len(parked.tokens)}")
        parked = store.claim(sid)
        head.session = sid if keep else None
        if not keep:
            store.close(sid)
        if parked is None:
            store.stats.recomputed += 1  # its state gave way for memory, or the pools were released
            return
        if parked.versions != {self.weight_version} or parked.lora != head.lora or (head.record and
                                                                                    not parked.record):
            store.free(parked)
            store.stats.recomputed += 1
            return
        kept = len(parked.tokens) - 1
        head.rid, head.slot, head.kept, head.cached = parked.rid, parked.slot, kept, kept
        head.restore = parked.snapshot  # a snapshot (no slot): copied into the slot the turn is admitted to
        head.weight_versions = set(parked.versions)
        if head.record:
            head.routes, head.num_routed = list(parked.routes), parked.num_routed

    # ---- partial rollouts: a persistent queue served across runs ------------------------------------------
    def submit(self, input_ids: list[list[int]], sampling_params: dict | list[dict] | None = None, n: int = 1,
               lora: str | list[str | None] | None = None, return_routed_experts: bool = False,
               keep_state: bool = False, sessions: list[int | None] | None = None) -> list[int]:
        """Queue each prompt's `n` samples as a group (behind the groups queued already) for `run`; returns the new
        group ids (increasing from 0 over the engine's life). The arguments are checked as `generate` checks them;
        a bad prompt (empty, a token outside the vocabulary, prompt + max_new_tokens over max_context, bad sampling
        params, an unknown adapter, a bad session continuation) is a ValueError naming it ("request i", i its place
        in this call), and then nothing is queued. A prompt without `sampling_seed` draws its seed here.
        `keep_state` / `sessions`: as `generate`'s (a multi-turn episode's turns)."""
        ids, params, loras = generate_requests(input_ids, None, sampling_params, n, lora, self.tokenizer,
                                               self._released)
        if return_routed_experts and not self.runner.num_moe:
            raise ValueError("return_routed_experts: this model has no MoE layers, so there are no routes")
        if sessions is not None and len(sessions) != len(ids):
            raise ValueError(f"sessions: one entry per prompt ({len(ids)}), got {len(sessions)}")
        with self._lock:
            groups = [self._make_group(i, n, p, sp, name, return_routed_experts)
                      for i, (p, sp, name) in enumerate(zip(ids, params, loras))]
            for i, group in enumerate(groups):
                self._attach_session(group, None if sessions is None else sessions[i], keep_state)
            new = []
            for group in groups:
                gid = self._next_group
                self._next_group += 1
                for j, req in enumerate(group):
                    req.index, req.group = j, gid
                self._groups[gid] = (n, {})
                self._queue.append(group)
                new.append(gid)
            return new

    def run(self, finished_groups: int | None = None, must_finish: Iterable[int] = (),
            return_logprob: bool = True, until: Callable[[], bool] | None = None,
            on_finished: Callable[[int, list[Record]], None] | None = None) -> list[tuple[int, list[Record]]]:
        """Serve the queue (`submit`) until at least `finished_groups` groups have finished all their samples in
        this run and every group id in `must_finish` has (None: until the queue is empty); then the running requests
        are retracted (their slots and pages freed, their tokens kept) and stay queued, first, for the next run,
        which recomputes their state from their tokens under the weights it serves (each output token records the
        version that sampled it: `output_token_weight_versions`). Returns (group id, the group's n records in sample
        order) for each group finished in this run, in the order they finished (with their last sample). A condition
        that holds before the first step runs nothing; a queue that empties first returns what finished.

        `until`: the stop condition instead (checked at the same points). `on_finished(group id, records)`: called
        for each group as it finishes, within the run, instead of returning it; it may `submit` groups, which join
        the queue this run serves (a multi-turn episode's next turn)."""
        must = list(must_finish)
        if finished_groups is not None and finished_groups < 0:
            raise ValueError(f"run: finished_groups must be >= 0 or None, got {finished_groups}")
        if self._released:
            raise RuntimeError(f"run: memory {sorted(self._released)} is released; call "
                               "resume_memory_occupation() first")
        finished: list[tuple[int, list[Record]]] = []
        with self._lock:
            if self._serving:
                raise RuntimeError("run: another run() is serving the queue")
            self._check_queued(must, "run: must_finish groups")
            self._serving = True
            self._active += 1
            self.runner.retracted.reset()
        left = set(must)

        def done(req: Request) -> None:
            req.keep_routes(self.runner.route_log)  # its records may be built after the log is cleared
            n, samples = self._groups[req.group]
            samples[req.index] = req
            if len(samples) == n:
                del self._groups[req.group]
                records = [self._result(samples[j], return_logprob) for j in range(n)]
                left.discard(req.group)
                if on_finished is not None:
                    on_finished(req.group, records)
                else:
                    finished.append((req.group, records))

        stop = until
        if until is None and finished_groups is not None:
            def stop() -> bool:
                return len(finished) >= finished_groups and not left
        try:
            self.scheduler.run(self._queue, done, stop)
        finally:
            with self._lock:
                for entry in self._queue:  # preempted requests still hold rows of the log
                    for req in entry:
                        req.keep_routes(self.runner.route_log)
                    if entry[0].kept:  # a session's turn never admitted: its kept state is freed
                        self.runner.free(entry[0])
                self._serving = False
                self._active -= 1
                if not self._active:
                    self.runner.route_log.clear()
        return finished

    def cancel(self, group_ids: Iterable[int]) -> None:
        """Drop these groups from the queue (all their requests, and their samples finished already); an id not
        queued is a ValueError naming it (and nothing is dropped). Only between runs."""
        ids = list(group_ids)
        with self._lock:
            if self._serving:
                raise RuntimeError("cancel: a run() is serving the queue; cancel between runs")
            self._check_queued(ids, "cancel: groups")
            drop = set(ids)
            self._queue = deque(e for e in self._queue if e[0].group not in drop)
            for g in drop:
                del self._groups[g]

    def _check_queued(self, ids: list[int], what: str) -> None:
        """ValueError `what` {ids not queued} naming the queued ones (none taken)."""
        queued = set(self.queued_groups())
        unknown = [g for g in ids if g not in queued]
        if unknown:
            raise ValueError(f"{what} {unknown} are not queued; queued: {sorted(queued)}")

    def queued_groups(self) -> list[int]:
        """The ids of the queued groups, in queue order (a group once, at its first entry)."""
        with self._lock:
            return list(dict.fromkeys(e[0].group for e in self._queue))

    def queue_state(self) -> dict:
        """The queue as plain data and host tensors (`torch.save` / `torch.load(weights_only=True)`), for
        `load_queue_state` in another engine over the same model: {"next_group": int, "groups": [{"group", "n"}]
        (every group not finished, in id order), "requests": [request dicts] (the queued requests, then the
        finished samples of unfinished groups), "entries": [[indices into requests]] (the queue's entries in
        order)}. A request: {group, index (its sample in the group), prompt, output, logprobs, unfiltered,
        token_versions, weight_versions (sorted), finish (None while queued, else {type, matched}), key, lora,
        record, routes (int16 [num_routed, L, K] or None), num_routed, cached, params (the SamplingParams fields)}.
        Only between runs."""
        with self._lock:
            if self._serving:
                raise RuntimeError("queue_state: a run() is serving the queue; save between runs")
            reqs, entries = [], []
            for entry in self._queue:
                entries.append(list(range(len(reqs), len(reqs) + len(entry))))
                reqs.extend(entry)
            for _, (_, samples) in sorted(self._groups.items()):
                reqs.extend(samples[j] for j in sorted(samples))
            for req in reqs:
                req.keep_routes(self.runner.route_log)
            return {"next_group": self._next_group,
                    "groups": [{"group": g, "n": n} for g, (n, _) in sorted(self._groups.items())],
                    "requests": [_request_state(r) for r in reqs], "entries": entries}

    def load_queue_state(self, state: dict) -> None:
        """Rebuild a queue saved by `queue_state` (request ids renumbered). RuntimeError unless this engine's queue
        is empty (no queued group, no unfinished group) and no run is serving; ValueError for an adapter this
        engine does not serve."""
        with self._lock:
            if self._serving or self._queue or self._groups:
                raise RuntimeError(f"load_queue_state: the queue is not empty (groups {sorted(self._groups)}); "
                                   "cancel them or load into a fresh engine")
            reqs = [self._request_from_state(d, i) for i, d in enumerate(state["requests"])]
            groups = {g["group"]: (g["n"], {}) for g in state["groups"]}
            in_queue = {i for e in state["entries"] for i in e}
            for i, req in enumerate(reqs):
                if req.group not in groups:
                    raise ValueError(f"load_queue_state: request {i} belongs to group {req.group}, not listed in "
                                     "the state's groups")
                if i not in in_queue:
                    if req.finish is None:
                        raise ValueError(f"load_queue_state: request {i} is neither queued nor finished")
                    groups[req.group][1][req.index] = req
            self._groups = groups
            self._queue = deque([reqs[i] for i in e] for e in state["entries"])
            self.runner.sessions.adopt([r.session for r in reqs if r.session is not None])
            self._next_group = max(self._next_group, state["next_group"])

    def _request_from_state(self, d: dict, i: int) -> Request:
        if not self.adapters.serves(d["lora"]):
            raise ValueError(f"load_queue_state: request {i}: unknown LoRA adapter {d['lora']!r}; loaded: "
                             f"{self.adapters.names()}")
        finish = None if d["finish"] is None else FinishReason(**d["finish"])
        return Request(next(self._rids), d["index"], list(d["prompt"]),
                       SamplingParams.from_dict(d["params"], f"load_queue_state: request {i}"), d["key"], d["lora"],
                       cached=d["cached"], output=list(d["output"]), logprobs=list(d["logprobs"]),
                       unfiltered=list(d["unfiltered"]), finish=finish, weight_versions=set(d["weight_versions"]),
                       record=d["record"], routes=[] if d["routes"] is None else [d["routes"]],
                       num_routed=d["num_routed"], token_versions=list(d["token_versions"]), group=d["group"],
                       session=d.get("session"))

    def load_lora_adapter_from_tensors(self, name: str, tensors: dict[str, torch.Tensor],
                                       config: LoRAConfig) -> None:
        """Register adapter `name`: its buffers are allocated here, once, and updated in place later."""
        with self._lock:
            self.adapters.load(name, tensors, config)

    def update_weights_from_tensor(self, named_tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
                                   lora_name: str | None = None, weight_version: int | None = None) -> None:
        """Copy LoRA tensors in place into adapter `lora_name`'s buffers (addresses never change). Every
        name, shape, dtype and value is checked before anything is copied: a bad push changes nothing. The
        engine's `weight_version` becomes `weight_version` (default: one more); versions only move forward.
        `lora_name` is required: the base weights are the trainer's, shared, and never pushed."""
        if lora_name is None:
            raise ValueError("update_weights_from_tensor: lora_name is required; the native engine shares the "
                             "trainer's base weights, so only adapters are pushed")
        with self._lock:
            version = self.next_version(weight_version)
            self.adapters.update(lora_name, dict(named_tensors))
            self.weight_version = version

    def check_weights_from_tensor(self, named_tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
                                  lora_name: str, weight_version: int | None = None) -> None:
        """Every check `update_weights_from_tensor` makes (version, adapter name, tensor names, shapes, dtypes,
        finite values), nothing copied: raises the ValueError it would raise. The first phase of a push across
        ranks (`weight_sync.local`): every rank checks, and all apply or none does."""
        with self._lock:
            self.next_version(weight_version)
            check_tensors(self.adapters.buffers(lora_name), dict(named_tensors), f"adapter {lora_name!r}")

    def flush_cache(self) -> bool:
        """The engine keeps no cross-request prefix cache, so there is nothing to drop; like SGLang, returns
        False while a request is being scheduled (another thread's `generate`) and True otherwise."""
        if not self._lock.acquire(blocking=False):
            return False
        self._lock.release()
        return True

    def close(self) -> None:
        """Nothing to end: the pools and graphs are freed with the engine (SGLang's `close` ends its processes)."""

    def pause_generation(self) -> None:
        """Stop scheduling after the current step (another thread's `generate` waits) until continued."""
        self._unpaused.clear()

    def continue_generation(self) -> None:
        self._unpaused.set()

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free memory while no request runs (SGLang tags; None = all): `kv_cache` the pools' storage (KDA state
        slots + latent pages, requests dropped), `cuda_graph` the captured decode graphs and their memory pool.
        `generate` refuses until every released tag is resumed."""
        tags = check_tags(tags, self.capabilities.memory_tags, self.backend)
        with self._lock:
            if self._active:
                raise RuntimeError("release_memory_occupation: generate() is running; release when idle")
            self.runner.release(tags)
            self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Reallocate what `tags` released (None = all): `kv_cache` zeroed pools (addresses may change),
        `cuda_graph` lets decode graphs be captured again (lazily, on their next use)."""
        tags = check_tags(tags, self.capabilities.memory_tags, self.backend)
        with self._lock:
            self.runner.resume(tags, self._released)
            self._released -= set(tags)

    # ---- requests ----------------------------------------------------------------------------------
    def _make_group(self, i: int, n: int, prompt: list[int], sp: dict | None, name: str | None,
                    record: bool = False) -> list[Request]:
        where = f"request {i}"
        params = SamplingParams.from_dict(dict(sp or {}), where)
        params.validate(self.cfg.vocab_size, where)
        if not prompt:
            raise ValueError(f"{where}: empty prompt; give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.config.max_context:
            raise ValueError(f"{where}: prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's max_context {self.config.max_context}; shorten the prompt "
                             "or lower max_new_tokens")
        if not self.adapters.serves(name):
            raise ValueError(f"{where}: unknown LoRA adapter {name!r}; loaded: {self.adapters.names()}")
        if n > self.num_slots:
            raise ValueError(f"{where}: n={n} samples exceed the engine's {self.num_slots} state slots")
        seed = params.sampling_seed
        if seed is None:  # reproducible under torch.manual_seed, different per call
            seed = self.runner.drawn_seed()
        return [Request(next(self._rids), i * n + j, list(prompt), params, seed + j, name, record=record)
                for j in range(n)]

    def _result(self, req: Request, return_logprob: bool) -> Record:
        meta = sample_meta(req.finish.to_dict(), len(req.prompt), len(req.output), req.cached, req.weight_versions)
        meta["output_token_weight_versions"] = list(req.token_versions)
        if req.session is not None:
            meta["session_id"] = req.session
        if return_logprob:
            meta["output_token_logprobs"] = list(zip(req.logprobs, req.output))
            if req.unfiltered:  # the sampling was filtered: the same tokens under the unfiltered distribution
                meta["output_token_logprobs_unfiltered"] = list(req.unfiltered)
        if req.record:
            routes = req.routed(self.runner.route_log)
            assert routes.shape[0] == len(req.tokens) - 1, (routes.shape, len(req.tokens))
            meta["routed_experts"] = routes
        return {"output_ids": list(req.output), "meta_info": meta}


def _request_state(req: Request) -> dict:
    """A queued request as plain data (its routes, moved to the host before, as one int16 tensor or None)."""
    assert not req.log_rows and req.slot is None, "a queued request holds no slot and no route-log rows"
    return {"group": req.group, "index": req.index, "prompt": list(req.prompt), "output": list(req.output),
            "logprobs": list(req.logprobs), "unfiltered": list(req.unfiltered),
            "token_versions": list(req.token_versions), "weight_versions": sorted(req.weight_versions),
            "finish": None if req.finish is None else req.finish.to_dict(), "key": req.key, "lora": req.lora,
            "record": req.record, "routes": torch.cat(req.routes) if req.routes else None, "session": req.session,
            "num_routed": req.num_routed, "cached": req.cached, "params": dataclasses.asdict(req.params)}
