"""The native engine's runner: everything with tensors. It owns the model's shared base with its adapter buffers
(`adapters.py`), the two pools (`memory.py`: a KDA state slot per running request, paged MLA latents), the decode
graphs (`graph_decode.py`), sampling (`sampling.sample`) and route recording (`route_log.py`), and offers the
scheduler (`scheduler.py`) its steps: slots and pages, a batched chunked prefill, one decode token per running
request. A request's state always covers all its tokens but the last; each decode step feeds every running request
its last token (one batched step per adapter) and samples the next. Every prefill and decode step records the
weight version it ran under in its requests (`Request.weight_versions`).

Decode modes (`EngineConfig.decode`): eager (the reference: `model.step` on pooled copies), static and graph
(`graph_decode.py`: a fixed-shape step writing the pools directly, captured per batch bucket on CUDA).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from miles_k3.model.routing import moe_layers, recording
from miles_k3.model.state import KDALayerState
from miles_k3.parallel.lockstep import Lockstep
from miles_k3.parallel.mesh import ParallelContext
from miles_k3.rollout.adapters import AdapterBank
from miles_k3.rollout.engine_config import EngineConfig
from miles_k3.rollout.graph_decode import GraphDecoder
from miles_k3.rollout.kept_state import KeptStates, Parked
from miles_k3.rollout.memory import (
    KDAStatePool,
    PagedLatentCache,
    page_bytes,
    plan_memory,
    pooled_state,
    slot_bytes,
    store_state,
)
from miles_k3.rollout.requests import Request
from miles_k3.rollout.route_log import RouteLog
from miles_k3.rollout.sampling import check_stop, filters, sample, unfiltered_logprobs

log = logging.getLogger("miles_k3.rollout.engine")


class Retracted:
    """Requests retracted at a partial rollout's stop: how many, the tokens of state the next run recomputes for
    them (prompt and output so far), and the bytes their KDA slots and latent pages held, which keeping them
    resident through the train step instead would have kept allocated."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = self.tokens = self.bytes = 0

    def add(self, tokens: int, nbytes: int) -> None:
        self.requests += 1
        self.tokens += tokens
        self.bytes += nbytes


