"""The embedded rollout engine: an `sglang.Engine`-shaped API over the trainer's own K3 base tensors.

`RolloutEngine(model, EngineConfig(...), lora=LoRAConfig(...))` shares every base tensor of `model` (no copy)
and holds its own LoRA buffers, one preallocated set per loaded adapter name. `generate` runs continuous
batching on two fixed pools (`memory.py`): a KDA state slot per running request and paged MLA latents. A
request's state always covers all its tokens but the last; each scheduler step feeds every running request its
last token (one batched step per adapter) and samples the next (`sampling.sample`: noise keyed by
(seed, position), batch-invariant). New prompts are prefilled once, in batched chunks, then forked into their
`n` samples (KDA state copied, full MLA pages shared). When pages run out, the youngest running request is
preempted and later recomputed from its tokens (its noise keys do not change, so neither do its samples). A
bad request gets an error entry; the others are served.

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

import contextlib
import itertools
import logging
import threading
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.lora import LoRAConfig
from miles_k3.model.routing import moe_layers, recording
from miles_k3.parallel.lockstep import Lockstep
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.rollout.adapters import AdapterBank, share_base
from miles_k3.rollout.engine_config import MEMORY_TAGS, EngineConfig
from miles_k3.rollout.graph_decode import GraphDecoder
from miles_k3.rollout.memory import KDAStatePool, PagedLatentCache, plan_memory, pooled_state, store_state
from miles_k3.rollout.push_copy import check_tensors
from miles_k3.rollout.requests import Request, generate_requests
from miles_k3.rollout.route_log import RouteLog
from miles_k3.rollout.sampling import (
    SamplingParams,
    check_stop,
    filters,
    sample,
    unfiltered_logprobs,
)

log = logging.getLogger(__name__)

class RolloutEngine:
    """generate / load_lora_adapter_from_tensors / update_weights_from_tensor / weight_version / flush_cache /
    pause_generation / continue_generation / release_memory_occupation / resume_memory_occupation."""

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
        tp, ep = ctx.tp_size, ctx.ep_size
        self.lockstep = Lockstep(ctx)
        self._num_moe = len(moe_layers(self.model))
        self.lora_config = lora
        self.adapters = AdapterBank(self.model, lora)
        self.device = device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        plan = plan_memory(self.cfg, self.config.memory_budget_bytes, self.config.page_size,
                           self.config.max_context, self.dtype, tp)
        num_slots = self.config.num_slots or plan.num_slots
        num_pages = self.config.num_pages or plan.num_pages
        if num_pages < plan.pages_per_request:
            raise ValueError(f"num_pages: {num_pages} pages of {self.config.page_size} tokens cannot hold one "
                             f"request of max_context={self.config.max_context}; raise num_pages")
        self.decode_mode = self._decode_mode(tp, ep)
        self.num_slots = num_slots
        """Requests that run at once (KDA state slots); a static / graph decoder holds one more, its padding rows'."""
        self.kda = KDAStatePool(self.cfg, num_slots + (self.decode_mode != "eager"), device, self.dtype, tp)
        self.cache = PagedLatentCache(self.cfg, num_pages, self.config.page_size, device, self.dtype)
        self._pages_per_request = plan.pages_per_request
        self._graph = self._make_graph_decoder()
        log.debug("rollout engine: %d slots, %d pages of %d tokens, decode=%s (%s)", num_slots, num_pages,
                  self.config.page_size, self.decode_mode, plan.summary())
        self.weight_version = 0
        self.num_preempted = 0  # requests preempted (and later recomputed) for lack of latent pages
        self._rids = itertools.count()
        self._lock = threading.RLock()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._released: set[str] = set()  # memory tags released and not resumed yet
        self._active = 0  # generate() calls in flight (other threads may pause, push weights, release)
        self._route_log = RouteLog()  # decode steps' routes while generate() calls are in flight

    # ---- public API --------------------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        """Prompt + completion tokens a request may hold."""
        return self.config.max_context

    def generate(self, input_ids: list[list[int]] | None = None, prompts: list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, n: int = 1, return_logprob: bool = True,
                 lora: str | list[str | None] | None = None, return_routed_experts: bool = False) -> list[dict]:
        """Samples for every prompt: `n` per prompt, in order (prompt i's sample j at i * n + j).

        Each entry: `output_ids`, `meta_info` {finish_reason, prompt_tokens, completion_tokens,
        cached_tokens, weight_version (the newest the sample saw), weight_versions (all, sorted),
        output_token_logprobs [(logprob, token_id)] if return_logprob (of the distribution sampled from: filtered
        when top-p / top-k / min-p filter), and then output_token_logprobs_unfiltered [logprob] (the same tokens under
        the unfiltered distribution) for a request that filters, routed_experts if return_routed_experts: the
        top-k expert ids of every MoE layer at every position the engine processed, the prompt and every output
        token but the last (int16 tensor [prompt + completion - 1, MoE layers, top_k], `miles_k3.model.routing`;
        a preempted request keeps the routes its tokens were sampled with)}, or
        `error` (with finish_reason {"type": "abort"}) for a request that was rejected. Sample j of a prompt
        with `sampling_seed` s uses seed s + j, so a fork equals n separate requests with those seeds.
        """
        ids, params, loras = generate_requests(input_ids, prompts, sampling_params, n, lora, self.tokenizer,
                                               self._released)
        if return_routed_experts and not self._num_moe:
            raise ValueError("return_routed_experts: this model has no MoE layers, so there are no routes")
        results: list[dict | None] = [None] * (len(ids) * n)
        groups = deque()
        for i, (p, sp, name) in enumerate(zip(ids, params, loras)):
            try:
                groups.append(self._make_group(i, n, p, sp, name, return_routed_experts))
            except ValueError as e:
                for j in range(n):
                    results[i * n + j] = {"error": str(e), "meta_info": {"finish_reason": {
                        "type": "abort", "message": str(e)}}}
        self._active += 1
        try:
            self._run(groups, results, return_logprob)
        finally:
            self._active -= 1
            if not self._active:  # every request of every call has its routes in its result
                self._route_log.clear()
        return results

    def load_lora_adapter_from_tensors(self, name: str, tensors: dict[str, torch.Tensor],
                                       config: LoRAConfig) -> None:
        """Register adapter `name`: its buffers are allocated here, once, and updated in place later."""
        with self._lock:
            self.adapters.load(name, tensors, config)

    def update_weights_from_tensor(self, named_tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
                                   lora_name: str, weight_version: int | None = None) -> None:
        """Copy LoRA tensors in place into adapter `lora_name`'s buffers (addresses never change). Every
        name, shape, dtype and value is checked before anything is copied: a bad push changes nothing. The
        engine's `weight_version` becomes `weight_version` (default: one more); versions only move forward."""
        with self._lock:
            self._check_version(weight_version)
            self.adapters.update(lora_name, dict(named_tensors))
            self.weight_version = self.weight_version + 1 if weight_version is None else weight_version

    def check_weights_from_tensor(self, named_tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
                                  lora_name: str, weight_version: int | None = None) -> None:
        """Every check `update_weights_from_tensor` makes (version, adapter name, tensor names, shapes, dtypes,
        finite values), nothing copied: raises the ValueError it would raise. The first phase of a push across
        ranks (`weight_sync.local`): every rank checks, and all apply or none does."""
        with self._lock:
            self._check_version(weight_version)
            check_tensors(self.adapters.buffers(lora_name), dict(named_tensors), f"adapter {lora_name!r}")

    def _check_version(self, weight_version: int | None) -> None:
        if weight_version is not None and weight_version <= self.weight_version:
            raise ValueError(f"weight_version: versions only move forward; the engine serves version "
                             f"{self.weight_version}, the push has {weight_version}")

    def flush_cache(self) -> bool:
        """The engine keeps no cross-request prefix cache, so there is nothing to drop; like SGLang, returns
        False while a request is being scheduled (another thread's `generate`) and True otherwise."""
        if not self._lock.acquire(blocking=False):
            return False
        self._lock.release()
        return True

    def pause_generation(self) -> None:
        """Stop scheduling after the current step (another thread's `generate` waits) until continued."""
        self._unpaused.clear()

    def continue_generation(self) -> None:
        self._unpaused.set()

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free memory while no request runs (SGLang tags; None = all): `kv_cache` the pools' storage (KDA state
        slots + latent pages, requests dropped), `cuda_graph` the captured decode graphs and their memory pool.
        `generate` refuses until every released tag is resumed."""
        tags = self._check_tags(tags)
        with self._lock:
            if self._active:
                raise RuntimeError("release_memory_occupation: generate() is running; release when idle")
            if "kv_cache" in tags:
                self.kda.release()
                self.cache.release()
            if self._graph is not None and ("cuda_graph" in tags or "kv_cache" in tags):
                self._graph.release_graphs()  # graphs hold the pools' addresses: never replay them after a move
            self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Reallocate what `tags` released (None = all): `kv_cache` zeroed pools (addresses may change),
        `cuda_graph` lets decode graphs be captured again (lazily, on their next use)."""
        tags = self._check_tags(tags)
        with self._lock:
            if "kv_cache" in tags and "kv_cache" in self._released:
                self.kda.resume()
                self.cache.resume()
                self._graph = self._make_graph_decoder()
            self._released -= set(tags)

    def _decode_mode(self, tp: int, ep: int) -> str:
        """The decode mode `config.decode` resolves to (auto: graph for a bf16 CUDA model of one TP rank; eager
        under expert parallelism, whose all-to-all sizes come from host-side counts)."""
        mode, device = self.config.decode, self.device
        if ep > 1:
            if mode in ("graph", "static"):
                raise ValueError(f"decode: {mode} decodes without host syncs, and expert parallelism (parallel.ep="
                                 f"{ep}) sizes its all-to-all from host-side row counts; use decode=eager or auto")
            if mode == "auto":
                log.info("rollout engine: decode=eager (expert parallelism, ep=%d: the all-to-all needs host-side "
                         "row counts)", ep)
            return "eager"
        graphable = device.type == "cuda" and self.dtype == torch.bfloat16
        if mode == "graph" and not graphable:
            raise ValueError(f"decode: graph needs a bf16 CUDA model (grouped expert matmuls without host "
                             f"syncs), got {self.dtype} on {device}; use eager or static")
        if mode == "graph" and tp > 1:
            raise ValueError(f"decode: graph is not supported under tensor parallelism (parallel.tp={tp}): "
                             "captured collectives are untested; use eager or static")
        if mode == "auto" and graphable and tp > 1:
            log.info("rollout engine: decode=eager (CUDA-graph decode is not used under tensor parallelism, "
                     "tp=%d: captured collectives are untested)", tp)
            return "eager"
        return ("graph" if graphable else "eager") if mode == "auto" else mode

    def _make_graph_decoder(self) -> GraphDecoder | None:
        if self.decode_mode == "eager":
            return None
        return GraphDecoder(self.model, self.kda, self.cache, self._pages_per_request,
                            capture=self.decode_mode == "graph")

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
            seed = self._drawn_seed()
        return [Request(next(self._rids), i * n + j, list(prompt), params, seed + j, name, record=record)
                for j in range(n)]

    def _drawn_seed(self) -> int:
        """A sampling seed from torch's global RNG; under TP rank 0's (broadcast), so every rank of the group
        samples the same tokens whatever its RNG state."""
        seed = torch.randint(0, 2**62, (1,))
        if self.ctx.tp_size > 1:
            group = self.ctx.tp_group
            seed = seed.to(self.device)
            dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
        return int(seed.item())

    # ---- scheduling --------------------------------------------------------------------------------
    def _run(self, waiting: deque, results: list, return_logprob: bool) -> None:
        running: list[Request] = []
        while waiting or running:
            self._unpaused.wait()
            with self._lock:
                self._admit(waiting, running)
                if not running and waiting:  # admitted together, the groups may have starved each other
                    self._admit(waiting, running, max_groups=1)
                if not running:
                    raise RuntimeError("rollout engine: a request cannot be admitted into empty pools "
                                       "(memory too small for one request); raise memory_budget_bytes")
                self._make_room(running, waiting)
                for req in self._decode(running):
                    running.remove(req)
                    self._free(req)
                    results[req.index] = self._result(req, return_logprob)
        self.lockstep.drain(self._idle_forward)

    def _busy(self) -> None:
        """Before one of this engine's own forwards: its lockstep vote, with the adapter bound (nothing without
        lockstep)."""
        if self.lockstep.active:
            self.lockstep.busy(self.adapters.index(self.adapters.bound_name))

    @torch.no_grad()
    def _idle_forward(self, adapter: int) -> None:
        """One token through the model, dropped: this rank's part in a forward of other ranks (lockstep), with their
        adapter bound (the rows they send to this rank's experts meet its expert LoRA)."""
        self.adapters.bind(self.adapters.name_at(adapter), self.weight_version)
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), return_logits=False)

    def _admit(self, waiting: deque, running: list[Request], max_groups: int | None = None) -> None:
        """Admit waiting groups in order while their slots fit: prefill every group's tokens but the last in
        batched chunks (one forward per adapter and chunk), then fork each group into its requests. A group
        that gets no pages goes back to the front of the queue, in order."""
        taken, need, free = [], 0, self.kda.num_free
        while waiting and need + len(waiting[0]) <= free and len(taken) != max_groups:
            group = waiting.popleft()
            need += len(group)
            self.cache.new_request(group[0].rid)
            taken.append(group)
        for group, slot in zip(taken, self.kda.alloc_many(len(taken)) or ()):  # one reset for every head
            group[0].slot = slot
        failed = self._prefill_heads([g[0] for g in taken])
        back = []
        for group in taken:
            if group[0].rid in failed or not self._fork(group):
                self._free(group[0])
                back.append(group)
            else:
                running.extend(group)
        waiting.extendleft(reversed(back))

    def _fork(self, group: list[Request]) -> bool:
        head = group[0]
        if len(group) == 1:
            return True
        slots = self.kda.fork(head.slot, len(group) - 1)
        if slots is None or not self.cache.fork(head.rid, [r.rid for r in group[1:]]):
            for s in slots or ():
                self.kda.free(s)
            return False
        for req, s in zip(group[1:], slots):
            req.slot, req.cached = s, len(head.tokens) - 1
            req.routes, req.num_routed = list(head.routes), head.num_routed  # the shared prefill's routes
            req.log_rows = list(head.log_rows)
        return True

    def _prefill_heads(self, heads: list[Request]) -> set[int]:
        """Chunked prefill of each head's tokens but the last, batched (right-padded) per adapter; returns the
        rids that could not reserve pages (their state is left partial: the caller frees them)."""
        failed: set[int] = set()
        chunk = self.config.prefill_chunk
        by_lora: dict[str | None, list[Request]] = {}
        for h in heads:
            by_lora.setdefault(h.lora, []).append(h)
        for name, reqs in by_lora.items():
            longest = max(len(r.tokens) - 1 for r in reqs)
            for start in range(0, longest, chunk):
                rows = [r for r in reqs if len(r.tokens) - 1 > start and r.rid not in failed]
                for r in rows:
                    if not self.cache.reserve(r.rid, min(chunk, len(r.tokens) - 1 - start)):
                        failed.add(r.rid)
                rows = [r for r in rows if r.rid not in failed]
                width = min(chunk, longest - start)  # the padded width of this chunk's forwards
                rows_per_forward = max(1, self.config.max_prefill_tokens // width)
                for i in range(0, len(rows), rows_per_forward):
                    self.adapters.bind(name, self.weight_version)
                    self._prefill_rows(rows[i:i + rows_per_forward], start, chunk)
        return failed

    def _prefill_rows(self, rows: list[Request], start: int, chunk: int) -> None:
        pieces = [r.tokens[start:min(start + chunk, len(r.tokens) - 1)] for r in rows]
        width = max(map(len, pieces))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in pieces], device=self.device)
        lens = torch.tensor([len(p) for p in pieces], device=self.device)
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        rids = [r.rid for r in rows]
        state = pooled_state(self.cfg, self.kda, slots, self.cache, rids)
        self._busy()
        record = any(r.record for r in rows)
        with torch.no_grad(), (recording(self.model) if record else contextlib.nullcontext()) as recorder:
            out = self.model(ids, seq_lens=lens, state=state, return_state=True, return_logits=False)
        stored = store_state(self.cfg, out.state, self.kda, slots, self.cache, rids)
        assert stored, "pages were reserved by _prefill_heads"
        if record:
            routes_BTLK = self._route_log.to_host(recorder.routes().view(len(rows), width, self._num_moe, -1))
            for b, (r, p) in enumerate(zip(rows, pieces)):
                if r.record:
                    r.add_routes(start, routes_BTLK[b, :len(p)], self._route_log)

    def _make_room(self, running: list[Request], waiting: deque) -> None:
        """Reserve one more position per running request, preempting the youngest while pages are short."""
        i = 0
        while i < len(running):
            if self.cache.reserve(running[i].rid, 1):
                i += 1
                continue
            victim = running.pop()
            self._free(victim)
            waiting.appendleft([victim])  # recomputed from its tokens when pages free up
            self.num_preempted += 1
            log.info("preempted request %d (%d tokens) for lack of latent pages", victim.rid,
                     len(victim.tokens))
            i = min(i, len(running))

    def _decode(self, running: list[Request]) -> list[Request]:
        """One token for every running request (one model step per adapter); returns the finished ones."""
        finished = []
        by_lora: dict[str | None, list[Request]] = {}
        for req in running:
            by_lora.setdefault(req.lora, []).append(req)
        for name, reqs in by_lora.items():
            self.adapters.bind(name, self.weight_version)
            logits = self._step([r.rid for r in reqs], [r.slot for r in reqs], [r.last_token for r in reqs],
                                reqs if any(r.record for r in reqs) else None)
            keys = torch.tensor([r.key for r in reqs])
            positions = torch.tensor([len(r.output) for r in reqs])
            params = [r.params for r in reqs]
            tokens, logprobs = sample(logits, params, keys, positions)
            filtering = [filters(p, logits.shape[-1]) for p in params]
            raw = unfiltered_logprobs(logits, params, tokens).tolist() if any(filtering) else None
            for b, (req, t, lp) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist())):
                req.output.append(t)
                req.logprobs.append(lp)
                if filtering[b]:
                    req.unfiltered.append(raw[b])
                req.weight_versions.add(self.weight_version)
                req.finish = check_stop(req.output, req.params, self.config.eos_token_ids, self._text_fn)
                if req.finish is not None:
                    finished.append(req)
        return finished

    def _step(self, rids: list[int], slots: list[int], ids: list[int],
              recorded: list[Request] | None = None) -> torch.Tensor:
        """One decode token for each request (positions reserved); returns logits [B, V]. `recorded`: the
        requests (in order) whose routes of this step are kept (those with `record`)."""
        if self._graph is not None:  # in steps of at most the largest graph bucket
            chunks, routes, m = [], [], self._graph.max_batch
            split = len(ids) > m  # a graph's outputs are its static buffers: copied before it replays again
            for i in range(0, len(ids), m):
                logits = self._graph.decode(ids[i:i + m], slots[i:i + m], rids[i:i + m])
                chunks.append(logits.clone() if split else logits)
                if recorded is not None:
                    step = self._graph.last_routes(len(logits))
                    routes.append(step.clone() if split else step)
            for rid in rids:
                self.cache.advance(rid, 1)
            if recorded is not None:
                self._route_log.keep_step(recorded, routes[0] if len(routes) == 1 else torch.cat(routes))
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        slots_t = torch.tensor(slots, device=self.device)
        state = pooled_state(self.cfg, self.kda, slots_t, self.cache, rids)
        self._busy()
        with recording(self.model) if recorded is not None else contextlib.nullcontext() as recorder:
            out = self.model.step(torch.tensor(ids, device=self.device), state)
        stored = store_state(self.cfg, out.state, self.kda, slots_t, self.cache, rids)
        assert stored, "positions were reserved by _make_room"
        if recorded is not None:
            self._route_log.keep_step(recorded, recorder.routes())
        return out.logits

    def _free(self, req: Request) -> None:
        self.kda.free(req.slot)
        self.cache.free(req.rid)
        req.slot = None

    def _result(self, req: Request, return_logprob: bool) -> dict:
        meta = {"finish_reason": req.finish.to_dict(), "prompt_tokens": len(req.prompt),
                "completion_tokens": len(req.output), "cached_tokens": req.cached,
                "weight_version": max(req.weight_versions), "weight_versions": sorted(req.weight_versions)}
        if return_logprob:
            meta["output_token_logprobs"] = list(zip(req.logprobs, req.output))
            if req.unfiltered:  # the sampling was filtered: the same tokens under the unfiltered distribution
                meta["output_token_logprobs_unfiltered"] = list(req.unfiltered)
        if req.record:
            routes = req.routed(self._route_log)
            assert routes.shape[0] == len(req.tokens) - 1, (routes.shape, len(req.tokens))
            meta["routed_experts"] = routes
        return {"output_ids": list(req.output), "meta_info": meta}

    @property
    def _text_fn(self):
        return None if self.tokenizer is None else self.tokenizer.decode

    @staticmethod
    def _check_tags(tags: list[str] | None) -> list[str]:
        """The tags to act on (None = all); unknown tags are an error naming the supported ones."""
        if tags is None:
            return list(MEMORY_TAGS)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"memory tags {bad} are not supported; this engine has {list(MEMORY_TAGS)} "
                             "(the base weights are the trainer's: it owns their memory)")
        return list(tags)
