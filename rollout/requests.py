"""A native-engine request's state while it is served (`Request`: tokens, log-probs, its slot, the routes of every
position it processed, kept through `route_log.RouteLog`), and the checked arguments of an engine's `generate`
(`generate_requests`, shared by the native and the SGLang engines)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from miles_k3.rollout.route_log import RouteLog
from miles_k3.rollout.sampling import FinishReason, SamplingParams


@dataclass(eq=False)
class Request:
    rid: int
    index: int
    prompt: list[int]
    params: SamplingParams
    key: int  # sampling noise key: sampling_seed + sample index, or drawn from torch's global RNG
    lora: str | None
    cached: int = 0  # prompt tokens reused from a forked prefill
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    unfiltered: list[float] = field(default_factory=list)  # requests that filter (top-p/top-k/min-p) only
    slot: int | None = None
    finish: FinishReason | None = None
    weight_versions: set[int] = field(default_factory=set)
    record: bool = False  # return_routed_experts: keep the routes of every position processed
    routes: list[torch.Tensor] = field(default_factory=list)  # host int16 [positions, L, K] chunks, in order
    log_rows: list[int] = field(default_factory=list)  # then these decode positions' rows of the engine's RouteLog
    num_routed: int = 0  # positions 0 .. num_routed - 1 have routes
    token_versions: list[int] = field(default_factory=list)  # the weight version that sampled each output token
    group: int | None = None  # the engine's partial-queue group id (`RolloutEngine.submit`); None under generate
    state_id: int | None = None  # keep_state: the id its slot and pages are parked under when it finishes
    kept: int = 0  # positions of state its slot and pages hold when admitted (a kept state's), else 0
    restore: list | None = None  # a snapshotted kept state's KDA state (host): copied into the slot it is admitted to

    def add_routes(self, first: int, routes_TLK: torch.Tensor, log: RouteLog) -> None:
        """Routes of positions first .. first + T - 1 (host); positions already routed keep their first routes
        (a preempted request's recompute: the routes its tokens were sampled with)."""
        skip = self.num_routed - first
        if skip < 0:
            raise RuntimeError(f"routes of request {self.rid}: positions {self.num_routed}..{first - 1} were "
                               "never recorded")
        if skip < routes_TLK.shape[0]:
            if self.log_rows:  # the decode rows so far come first
                self.routes.append(log.gather(self.log_rows))
                self.log_rows = []
            self.routes.append(routes_TLK[skip:])
            self.num_routed = first + routes_TLK.shape[0]

    def keep_routes(self, log: RouteLog) -> None:
        """Move this request's rows of the engine's RouteLog into its host routes (they survive the log's clear)."""
        if self.log_rows:
            self.routes.append(log.gather(self.log_rows))
            self.log_rows = []

    def routed(self, log: RouteLog) -> torch.Tensor:
        """All routes, [num_routed, L, K]."""
        log.wait()  # the prefill's and the decode steps' copies to the host have landed
        return torch.cat(self.routes + ([log.gather(self.log_rows)] if self.log_rows else []))

    def fork_from(self, head: Request, slot: int) -> None:
        """This request is a fork of `head` (the same prompt) on state slot `slot`: it shares the head's prefill,
        so its cached tokens, the prefill's routes and the weight version the prefill ran under (no output yet, so no
        token versions)."""
        self.slot, self.cached = slot, len(head.tokens) - 1
        self.routes, self.num_routed = list(head.routes), head.num_routed
        self.log_rows = list(head.log_rows)
        self.weight_versions = set(head.weight_versions)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        """The newest token (what the next decode step feeds), without copying `tokens`."""
        return self.output[-1] if self.output else self.prompt[-1]


def generate_requests(input_ids, prompts, sampling_params, n: int, lora, tokenizer, released: set[str]):
    """The checked arguments of an engine's `generate`: (prompt token ids, sampling params per prompt, adapter name
    per prompt). One dict or adapter name applies to every prompt; a list needs one entry per prompt."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    if released:
        raise RuntimeError(f"generate: memory {sorted(released)} is released; call resume_memory_occupation() first")
    if (input_ids is None) == (prompts is None):
        raise ValueError("generate: pass exactly one of input_ids (token id lists) or prompts (strings)")
    if input_ids is not None:
        ids = [list(map(int, p)) for p in input_ids]
    elif tokenizer is None:
        raise ValueError("generate: prompts given as text but the engine has no tokenizer; pass input_ids")
    else:
        ids = [tokenizer.encode(p) for p in prompts]
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(ids)
    loras = lora if isinstance(lora, list) else [lora] * len(ids)
    if len(params) != len(ids) or len(loras) != len(ids):
        raise ValueError(f"sampling_params ({len(params)}) and lora ({len(loras)}) lists must have one entry per "
                         f"prompt ({len(ids)})")
    return ids, params, loras
