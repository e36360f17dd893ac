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

Partial rollouts (off-policy mode): `engine.queue` (`partial_queue.py`) queues groups across calls and serves them
until K have finished; the unfinished ones are retracted and continued by the next run under the weights it serves.
Each output token records the weight version that sampled it (`output_token_weight_versions`). `generate` never
serves or touches the queue.

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

import itertools
import threading
from collections import deque
from collections.abc import Iterable
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
from miles_k3.rollout.partial_queue import RolloutQueue
from miles_k3.rollout.push_copy import check_tensors
from miles_k3.rollout.requests import Request, generate_requests
from miles_k3.rollout.runner import ModelRunner
from miles_k3.rollout.sampling import SamplingParams
from miles_k3.rollout.scheduler import Scheduler


class RolloutEngine(VersionedEngine):
    """generate / load_lora_adapter_from_tensors / update_weights_from_tensor / weight_version / flush_cache /
    pause_generation / continue_generation / release_memory_occupation / resume_memory_occupation / close
    (`rollout.api.Engine`), kept state across a conversation's turns (`rollout.api.KeptStateEngine`), and the
    partial rollouts' queue, `queue` (`rollout.api.PartialQueue`: submit / run / cancel / queued_groups /
    queue_state / load_queue_state)."""

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
        self.adapters = AdapterBank(self.model, lora, self.config.merge_lora,
                                    self.config.fuses_projections(ctx.tp_size, ctx.ep_size))
        self.runner = ModelRunner(self.model, self.config, self.adapters, ctx, lambda: self.weight_version,
                                  tokenizer)
        self._lock = threading.RLock()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self.scheduler = Scheduler(self.runner, self._lock, self._unpaused)
        self._rids = itertools.count()
        self._released: set[str] = set()  # memory tags released and not resumed yet
        self._active = 0  # generate() / run() calls in flight (other threads may pause, push weights, release)
        self.queue = RolloutQueue(self)
        """The partial rollouts' queue, kept across calls (`partial_queue.py`)."""

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
                 keep_state: bool = False, states: list[int | None] | None = None) -> list[Record]:
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

        Kept state (`kept_state.py`): with `keep_state`, every sample's state (KDA slot, latent pages) is parked when
        it finishes, under the state id in its `meta_info["state_id"]` (a new id per sample, or the id it
        continued). `states[i]` (n=1): prompt i is the next turn of the conversation whose state is `states[i]`: its
        tokens so far (the previous turn's prompt + output ids) followed by the new ones; only the new ones are
        prefilled (the state is recomputed instead when it gave way for memory, or the weights, adapter or route
        recording changed). A state continued without `keep_state` is released with that turn; `release_states`
        releases the others.
        """
        ids, params, loras = self._checked(input_ids, prompts, sampling_params, n, lora, return_routed_experts,
                                           states)
        results: list[dict | None] = [None] * (len(ids) * n)
        groups = deque()
        for i, (p, sp, name) in enumerate(zip(ids, params, loras)):
            try:
                with self._lock:
                    group = self._make_group(i, n, p, sp, name, return_routed_experts)
                    self._attach_state(group, None if states is None else states[i], keep_state)
                groups.append(group)
            except ValueError as e:
                for j in range(n):
                    results[i * n + j] = error_record(str(e))
        self._active += 1
        try:
            self.scheduler.run(groups, lambda req: results.__setitem__(req.index, self._result(req, return_logprob)))
        finally:
            self._call_ends()
        return results

    def _checked(self, input_ids: list[list[int]] | None, prompts: list[str] | None,
                 sampling_params: dict | list[dict] | None, n: int, lora: str | list[str | None] | None,
                 return_routed_experts: bool, states: list[int | None] | None
                 ) -> tuple[list[list[int]], list[dict | None], list[str | None]]:
        """The prompts' ids, sampling params and adapters of a `generate` or a `queue.submit`, the call's arguments
        checked (ValueError naming the bad one)."""
        ids, params, loras = generate_requests(input_ids, prompts, sampling_params, n, lora, self.tokenizer,
                                               self._released)
        if return_routed_experts and not self.runner.num_moe:
            raise ValueError("return_routed_experts: this model has no MoE layers, so there are no routes")
        if states is not None and len(states) != len(ids):
            raise ValueError(f"states: one entry per prompt ({len(ids)}), got {len(states)}")
        return ids, params, loras

    def _call_ends(self) -> None:
        """A `generate` or a queue's `run` has ended; after the last one in flight the route log is cleared (every
        request of every call has its routes in its records, or on the host)."""
        self._active -= 1
        if not self._active:
            self.runner.route_log.clear()

    def release_states(self, state_ids: Iterable[int]) -> None:
        """Release these kept states (their parked slots, pages or snapshots freed); an id not open is a ValueError
        naming it (the ids before it are released)."""
        with self._lock:
            for sid in state_ids:
                self.runner.kept_states.release(sid)

    @property
    def kept_state_stats(self) -> dict[str, int]:
        """Kept states parked, continued on, dropped for memory, recomputed; the kept positions those continued turns
        did not prefill, and every position prefilled over the engine's life (`prefill_tokens`)."""
        return self.runner.kept_states.stats.as_dict() | {"prefill_tokens": self.runner.prefill_tokens}

    def _attach_state(self, group: list[Request], sid: int | None, keep: bool) -> None:
        """Give the group's requests state ids (keep: parked when they finish) and, for the next turn on kept state
        `sid`, hand its head the parked slot and pages (or recompute: see `generate`)."""
        store = self.runner.kept_states
        if sid is None:
            for req in group:
                req.state_id = store.new_id() if keep else None
            return
        head = group[0]
        where = f"request {head.index}"
        if len(group) != 1:
            raise ValueError(f"{where}: continuing kept state {sid} takes n=1, got n={len(group)}")
        if not store.known(sid):
            store.claim(sid)  # the ValueError naming the open ones
        parked = store.peek(sid)
        if parked is not None and head.prompt[:len(parked.tokens)] != parked.tokens:
            k = next((i for i, (a, b) in enumerate(zip(head.prompt, parked.tokens)) if a != b),
                     min(len(head.prompt), len(parked.tokens)))
            raise ValueError(f"{where}: its prompt does not extend kept state {sid}'s tokens (they differ from "
                             f"position {k} of {len(parked.tokens)}); a turn's prompt is the previous turn's prompt "
                             "and output ids as returned, then the new tokens")
        if parked is not None and len(head.prompt) == len(parked.tokens):
            raise ValueError(f"{where}: kept state {sid}'s next prompt adds no token to its {len(parked.tokens)}")
        parked = store.claim(sid)
        head.state_id = sid if keep else None
        if not keep:
            store.release(sid)
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
        if req.state_id is not None:
            meta["state_id"] = req.state_id
        if return_logprob:
            meta["output_token_logprobs"] = list(zip(req.logprobs, req.output))
            if req.unfiltered:  # the sampling was filtered: the same tokens under the unfiltered distribution
                meta["output_token_logprobs_unfiltered"] = list(req.unfiltered)
        if req.record:
            routes = req.routed(self.runner.route_log)
            assert routes.shape[0] == len(req.tokens) - 1, (routes.shape, len(req.tokens))
            meta["routed_experts"] = routes
        return {"output_ids": list(req.output), "meta_info": meta}

