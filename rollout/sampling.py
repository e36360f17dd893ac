"""Per-request sampling for the rollout engine: SGLang-named `SamplingParams` validated at the request
boundary, a batched fp32 sampler (`sample`) whose per-row result depends only on that row's logits, params
and noise key (seed, position), and `check_stop`, which turns the tokens generated so far into an SGLang-style
finish reason. Shape legend: B = batch rows (one per running request), V = vocabulary size.

Semantics, fixed here once:

* Filtering order: temperature -> top-k -> top-p -> min-p. top-k keeps the k largest logits (ties at the
  boundary go to the lower token id); top-p keeps the smallest prefix of the sorted top-k survivors whose
  cumulative probability (renormalised over those survivors) is >= top_p; min-p keeps tokens whose
  probability is >= min_p * (max probability). min-p is invariant to renormalisation, so the reference
  distribution for it does not matter.
* Logprob of a sampled row (temperature > 0): log-softmax of (logits / temperature) over the tokens that
  survive filtering, i.e. the log-probability of the token under the distribution it was actually drawn
  from. This matches SGLang's processed-logprob convention (temperature applied, filtered and
  renormalised). Note it is NOT the raw model logprob the trainer computes unless temperature == 1 and
  every filter is off.
* Greedy rows (temperature == 0): token = argmax of the raw logits (ties -> lowest id); logprob =
  log-softmax of the raw logits at temperature 1, so it equals the trainer's logprob of that token.
* Noise and batch invariance: a sampled row takes argmax(log p - log E) over V Exp(1) variates E
  (exponential race, equivalent to Gumbel-max) that are a hash of (key, position, token id)
  (`keyed_exp_noise`, defined beside its Triton twin in `miles_k3.kernels.sampling`): counter-based, so there
  is no generator state to carry, a preempted and recomputed request redraws the same noise, the whole batch
  draws in a few kernels, and the token for a key is the same alone or inside any batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

# The noise lives in the kernels (the lowest layer; torch only, beside its Triton twin's module); the names stay
# importable here.
from miles_k3.kernels.noise import (  # noqa: F401 (re-exported)
    exp_noise_from_row_keys,
    keyed_exp_noise,
    noise_row_keys,
)


@dataclass
class SamplingParams:
    """One request's sampling parameters (SGLang `sampling_params` key names and defaults)."""

    max_new_tokens: int = 128
    """Hard cap on generated tokens; finish reason "length" when reached. >= 1."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax). >= 0 and finite."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 = off."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off (0 is accepted as off and normalised to -1)."""
    min_p: float = 0.0
    """Drop tokens with prob < min_p * max prob; in [0, 1); 0 = off."""
    stop: list[str] | None = None
    """Stop strings (a single str is accepted and wrapped); each non-empty. Needs a detokenizer."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (always honoured, also with ignore_eos); each >= 0."""
    ignore_eos: bool = False
    """Do not stop on the model's eos ids (passed to `check_stop` by the caller)."""
    sampling_seed: int | None = None
    """Noise key of this request (sample j of n uses seed + j); None = drawn from torch's global RNG."""

    @classmethod
    def from_dict(cls, d: dict | None, where: str) -> SamplingParams:
        """Build from a request's `sampling_params` dict; `where` names the request in errors.

        Raises ValueError naming the field, the value, the allowed range and `where` for unknown keys
        and out-of-range or wrongly typed values.
        """
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown sampling_params key(s) {unknown}; allowed: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("top_k") == 0 and not isinstance(d.get("top_k"), bool):
            d["top_k"] = -1
        params = cls(**d)
        params.check(where)
        return params

    def check(self, where: str) -> None:
        """Validate every field; raise ValueError naming field, value, allowed range and `where`."""
        _need(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
              "max_new_tokens", self.max_new_tokens, "an int >= 1", where)
        _need(_is_num(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
              "temperature", self.temperature, "a finite number >= 0 (0 = greedy)", where)
        _need(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]", where)
        _need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
              "top_k", self.top_k, "-1 or 0 (off) or an int >= 1", where)
        _need(_is_num(self.min_p) and 0 <= self.min_p < 1, "min_p", self.min_p, "a number in [0, 1)", where)
        _need(self.stop is None or (isinstance(self.stop, list)
                                    and all(isinstance(s, str) and s for s in self.stop)),
              "stop", self.stop, "None or a list of non-empty strings", where)
        _need(self.stop_token_ids is None or (isinstance(self.stop_token_ids, list)
                                              and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)),
              "stop_token_ids", self.stop_token_ids, "None or a list of ints >= 0", where)
        _need(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool", where)
        _need(self.sampling_seed is None or _is_int(self.sampling_seed),
              "sampling_seed", self.sampling_seed, "None or an int", where)

    def validate(self, vocab_size: int, where: str = "request") -> None:
        """Full check plus model-dependent bounds: every stop token id must be < `vocab_size`."""
        self.check(where)
        for t in self.stop_token_ids or []:
            _need(t < vocab_size, "stop_token_ids", self.stop_token_ids,
                  f"ids in [0, {vocab_size}) (vocab_size={vocab_size})", where)

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax (temperature == 0)."""
        return self.temperature == 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _need(ok: bool, field: str, value: object, allowed: str, where: str) -> None:
    if not ok:
        raise ValueError(f"{where}: sampling_params.{field}={value!r} is invalid; expected {allowed}")


def filters(p: SamplingParams, vocab: int) -> bool:
    """True when the request samples from a filtered distribution (not greedy, and top-k < vocab, top-p < 1 or
    min-p > 0): its reported log-probs are then those of the filtered, renormalised distribution."""
    return not p.greedy and ((0 < p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0)


def _no_row_filters(params: Sequence[SamplingParams], vocab: int) -> bool:
    """True when no row filters: every row is greedy or has top-k off (or >= vocab), top-p 1 and min-p 0."""
    return not any(filters(p, vocab) for p in params)


def unfiltered_logprobs(logits_BV: Tensor, params: Sequence[SamplingParams], ids_B: Tensor) -> Tensor:
    """fp32 [B]: the log-prob of token ids_B[b] under the unfiltered distribution at the row's temperature
    (log-softmax of logits / temperature over the whole vocabulary; temperature 1 for greedy rows): what the
    trainer computes, against the filtered log-prob `sample` reports for rows that filter."""
    temp_B = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits_BV.device)
    logp_BV = torch.log_softmax(logits_BV.float() / temp_B[:, None], dim=-1)
    return logp_BV.gather(1, ids_B.to(logits_BV.device)[:, None]).squeeze(1)


def filtered_logprobs(logits_BV: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """fp32 [B, V] log-probabilities after temperature -> top-k -> top-p -> min-p (see module docstring).

    Filtered-out tokens get -inf. Greedy rows (temperature 0) are returned as log-softmax of the raw
    logits at temperature 1 with no filtering.
    """
    x_BV = logits_BV.float()
    V = x_BV.shape[-1]
    dev = x_BV.device
    temp_B = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    top_k_B = torch.tensor([p.top_k if p.top_k > 0 and not p.greedy else V for p in params], device=dev)
    top_p_B = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=dev)
    min_p_B = torch.tensor([0.0 if p.greedy else p.min_p for p in params], device=dev)

    x_BV = x_BV / temp_B[:, None]
    if _no_row_filters(params, V):
        return torch.log_softmax(x_BV, dim=-1)  # nothing to filter: the sort below would keep every token
    sorted_BV, order_BV = torch.sort(x_BV, dim=-1, descending=True, stable=True)
    rank_V = torch.arange(V, device=dev)
    keep_BV = rank_V[None, :] < top_k_B[:, None]
    probs_BV = torch.softmax(sorted_BV.masked_fill(~keep_BV, -math.inf), dim=-1)
    # Keep rank i while the mass strictly before it is < top_p: the smallest prefix with cum >= top_p.
    mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
    keep_BV &= (mass_before_BV < top_p_B[:, None]) | (rank_V[None, :] == 0)
    keep_BV &= probs_BV >= min_p_B[:, None] * probs_BV[:, :1]
    keep_vocab_BV = torch.zeros_like(keep_BV).scatter_(1, order_BV, keep_BV)
    return torch.log_softmax(x_BV.masked_fill(~keep_vocab_BV, -math.inf), dim=-1)


def sample(logits_BV: Tensor, params: Sequence[SamplingParams], keys_B: Tensor, positions_B: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """Sample one token per row: argmax(filtered logprob + Gumbel noise keyed by (key, position)), so the same
    (logits row, params, key, position) gives the same token in any batch, and the whole batch draws at once.

    logits_BV: [B, V] any float dtype (upcast to fp32); params: B `SamplingParams`; keys_B / positions_B:
    int64 [B] (a request's seed and its output index). Returns (token ids [B] int64, logprob [B] fp32): under
    the filtered distribution at the request's temperature for sampled rows, under the raw logits at
    temperature 1 for greedy rows (module docstring).

    On CUDA, when no row filters (`_no_row_filters`), one fused Triton kernel
    (`miles_k3.kernels.sampling.sample_unfiltered`) does the whole step instead of the dozen [B, V] kernels
    below; it draws the same noise and returns the same tokens except on rounding near-ties of the scores (a
    few ulp; see that module's docstring), and logprobs equal to ~1e-6."""
    if logits_BV.is_cuda and _no_row_filters(params, logits_BV.shape[-1]):
        from miles_k3.kernels.sampling import sample_unfiltered

        dev = logits_BV.device
        temp_B = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32,
                              device=dev)  # 0 = greedy
        return sample_unfiltered(logits_BV, temp_B, keys_B.to(dev), positions_B.to(dev))
    logp_BV = filtered_logprobs(logits_BV, params)
    greedy_B = torch.tensor([p.greedy for p in params], device=logp_BV.device)
    noise_BV = keyed_exp_noise(keys_B.to(logp_BV.device), positions_B.to(logp_BV.device), logp_BV.shape[1])
    scores_BV = torch.where(greedy_B[:, None], logp_BV, logp_BV - torch.log(noise_BV))
    ids_B = scores_BV.argmax(dim=-1)
    return ids_B, logp_BV.gather(1, ids_B[:, None]).squeeze(1)


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended, shaped like SGLang's `meta_info["finish_reason"]`.

    `matched` is the stop token id or stop string for "stop", None for "length".
    """

    type: Literal["stop", "length"]
    matched: int | str | None = None

    def to_dict(self) -> dict:
        """`{"type": ..., "matched": ...}` as in SGLang's meta_info."""
        return {"type": self.type, "matched": self.matched}


STOP_WINDOW_SLACK = 8
"""Tokens decoded before the longest stop string could start, so that a detokenizer's context at the window's
edge (a leading-space marker, a byte-level piece) lies outside the string."""


def stop_window(stops: Sequence[str]) -> int:
    """Output tokens `check_stop` decodes for stop strings `stops`: a token decodes to at least one UTF-8 byte
    (special tokens a decoder skips aside), so a stop string of C characters (at most 4 bytes each) that the last
    token completed began within the last 4 C tokens; `STOP_WINDOW_SLACK` more keep the window's edge clear."""
    return 4 * max(len(s) for s in stops) + STOP_WINDOW_SLACK


def check_stop(
    output_ids: Sequence[int],
    params: SamplingParams,
    eos_ids: Sequence[int] = (),
    text_fn: Callable[[Sequence[int]], str] | None = None,
) -> FinishReason | None:
    """Finish reason after the newest token of `output_ids` (generated tokens only), or None to continue.

    Checked in order, so a stop beats length when the last allowed token is also a stop:
    1. last token in `params.stop_token_ids` -> stop (honoured even with ignore_eos);
    2. last token in the model's `eos_ids` and not `params.ignore_eos` -> stop;
    3. `params.stop` string found in the decoded tail of `output_ids` -> stop (first listed string that matches);
    4. len(output_ids) >= max_new_tokens -> length.
    Stop strings: the token that completed the stop string is kept in the output ids and generation ends;
    ids are never truncated (the decoded text may extend past the stop string if that token spans it,
    callers that want SGLang's text cut it at the string). Call once per generated token, since only
    the last token is checked for ids, and only text the last token completed can newly hold a stop string:
    `text_fn` decodes the last `stop_window(params.stop)` tokens, not the whole output (the work per token
    does not grow with the output). Raises ValueError if stop strings are set and `text_fn` is None.
    """
    if not output_ids:
        return None
    last = output_ids[-1]
    if last in (params.stop_token_ids or ()):
        return FinishReason("stop", last)
    if not params.ignore_eos and last in eos_ids:
        return FinishReason("stop", last)
    if params.stop:
        if text_fn is None:
            raise ValueError("check_stop: sampling_params.stop is set but no detokenizer (text_fn) was given")
        text = text_fn(output_ids[-stop_window(params.stop):])
        for s in params.stop:
            if s in text:
                return FinishReason("stop", s)
    if len(output_ids) >= params.max_new_tokens:
        return FinishReason("length")
    return None
