"""The rollout side's one contract: what every engine (`engine.backend`: native `RolloutEngine`, sglang
`SGLangEngine`) offers the loop, what each can do beyond it, the records its `generate` returns, and the two rules
both follow (weight versions only move forward; memory is released and resumed by tag). No torch here: the
trainer, the evals, the config checks and the tests read this contract without building an engine.

* `Engine`: the `typing.Protocol` both engines satisfy (`isinstance(engine, Engine)` checks the names).
* `EngineCapabilities`: what an engine can do beyond `Engine`, declared per backend (`capabilities(backend)`, which
  the config checks ask before an engine exists) and on every engine (`engine.capabilities`, which run-time callers
  ask). Backend names are compared in this table and in the factory that builds the engine, nowhere else.
* `KeptStateEngine`, `PartialQueue`: the optional interfaces two capabilities stand for (`keeps_state`: a
  conversation's state kept between its turns; `partial_queue`: `engine.queue`, partial rollouts served across
  pushes).
* `generate(...)` returns one record per sample, prompt i's sample j at i * n + j: a `SampleRecord`
  {output_ids, meta_info: `MetaInfo`} or an `ErrorRecord` {error, meta_info: {finish_reason: {type: abort,
  message}}}. The `meta_info` keys are SGLang's, so a caller reads both engines alike.
* `VersionedEngine`: the `weight_version` property with a checked setter, and `next_version` for a push.
* `check_tags`: the memory tags a release/resume acts on; each backend's set is a constant here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, Protocol, TypedDict, runtime_checkable

NATIVE_MEMORY_TAGS = ("kv_cache", "cuda_graph")
"""The native engine's releasable memory (the base weights are the trainer's: it owns their memory)."""
SGLANG_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's releasable memory (`weights` needs sglang.enable_weights_cpu_backup)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond the `Engine` contract. Each backend's are in `BACKEND_CAPABILITIES`; an engine
    sets its own from there (`engine.capabilities`). Every field's default is "no": `EngineCapabilities()` is an
    engine that only generates (a scripted double in the tests)."""

    in_process_model: bool = False
    """The engine generates in this process over the caller's K3 model, sharing its base tensors (native): the
    model's kernels and mesh apply (an engine colocated on every dp / tp rank), a push goes through the `sync:`
    channel, the context is engine.max_context, and the commands that build the model for it (serve, env=agent's
    server, SFT's eval) need it. False: a server program serves a checkpoint directory in processes of its own
    (SGLang, configured by `sglang:`: its context length, its checks of a K3 checkpoint, its own push channel)."""
    keeps_state: bool = False
    """A multi-turn conversation's state (KDA slot, latent pages) kept in the engine between its turns:
    `generate(keep_state=True, states=[...])` and the rest of `KeptStateEngine`."""
    partial_queue: bool = False
    """Partial rollouts (rollout.mode=partial): groups queued, served until K finish, the others paused across a push
    and continued (`PartialQueue`: submit / run / cancel / queue_state / load_queue_state)."""
    records_routes: bool = False
    """`generate(return_routed_experts=True)` records every position's routed experts (routing replay)."""
    unfiltered_logprobs: bool = False
    """Under top-p / top-k the records carry the sampled tokens' log-probs under the unfiltered distribution too
    (`output_token_logprobs_unfiltered`), which the loss can use."""
    timing: bool = False
    """`engine.timing`: seconds of prefill, decode and its tail, and decode steps, over the engine's life."""
    memory_tags: tuple[str, ...] = ()
    """The memory tags `release_memory_occupation` / `resume_memory_occupation` take (`check_tags`)."""


BACKEND_CAPABILITIES: dict[str, EngineCapabilities] = {
    "native": EngineCapabilities(in_process_model=True, keeps_state=True, partial_queue=True, records_routes=True,
                                 unfiltered_logprobs=True, timing=True, memory_tags=NATIVE_MEMORY_TAGS),
    # SGLang 0.5.17's offline Engine: no kept state between requests, no pause (its pause_generation is an HTTP
    # endpoint), no routes for this backend (`config_checks.check_routes` says why), filtered log-probs only.
    "sglang": EngineCapabilities(memory_tags=SGLANG_MEMORY_TAGS),
}
"""engine.backend -> what its engine can do: the one table of backend names outside the factory
(`rollout.factory.build_engine`)."""


