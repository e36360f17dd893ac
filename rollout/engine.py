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
from typing import Any

import torch

from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.lora import LoRAConfig
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.rollout.adapters import AdapterBank, share_base
from miles_k3.rollout.api import (
    NATIVE_MEMORY_TAGS,
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
from miles_k3.rollout.sampling import SamplingParams
from miles_k3.rollout.scheduler import Scheduler


class RolloutEngine(VersionedEngine):
    """generate / load_lora_adapter_from_tensors / update_weights_from_tensor / weight_version / flush_cache /
    pause_generation / continue_generation / release_memory_occupation / resume_memory_occupation / close
    (`rollout.api.Engine`)."""

    backend = "native"
    push_needs_memory = False  # a push copies tensors into the adapter buffers: no request runs

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
        self._active = 0  # generate() calls in flight (other threads may pause, push weights, release)

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

    # ---- public API --------------------------------------------------------------------------------
    def generate(self, input_ids: list[list[int]] | None = None, prompts: list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, n: int = 1, return_logprob: bool = True,
                 lora: str | list[str | None] | None = None, return_routed_experts: bool = False) -> list[Record]:
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
        """
        ids, params, loras = generate_requests(input_ids, prompts, sampling_params, n, lora, self.tokenizer,
                                               self._released)
        if return_routed_experts and not self.runner.num_moe:
            raise ValueError("return_routed_experts: this model has no MoE layers, so there are no routes")
        results: list[dict | None] = [None] * (len(ids) * n)
        groups = deque()
        for i, (p, sp, name) in enumerate(zip(ids, params, loras)):
            try:
                groups.append(self._make_group(i, n, p, sp, name, return_routed_experts))
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
        tags = check_tags(tags, NATIVE_MEMORY_TAGS, "native")
        with self._lock:
            if self._active:
                raise RuntimeError("release_memory_occupation: generate() is running; release when idle")
            self.runner.release(tags)
            self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Reallocate what `tags` released (None = all): `kv_cache` zeroed pools (addresses may change),
        `cuda_graph` lets decode graphs be captured again (lazily, on their next use)."""
        tags = check_tags(tags, NATIVE_MEMORY_TAGS, "native")
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
        if return_logprob:
            meta["output_token_logprobs"] = list(zip(req.logprobs, req.output))
            if req.unfiltered:  # the sampling was filtered: the same tokens under the unfiltered distribution
                meta["output_token_logprobs_unfiltered"] = list(req.unfiltered)
        if req.record:
            routes = req.routed(self.runner.route_log)
            assert routes.shape[0] == len(req.tokens) - 1, (routes.shape, len(req.tokens))
            meta["routed_experts"] = routes
        return {"output_ids": list(req.output), "meta_info": meta}