class ModelRunner:
    """The tensors of one native engine over `model` (its base shared, `adapters` bound per step). `version()`:
    the weight version the engine serves now (recorded in every request a step computes)."""

    def __init__(self, model, config: EngineConfig, adapters: AdapterBank, ctx: ParallelContext,
                 version: Callable[[], int], tokenizer: Any = None):
        self.model, self.config, self.adapters, self.ctx = model, config, adapters, ctx
        self.cfg = model.config
        self.version = version
        self.tokenizer = tokenizer
        self.lockstep = Lockstep(ctx)
        self.num_moe = len(moe_layers(model))
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        plan = plan_memory(self.cfg, config.memory_budget_bytes, config.page_size, config.max_context, self.dtype,
                           ctx.tp_size)
        num_slots = config.num_slots or plan.num_slots
        num_pages = config.num_pages or plan.num_pages
        if num_pages < plan.pages_per_request:
            raise ValueError(f"num_pages: {num_pages} pages of {config.page_size} tokens cannot hold one "
                             f"request of max_context={config.max_context}; raise num_pages")
        self.decode_mode = self._decode_mode(ctx.tp_size, ctx.ep_size)
        self.num_slots = num_slots
        """Requests that run at once (KDA state slots); a static / graph decoder holds one more, its padding rows'."""
        self.kda = KDAStatePool(self.cfg, num_slots + (self.decode_mode != "eager"), self.device, self.dtype,
                                ctx.tp_size)
        self.cache = PagedLatentCache(self.cfg, num_pages, config.page_size, self.device, self.dtype)
        self._pages_per_request = plan.pages_per_request
        self._slot_bytes = slot_bytes(self.cfg, self.dtype, ctx.tp_size)
        self._page_bytes = page_bytes(self.cfg, config.page_size, self.dtype)
        self.retracted = Retracted()
        self.kept_states = KeptStates(self.kda.free, self.cache.free, self._copy_out, self._slot_bytes,
                                      config.state_snapshot_bytes)
        """States parked between a conversation's turns (`kept_state.py`); they give way when the pools are short."""
        self.prefill_tokens = 0
        """Positions prefilled over the engine's life (a kept state saves its positions here)."""
        """What the retracts since the last `Retracted.reset` freed (the engine resets it at every run)."""
        self.graph = self._make_graph_decoder()
        self.route_log = RouteLog()  # decode steps' routes while generate() calls are in flight
        log.debug("rollout engine: %d slots, %d pages of %d tokens, decode=%s (%s)", num_slots, num_pages,
                  config.page_size, self.decode_mode, plan.summary())

    # ---- slots and pages (the scheduler's `StepRunner`) ----------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        """Free slots, and the parked states' (they give way when taken: `alloc_slots`, `fork_slots`)."""
        return self.kda.num_free + self.kept_states.num_parked_slots

    def _slots_free(self, k: int) -> None:
        while self.kda.num_free < k and self.kept_states.give_slot():
            pass

    def _copy_out(self, slot: int) -> list[KDALayerState]:
        """Slot `slot`'s KDA state, copied to the host (a parked state's snapshot)."""
        states = self.kda.read(torch.tensor([slot], device=self.device))
        return [KDALayerState(s.conv_BCW.to("cpu", copy=True), s.recurrent_BHKV.to("cpu", copy=True))
                for s in states]

    def restore(self, req: Request) -> None:
        """Copy a snapshotted state's KDA state into the slot its turn was admitted to."""
        self.kda.write(torch.tensor([req.slot], device=self.device),
                       [KDALayerState(s.conv_BCW.to(self.device), s.recurrent_BHKV.to(self.device))
                        for s in req.restore])
        req.restore = None
        self.kept_states.snapshot_gone()
        self.kept_states.stats.restored += 1

    def unhold(self, req: Request) -> None:
        """The slot of a queued turn on a kept state, for a request ahead of it: the turn's state snapshotted (`req.restore`) when
        the budget has room, else its slot and pages freed (the turn recomputes; counted as dropped)."""
        if self.kept_states.take_snapshot_bytes():
            req.restore = self._copy_out(req.slot)
            self.kda.free(req.slot)
            req.slot = None
            self.kept_states.snapshotted(req.state_id, req.kept)
            return
        log.info("kept state %s (%d tokens) gave way for memory before its turn ran; the turn recomputes it",
                 req.state_id, req.kept)
        self.free(req)
        self.kept_states.stats.dropped += 1
        self.kept_states.stats.recomputed += 1

    def alloc_slots(self, k: int) -> list[int] | None:
        self._slots_free(k)
        return self.kda.alloc_many(k)  # one reset for every slot

    def fork_slots(self, slot: int, k: int) -> list[int] | None:
        self._slots_free(k)
        return self.kda.fork(slot, k)

    def new_request(self, rid: int) -> None:
        self.cache.new_request(rid)

    def reserve(self, rid: int, num_tokens: int) -> bool:
        """Pages for `num_tokens` more positions of `rid`, parked states giving way while they are short."""
        while not self.cache.reserve(rid, num_tokens):
            if not self.kept_states.give_way():
                return False
        return True

    def fork_pages(self, rid: int, children: list[int]) -> bool:
        while not self.cache.fork(rid, children):
            if not self.kept_states.give_way():
                return False
        return True

    def free_slot(self, slot: int) -> None:
        self.kda.free(slot)

    def finish(self, req: Request) -> None:
        """A finished request: its slot and pages parked under its state id (keep_state), else freed."""
        if req.state_id is None:
            self.free(req)
            return
        req.keep_routes(self.route_log)
        self.kept_states.park(req.state_id, Parked(req.rid, req.slot, list(req.tokens), set(req.weight_versions),
                                                   req.lora, req.record, list(req.routes), req.num_routed))

    def free(self, req: Request) -> None:
        if req.slot is not None:  # a snapshotted state's turn never admitted holds pages only
            self.kda.free(req.slot)
        if req.restore is not None:
            self.kept_states.snapshot_gone()
        self.cache.free(req.rid)
        req.slot, req.kept, req.restore = None, 0, None  # recomputed from its first token if it runs again

    def retract(self, req: Request) -> None:
        """End `req`'s run without finishing it (a partial rollout's stop): its slot and pages freed like `free`,
        its tokens, log-probs and versions kept, and its decode-step routes moved from the RouteLog to its host
        routes (the log is cleared after the run; the request continues in a later one). Counted in `retracted`:
        the tokens whose state the next run recomputes, and the bytes of its slot and of the pages no other request
        holds (each page shared by forks is counted once, by the last of its holders to be retracted)."""
        pages = self.cache.page_table(req.rid)
        self.retracted.add(self.cache.seq_len(req.rid),
                           self._slot_bytes + self._page_bytes * sum(self.cache.refcount(p) == 1 for p in pages))
        self.free(req)
        req.keep_routes(self.route_log)

    def drain(self) -> None:
        self.lockstep.drain(self._idle_forward)

    # ---- memory ---------------------------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        if "kv_cache" in tags:
            self.kept_states.forget_states()
            self.kda.release()
            self.cache.release()
        if self.graph is not None and ("cuda_graph" in tags or "kv_cache" in tags):
            self.graph.release_graphs()  # graphs hold the pools' addresses: never replay them after a move

    def resume(self, tags: list[str], released: set[str]) -> None:
        if "kv_cache" in tags and "kv_cache" in released:
            self.kda.resume()
            self.cache.resume()
            self.graph = self._make_graph_decoder()

    def drawn_seed(self) -> int:
        """A sampling seed from torch's global RNG; under TP rank 0's (broadcast), so every rank of the group
        samples the same tokens whatever its RNG state."""
        seed = torch.randint(0, 2**62, (1,))
        if self.ctx.tp_size > 1:
            group = self.ctx.tp_group
            seed = seed.to(self.device)
            dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
        return int(seed.item())

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

    # ---- forwards -------------------------------------------------------------------------------------
    def _busy(self) -> None:
        """Before one of this engine's own forwards: its lockstep vote, with the adapter bound (nothing without
        lockstep)."""
        if self.lockstep.active:
            self.lockstep.busy(self.adapters.index(self.adapters.bound_name))

    @torch.no_grad()
    def _idle_forward(self, adapter: int) -> None:
        """One token through the model, dropped: this rank's part in a forward of other ranks (lockstep), with their
        adapter bound (the rows they send to this rank's experts meet its expert LoRA)."""
        self.adapters.bind(self.adapters.name_at(adapter), self.version())
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), return_logits=False)

    def prefill(self, heads: list[Request]) -> set[int]:
        """Chunked prefill of each head's tokens but the last, from its first position not kept (`Request.kept`: a
        turn on a kept state prefills only its new tokens), batched (right-padded) per adapter; returns the rids that
        could not reserve pages (their state is left partial: the caller frees them)."""
        failed: set[int] = set()
        chunk = self.config.prefill_chunk
        by_lora: dict[str | None, list[Request]] = {}
        for h in heads:
            by_lora.setdefault(h.lora, []).append(h)
            if h.kept:  # a turn on its kept (or restored) state
                self.kept_states.stats.continued += 1
                self.kept_states.stats.kept_tokens += h.kept
        for name, reqs in by_lora.items():
            longest = max(len(r.tokens) - 1 - r.kept for r in reqs)
            for start in range(0, longest, chunk):  # start: past each row's kept positions
                rows = [r for r in reqs if len(r.tokens) - 1 - r.kept > start and r.rid not in failed]
                for r in rows:
                    if not self.reserve(r.rid, min(chunk, len(r.tokens) - 1 - r.kept - start)):
                        failed.add(r.rid)
                rows = [r for r in rows if r.rid not in failed]
                width = min(chunk, longest - start)  # the padded width of this chunk's forwards
                rows_per_forward = max(1, self.config.max_prefill_tokens // width)
                for i in range(0, len(rows), rows_per_forward):
                    self.adapters.bind(name, self.version())
                    self.prefill_rows(rows[i:i + rows_per_forward], start, chunk)
        return failed

    def prefill_rows(self, rows: list[Request], start: int, chunk: int) -> None:
        """One prefill forward: each row's tokens kept + start .. kept + start + chunk - 1 (but its last token)."""
        pieces = [r.tokens[r.kept + start:min(r.kept + start + chunk, len(r.tokens) - 1)] for r in rows]
        self.prefill_tokens += sum(map(len, pieces))
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
        assert stored, "pages were reserved by prefill"
        version = self.version()
        for r in rows:  # the state its first decode step reads was computed under this version
            r.weight_versions.add(version)
        if record:
            routes_BTLK = self.route_log.to_host(recorder.routes().view(len(rows), width, self.num_moe, -1))
            for b, (r, p) in enumerate(zip(rows, pieces)):
                if r.record:
                    r.add_routes(r.kept + start, routes_BTLK[b, :len(p)], self.route_log)

    def decode(self, running: list[Request]) -> list[Request]:
        """One token for every running request (one model step per adapter); returns the finished ones."""
        finished = []
        by_lora: dict[str | None, list[Request]] = {}
        for req in running:
            by_lora.setdefault(req.lora, []).append(req)
        text_fn = None if self.tokenizer is None else self.tokenizer.decode
        for name, reqs in by_lora.items():
            version = self.version()
            self.adapters.bind(name, version)
            logits = self.step([r.rid for r in reqs], [r.slot for r in reqs], [r.last_token for r in reqs],
                               reqs if any(r.record for r in reqs) else None)
            keys = torch.tensor([r.key for r in reqs])
            positions = torch.tensor([len(r.output) for r in reqs])
            params = [r.params for r in reqs]
            tokens, logprobs = sample(logits, params, keys, positions)
            filtering = [filters(p, logits.shape[-1]) for p in params]
            raw = unfiltered_logprobs(logits, params, tokens).tolist() if any(filtering) else None
            for b, (req, t, lp) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist())):
                req.output.append(t)
                req.token_versions.append(version)
                req.logprobs.append(lp)
                if filtering[b]:
                    req.unfiltered.append(raw[b])
                req.weight_versions.add(version)
                req.finish = check_stop(req.output, req.params, self.config.eos_token_ids, text_fn)
                if req.finish is not None:
                    finished.append(req)
        return finished

    def step(self, rids: list[int], slots: list[int], ids: list[int],
             recorded: list[Request] | None = None) -> torch.Tensor:
        """One decode token for each request (positions reserved); returns logits [B, V]. `recorded`: the
        requests (in order) whose routes of this step are kept (those with `record`)."""
        if self.graph is not None:  # in steps of at most the largest graph bucket
            chunks, routes, m = [], [], self.graph.max_batch
            split = len(ids) > m  # a graph's outputs are its static buffers: copied before it replays again
            for i in range(0, len(ids), m):
                logits = self.graph.decode(ids[i:i + m], slots[i:i + m], rids[i:i + m])
                chunks.append(logits.clone() if split else logits)
                if recorded is not None:
                    step = self.graph.last_routes(len(logits))
                    routes.append(step.clone() if split else step)
            for rid in rids:
                self.cache.advance(rid, 1)
            if recorded is not None:
                self.route_log.keep_step(recorded, routes[0] if len(routes) == 1 else torch.cat(routes))
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        slots_t = torch.tensor(slots, device=self.device)
        state = pooled_state(self.cfg, self.kda, slots_t, self.cache, rids)
        self._busy()
        with recording(self.model) if recorded is not None else contextlib.nullcontext() as recorder:
            out = self.model.step(torch.tensor(ids, device=self.device), state)
        stored = store_state(self.cfg, out.state, self.kda, slots_t, self.cache, rids)
        assert stored, "positions were reserved by the scheduler's make_room"
        if recorded is not None:
            self.route_log.keep_step(recorded, recorder.routes())
        return out.logits