def capabilities(backend: str) -> EngineCapabilities:
    """What the engine `backend` (an engine.backend value) can do; ValueError naming the backends for another."""
    caps = BACKEND_CAPABILITIES.get(backend)
    if caps is None:
        raise ValueError(f"backend: '{backend}' is not one of {', '.join(BACKEND_CAPABILITIES)}")
    return caps


class FinishDict(TypedDict):
    """SGLang's `meta_info["finish_reason"]`: type stop (matched: the stop token id or string), length, or abort
    (message: why)."""

    type: Literal["stop", "length", "abort"]
    matched: NotRequired[int | str | None]
    message: NotRequired[str]


class MetaInfo(TypedDict):
    """A sample's `meta_info` (SGLang's key names). `weight_version`: the newest version any of its tokens was
    computed under; `weight_versions`: all of them, sorted (the prefill's included: a push between the prefill and
    the first decode step shows as two versions). The optional keys appear as `generate` documents."""

    finish_reason: FinishDict
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: int
    weight_versions: list[int]
    output_token_logprobs: NotRequired[list[tuple[float, int]]]
    """return_logprob: (logprob, token id) per output token, of the distribution sampled from."""
    output_token_logprobs_unfiltered: NotRequired[list[float]]
    """A request that filters (top-p / top-k / min-p): the same tokens under the unfiltered distribution."""
    routed_experts: NotRequired[Any]
    """return_routed_experts: int16 tensor [prompt + completion - 1, MoE layers, top_k] (native engine only)."""
    output_token_weight_versions: NotRequired[list[int]]
    """The weight version that sampled each output token (native engine; a retracted and continued request spans
    versions)."""


class SampleRecord(TypedDict):
    output_ids: list[int]
    meta_info: MetaInfo


class ErrorRecord(TypedDict):
    """A request the engine rejected (bad sampling params, a prompt too long, an unknown adapter, an abort)."""

    error: str
    meta_info: dict[str, FinishDict]


Record = SampleRecord | ErrorRecord


def error_record(message: str) -> ErrorRecord:
    """The record of a rejected request: `error` and an abort finish reason, both carrying `message`."""
    return {"error": message, "meta_info": {"finish_reason": {"type": "abort", "message": message}}}


def sample_meta(finish: FinishDict, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                versions: set[int] | list[int]) -> MetaInfo:
    """The keys every sample's `meta_info` has, from the versions its tokens were computed under (at least one)."""
    if not versions:
        raise ValueError("sample_meta: a sample has at least one weight version (its prefill's)")
    return {"finish_reason": finish, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens, "weight_version": max(versions), "weight_versions": sorted(versions)}


