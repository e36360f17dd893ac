"""reward.name=remote: the rollouts' rewards scored by a judge server over HTTP, in batches.

`RemoteReward(cfg)` is the reward function (`rewards.build_reward` builds it from `reward.remote.*`, a
`RemoteRewardConfig`). Each call POSTs the responses and their gold answers to `cfg.url`, at most
`cfg.batch_size` items per request, one request after another, with a sync `httpx.Client`.

Wire protocol (what a judge server implements):

    request:  POST <url>
              Content-Type: application/json
              Authorization: Bearer <token>     (only when reward.remote.api_key_env names a variable)
              {"items": [{"response": "<text>", "gold": "<text>"}, ...]}      # 1 .. batch_size items
    response: HTTP 200, Content-Type: application/json
              {"scores": [<number>, ...],       # one finite number per item, in the items' order
               "correct": [<bool>, ...]}        # optional, same length; default: score >= 1.0

A request that fails with a connection error, a timeout (`timeout_s`), HTTP 5xx or 429 is tried again, up to
`retries` more times, after sleeping `backoff_s * 2**(k-1)` before retry k; any other non-2xx status is not
retried. A batch that still fails, or whose response is malformed (not JSON, no "scores" list, a "scores" or
"correct" list of the wrong length), fails all its items; a single score that is not a finite number (NaN,
infinity, a string, a bool), or a "correct" entry that is not a bool, fails only its item. A failed item's
result is `RewardResult(0.0, False, {"remote": "<reason>"}, failed=True)`: no reward could be computed, so the
sample is left out of the loss rather than scored 0. One warning is logged per failed batch. If more than
`max_failure_frac` of one call's samples failed, the call raises `RemoteRewardError` (the judge is down or
broken; training on the rest would be training on a biased remnant). The bearer token never appears in a log
record or an error message.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from miles_k3.evals.rewards import RewardResult

log = logging.getLogger(__name__)

BODY_EXCERPT_CHARS = 200
"""How much of a failed response's body its error reason quotes."""


@dataclass
class RemoteRewardConfig:
    """reward.name=remote: the judge server's URL, batching, time limits, retries and failure budget."""

    url: str = ""
    """The judge's POST endpoint, http:// or https:// (e.g. http://127.0.0.1:8001/score); required with
    reward.name=remote."""
    batch_size: int = 64
    """Items (response + gold) per request."""
    timeout_s: float = 30.0
    """Time limit of one request, in seconds (connect, read, write and pool, each)."""
    retries: int = 3
    """Extra attempts after a failed one (a connection error, a timeout, HTTP 5xx or 429; not other 4xx)."""
    backoff_s: float = 0.5
    """Sleep before retry k (k = 1, 2, ...): backoff_s * 2**(k-1) seconds."""
    max_failure_frac: float = 0.1
    """Per call: if more than this share of the call's samples could not be scored, the call raises
    RemoteRewardError (0: any failure raises; 1: never)."""
    api_key_env: str = ""
    """The name of an environment variable holding a bearer token, sent as 'Authorization: Bearer <token>'
    (never logged); empty: no Authorization header."""

    def validate(self) -> None:
        """Raise ValueError naming the field (`url: ...`) for an invalid value. An empty url passes here (the
        section is unused unless reward.name=remote; `RewardConfig.validate` requires it then)."""
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: must start with http:// or https://, got '{self.url}'")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s: must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"retries: must be >= 0, got {self.retries}")
        if not (math.isfinite(self.backoff_s) and self.backoff_s >= 0):
            raise ValueError(f"backoff_s: must be a finite number of seconds >= 0, got {self.backoff_s}")
        if not 0 <= self.max_failure_frac <= 1:
            raise ValueError(f"max_failure_frac: must be between 0 and 1, got {self.max_failure_frac}")
        if self.api_key_env and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is not set (or is "
                             "empty); it should hold the judge's bearer token")


class RemoteRewardError(RuntimeError):
    """Too many of one call's samples could not be scored by the judge (more than max_failure_frac)."""


class _BatchFailed(Exception):
    """A whole batch could not be scored; the message is the short reason."""


