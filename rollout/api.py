"""The rollout side's one contract: what every engine (`engine.backend`: native `RolloutEngine`, sglang
`SGLangEngine`) offers the loop, the records its `generate` returns, and the two rules both follow (weight
versions only move forward; memory is released and resumed by tag). No torch here: the trainer, the evals and the
tests read this contract without building an engine.

* `Engine`: the `typing.Protocol` both engines satisfy (`isinstance(engine, Engine)` checks the names).
* `generate(...)` returns one record per sample, prompt i's sample j at i * n + j: a `SampleRecord`
  {output_ids, meta_info: `MetaInfo`} or an `ErrorRecord` {error, meta_info: {finish_reason: {type: abort,
  message}}}. The `meta_info` keys are SGLang's, so a caller reads both engines alike.
* `VersionedEngine`: the `weight_version` property with a checked setter, and `next_version` for a push.
* `check_tags`: the memory tags a release/resume acts on; each backend's set is a constant here.
"""
from __future__ import annotations

from typing import Any, Literal, NotRequired, Protocol, TypedDict, runtime_checkable

NATIVE_MEMORY_TAGS = ("kv_cache", "cuda_graph")
"""The native engine's releasable memory (the base weights are the trainer's: it owns their memory)."""
SGLANG_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's releasable memory (`weights` needs sglang.enable_weights_cpu_backup)."""


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
    """"native" or "sglang" (`EngineConfig.backend`)."""
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