@runtime_checkable
class Engine(Protocol):
    """What the loop, the evals and the weight-sync channels call on a rollout engine."""

    backend: str
    """"native" or "sglang" (`EngineConfig.backend`), for logs and messages: ask `capabilities`, not the name."""
    capabilities: EngineCapabilities
    """What it can do beyond this contract (`BACKEND_CAPABILITIES[backend]`)."""
    push: str | None
    """How a push serves adapter tensors: None (the native engine: copied under the model's names into the
    adapter's buffers), "lora" (SGLang's LoRA: PEFT names) or "merged" (merged into SGLang's base weights)."""
    push_needs_memory: bool
    """A push generates (SGLang's parity probe): the loop resumes released memory before it."""
    max_context: int
    """Prompt + completion tokens a request may hold."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, input_ids: list[list[int]] | None = None, prompts: list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, n: int = 1, return_logprob: bool = True,
                 lora: str | list[str | None] | None = None, return_routed_experts: bool = False) -> list[Record]:
        """`n` records per prompt, prompt i's sample j at i * n + j. Sample j of a prompt with `sampling_seed` s
        uses seed s + j. An engine that cannot record routes raises ValueError for return_routed_experts=True."""
        ...

    def load_lora_adapter_from_tensors(self, name: str, tensors: Any, config: Any) -> None: ...

    def update_weights_from_tensor(self, named_tensors: Any, lora_name: str | None = None,
                                   weight_version: int | None = None) -> None: ...

    def release_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    def flush_cache(self) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class KeptStateEngine(Protocol):
    """An engine with `capabilities.keeps_state`: `generate(keep_state=True)` parks every sample's state when it
    finishes, under the id in its `meta_info["state_id"]`; `states[i]` continues one on prompt i (which extends its
    tokens), prefilling only the new tokens. (A kept state is the engine's; a *session* is a conversation on the
    OpenAI-compatible server, `rollout/server/sessions.py`, which keeps one state in the engine.)"""

    def generate(self, input_ids: list[list[int]] | None = None, prompts: list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, n: int = 1, return_logprob: bool = True,
                 lora: str | list[str | None] | None = None, return_routed_experts: bool = False,
                 keep_state: bool = False, states: list[int | None] | None = None) -> list[Record]: ...

    def release_states(self, state_ids: Iterable[int]) -> None:
        """Free these kept states; an id not open is a ValueError naming it."""
        ...

    @property
    def kept_state_stats(self) -> dict[str, int]:
        """Counters of kept states (parked, continued, dropped, recomputed, ...) and every position prefilled."""
        ...


@runtime_checkable
class PartialQueue(Protocol):
    """`engine.queue` of an engine with `capabilities.partial_queue`: groups (a prompt's `n` samples) queued across
    calls, served by `run` until K finish, the unfinished ones retracted to the front (their tokens kept) and
    continued by the next run under the weights it serves."""

    def submit(self, input_ids: list[list[int]], sampling_params: dict | list[dict] | None = None, n: int = 1,
               lora: str | list[str | None] | None = None, return_routed_experts: bool = False,
               keep_state: bool = False, states: list[int | None] | None = None) -> list[int]:
        """Queue each prompt's group; the new group ids."""
        ...

    def run(self, finished_groups: int | None = None, must_finish: Iterable[int] = (), return_logprob: bool = True,
            until: Callable[[], bool] | None = None,
            on_finished: Callable[[int, list[Record]], None] | None = None) -> list[tuple[int, list[Record]]]:
        """Serve the queue until the stop condition; (group id, its records) of each group finished."""
        ...

    @property
    def retracted(self) -> Any:
        """What the last `run` retracted at its stop: `requests`, `tokens` (of state the next run recomputes),
        `bytes` (of the slots and pages they held)."""
        ...

    def cancel(self, group_ids: Iterable[int]) -> None: ...

    def queued_groups(self) -> list[int]: ...

    def queue_state(self) -> dict:
        """The queue as plain data and host tensors (a checkpoint's)."""
        ...

    def load_queue_state(self, state: dict) -> None: ...


def check_forward(old: int, new: int, *, strict: bool) -> None:
    """The version rule: weight versions only move forward. A push (`strict`) must carry a newer version than the
    one served; setting the served version may repeat it. ValueError naming both otherwise."""
    if isinstance(new, bool) or not isinstance(new, int):
        raise TypeError(f"weight_version: must be an int, got {new!r}")
    if new < old or (strict and new == old):
        raise ValueError(f"weight_version: versions only move forward; the engine serves version {old}, the "
                         f"{'push has' if strict else 'new version is'} {new}")


class VersionedEngine:
    """`weight_version` (the version of the adapter an engine serves) with the version rule enforced on every
    write: an engine's own push, a channel's commit, the loop stating what a resumed checkpoint serves."""

    _weight_version: int = 0

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        check_forward(self._weight_version, version, strict=False)
        self._weight_version = version

    def next_version(self, proposed: int | None) -> int:
        """The version a push serves: `proposed` (newer than the served one, else ValueError) or one more."""
        if proposed is None:
            return self._weight_version + 1
        check_forward(self._weight_version, proposed, strict=True)
        return proposed


def check_tags(tags: list[str] | None, supported: tuple[str, ...], backend: str) -> list[str]:
    """The memory tags a release/resume acts on: `tags`, or all of `supported` for None. An unknown tag is a
    ValueError naming the ones `backend` supports."""
    if tags is None:
        return list(supported)
    bad = [t for t in tags if t not in supported]
    if bad:
        raise ValueError(f"memory tags {bad} are not supported by the {backend} engine; it has {list(supported)}")
    return list(tags)