class RemoteReward:
    """The remote reward function: `(responses, golds) -> list[RewardResult]`, scored by the judge at `cfg.url`
    (module docstring: the wire protocol). `client` may be injected (tests); then `close()` leaves it open."""

    def __init__(self, cfg: RemoteRewardConfig, client: httpx.Client | None = None):
        cfg.validate()
        if not cfg.url:
            raise ValueError("url: the remote reward needs the judge's URL, e.g. http://127.0.0.1:8001/score")
        self.cfg = cfg
        self._token = os.environ[cfg.api_key_env] if cfg.api_key_env else ""
        self._headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._client = client if client is not None else httpx.Client()
        self._owns_client = client is None
        self._samples = 0
        self._failed = 0
        self._retries = 0
        self._seconds = 0.0

    def __call__(self, responses: list[str], golds: list[str]) -> list[RewardResult]:
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        start = time.monotonic()
        results: list[RewardResult] = []
        last_error = ""
        try:
            for lo in range(0, len(responses), self.cfg.batch_size):
                batch, error = self._score_batch(responses[lo:lo + self.cfg.batch_size],
                                                 golds[lo:lo + self.cfg.batch_size], lo)
                results.extend(batch)
                last_error = error or last_error
        finally:
            self._seconds += time.monotonic() - start
        failed = sum(r.failed for r in results)
        self._samples += len(results)
        self._failed += failed
        self._check_failure_budget(failed, len(results), last_error)
        return results

    def pop_counts(self) -> dict[str, float]:
        """Since the last pop: samples scored, samples that could not be, retries made and wall seconds spent in
        calls (the counters are then reset); `remote_metrics` turns them, summed over ranks, into metrics."""
        counts = {"samples": float(self._samples), "failed": float(self._failed), "retries": float(self._retries),
                  "seconds": self._seconds}
        self._samples = self._failed = self._retries = 0
        self._seconds = 0.0
        return counts

    def pop_metrics(self) -> dict[str, float]:
        """This process's reward/ metrics since the last pop (`pop_counts`, then `remote_metrics`)."""
        return remote_metrics(self.pop_counts())

    def close(self) -> None:
        """Close the HTTP client (unless it was injected)."""
        if self._owns_client:
            self._client.close()

    # ---- one batch ---------------------------------------------------------------------------------------
    def _score_batch(self, responses: list[str], golds: list[str], first: int) -> tuple[list[RewardResult], str]:
        """The batch's results and the reason of its last failure ('' when every item was scored); logs one
        warning for a batch with failures."""
        n = len(responses)
        try:
            body = self._post([{"response": r, "gold": g} for r, g in zip(responses, golds)])
            results = _parse_results(body, n)
        except _BatchFailed as e:
            results = [_failed_result(str(e)) for _ in range(n)]
        errors = [r.reasons["remote"] for r in results if r.failed]
        if errors:
            log.warning("reward.remote: %d of %d samples (items %d..%d) could not be scored at %s: %s",
                        len(errors), n, first, first + n - 1, self.cfg.url, errors[-1])
        return results, errors[-1] if errors else ""

    def _post(self, items: list[dict[str, Any]]) -> Any:
        """POST one batch with retries; the decoded JSON body of a 2xx response, or `_BatchFailed`."""
        reason = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self._retries += 1
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.post(self.cfg.url, json={"items": items}, headers=self._headers,
                                             timeout=self.cfg.timeout_s)
            except httpx.TimeoutException as e:
                reason = f"timeout after {self.cfg.timeout_s:g}s ({type(e).__name__})"
                continue
            except httpx.TransportError as e:
                reason = self._scrub(f"connection error ({type(e).__name__}: {e})")
                continue
            if response.is_success:
                return _decode_json(response)
            reason = self._scrub(f"HTTP {response.status_code}{_excerpt(response)}")
            if not _retryable(response.status_code):
                break
        raise _BatchFailed(reason)

    def _scrub(self, text: str) -> str:
        """`text` with the bearer token, should it be echoed anywhere, masked."""
        return text.replace(self._token, "***") if self._token else text

    def _check_failure_budget(self, failed: int, total: int, last_error: str) -> None:
        if not total or failed / total <= self.cfg.max_failure_frac:
            return
        raise RemoteRewardError(
            f"reward.remote: {failed} of {total} samples could not be scored ({failed / total:.0%} > "
            f"max_failure_frac {self.cfg.max_failure_frac:.0%}) at {self.cfg.url}: last error: {last_error}; "
            "check the judge server, or raise reward.remote.max_failure_frac")


def _retryable(status: int) -> bool:
    """HTTP 5xx and 429 (too many requests) are worth another attempt; other statuses are not."""
    return status >= 500 or status == 429


def _excerpt(response: httpx.Response) -> str:
    """': <the start of the body>' of a failed response, or '' for an empty body."""
    text = " ".join(response.text.split())
    if not text:
        return ""
    return f": {text[:BODY_EXCERPT_CHARS]}{'...' if len(text) > BODY_EXCERPT_CHARS else ''}"


def _decode_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError both are
        raise _BatchFailed("malformed response: not JSON") from None


def _parse_results(body: Any, n: int) -> list[RewardResult]:
    """One result per item from a decoded response body (module docstring: the protocol); `_BatchFailed` when
    the body as a whole is malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("scores"), list):
        raise _BatchFailed("malformed response: no 'scores' list")
    scores = body["scores"]
    correct = body.get("correct")
    if len(scores) != n:
        raise _BatchFailed(f"malformed response: {len(scores)} scores for {n} items")
    if correct is not None and not (isinstance(correct, list) and len(correct) == n):
        raise _BatchFailed(f"malformed response: 'correct' is not a list of {n} bools")
    return [_item_result(i, scores[i], None if correct is None else correct[i]) for i in range(n)]


def _item_result(i: int, score: Any, correct: Any) -> RewardResult:
    from miles_k3.evals.rewards import RewardResult  # here: rewards.py imports this module

    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return _failed_result(f"malformed response: scores[{i}] is not a finite number: {_short_repr(score)}")
    if correct is not None and not isinstance(correct, bool):
        return _failed_result(f"malformed response: correct[{i}] is not a bool: {_short_repr(correct)}")
    return RewardResult(float(score), score >= 1.0 if correct is None else correct, {"remote": "ok"})


def _failed_result(reason: str) -> RewardResult:
    from miles_k3.evals.rewards import RewardResult  # here: rewards.py imports this module

    return RewardResult(0.0, False, {"remote": reason}, failed=True)


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def remote_metrics(counts: dict[str, float]) -> dict[str, float]:
    """reward/ metrics from `RemoteReward.pop_counts` (one rank's, or summed over ranks with the seconds their
    maximum): the share of samples that could not be scored, the retries made, the wall seconds in calls."""
    return {"reward/remote_error_rate": counts["failed"] / counts["samples"] if counts["samples"] else 0.0,
            "reward/remote_retries": counts["retries"], "reward/remote_seconds": counts["seconds"]}
