"""reward.name=remote: the rollouts' rewards scored by a judge server over HTTP, in batches.

`RemoteReward(cfg)` is the reward function (`rewards.build_reward` builds it from `reward.remote.*`, a
`RemoteRewardConfig`). Each call POSTs the responses and their gold answers to `cfg.url`, at most
`cfg.batch_size` items per request, one request after another, with an `httpx.AsyncClient` on a private event
loop thread (so each attempt can be cancelled at its deadline wherever it is stuck).

Wire protocol (what a judge server implements):

    request:  POST <url>
              Content-Type: application/json
              Authorization: Bearer <token>     (only when reward.remote.api_key_env names a variable)
              {"items": [{"response": "<text>", "gold": "<text>"}, ...]}      # 1 .. batch_size items
    response: HTTP 200, Content-Type: application/json, at most max_response_bytes (decoded)
              {"scores": [<number>, ...],       # one per item, in the items' order: finite as a float32
               "correct": [<bool>, ...]}        # optional, same length; default: score >= 1.0

Bounds. Each attempt has one wall-clock deadline, `timeout_s`, over all of it: connecting, sending, and reading
the status line, the headers and the whole body (a judge that trickles bytes is cut off at the deadline, like one
that never answers). The body is read as a stream and abandoned past `max_response_bytes`.

Failures. An attempt that runs past its deadline, fails with a connection or protocol error (any httpx transport
error), or gets HTTP 5xx or 429 is tried again, up to `retries` more times, after sleeping `backoff_s * 2**(k-1)`
before retry k. Any other status, a body that does not decode as its Content-Encoding says (httpx.DecodingError),
a body over max_response_bytes, one that is not JSON, or one without a usable "scores" list (wrong length, a
"correct" list of the wrong length) is not retried. A batch that still fails fails all its items. A single score
that is not a number, is not finite as a float32 (|score| > 3.4e38 would become inf in the training tensors), or
lies outside [score_min, score_max] when those are set, or a "correct" entry that is not a bool, fails only its
item; the reason names the item (its index in the call) and the warning the judge's URL. A failed item's result
is `RewardResult(0.0, False, {"remote": "<reason>"}, failed=True)`: no reward could be computed, so the sample is
left out of the loss and out of rollout/reward_mean, and counted (rollout/reward_failed, reward/remote_error_rate).
One warning is logged per failed batch. If more than `max_failure_frac` of one call's samples failed, the call
raises `RemoteRewardError` (the judge is down or broken; training on the rest would be training on a biased
remnant). The bearer token (and a password in the URL) never appears in a log record or an error message.

Circuit breaker. `breaker_failures` attempts in a row that found the judge unavailable (a deadline, a connection
or protocol error, HTTP 5xx or 429; any other outcome resets the count) open it: for `breaker_cooldown_s` seconds
every batch fails at once without a request (reward/remote_fast_failed). The first batch after the cool-down is a
probe, sent once without retries: if the judge answers, the breaker closes; if not, it opens for another cool-down.
A judge that black-holes every request therefore costs a call at most breaker_failures deadlines plus the backoff
sleeps between them, and afterwards one deadline per cool-down, where it used to cost (retries + 1) deadlines per
batch. At the defaults: 3 x 30 s + 0.5 s + 1 s = 91.5 s for the first step, then at most one 30 s probe a minute
(at most one deadline per step), against 4 x 30 s + 0.5 + 1 + 2 s = 123.5 s for every 64-sample batch of every
step without it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from miles_k3.evals.rewards import RewardResult

log = logging.getLogger(__name__)

BODY_EXCERPT_CHARS = 200
"""How much of a failed response's body its error reason quotes."""
ERROR_BODY_BYTES = 4096
"""How much of a non-2xx response's body is read (for the excerpt); the rest is not."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: a score past it becomes inf once it is a training tensor."""


@dataclass
class RemoteRewardConfig:
    """reward.name=remote: the judge server's URL, batching, deadlines, retries, the circuit breaker, response and
    score bounds, and the failure budget."""

    url: str = ""
    """The judge's POST endpoint, http:// or https:// (e.g. http://127.0.0.1:8001/score); required with
    reward.name=remote."""
    batch_size: int = 64
    """Items (response + gold) per request."""
    timeout_s: float = 30.0
    """The wall-clock deadline of one attempt, in seconds, over all of it: connecting, sending the request and
    reading the whole response (a judge that trickles its answer is cut off here too). Retries get their own."""
    retries: int = 3
    """Extra attempts after a failed one (a deadline, a connection or protocol error, HTTP 5xx or 429; not other
    4xx, nor a malformed, undecodable or oversized response)."""
    backoff_s: float = 0.5
    """Sleep before retry k (k = 1, 2, ...): backoff_s * 2**(k-1) seconds."""
    max_failure_frac: float = 0.1
    """Per call: if more than this share of the call's samples could not be scored, the call raises
    RemoteRewardError (0: any failure raises; 1: never)."""
    api_key_env: str = ""
    """The name of an environment variable holding a bearer token, sent as 'Authorization: Bearer <token>'
    (never logged); empty: no Authorization header (a user:password in the url is sent as Basic auth, and its
    password is never logged either)."""
    max_response_bytes: int = 16 * 1024 * 1024
    """The largest response body read (after any Content-Encoding is decoded), in bytes; a larger one (by its
    Content-Length, or once that much has been read) fails its batch. 16 MiB is ~200 KiB per item of a 64-item
    batch, for a judge that answers {"scores": [...]}."""
    breaker_failures: int = 3
    """Attempts in a row that found the judge unavailable (deadline, connection error, HTTP 5xx or 429) after
    which it is taken as down: for breaker_cooldown_s every batch fails at once without a request; 0: no circuit
    breaker."""
    breaker_cooldown_s: float = 60.0
    """How long the open breaker fails batches at once, in seconds; then one probe attempt (no retries) closes it
    if the judge answers, or opens it again."""
    score_min: float | None = None
    """The lowest valid score; a lower one fails its item (a judge on another scale is a bug, not a reward).
    None: only float32's finite range bounds it (|score| <= 3.4e38; past it a score fails its item too)."""
    score_max: float | None = None
    """The highest valid score; a higher one fails its item. None: only float32's finite range bounds it."""

    def validate(self) -> None:
        """Raise ValueError naming the field (`url: ...`) for an invalid value. An empty url passes here (the
        section is unused unless reward.name=remote; `RewardConfig.validate` requires it then)."""
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: must start with http:// or https://, got '{_redact_url(self.url)}'")
        try:
            userinfo = httpx.URL(self.url).userinfo
        except httpx.InvalidURL as e:
            raise ValueError(f"url: not a valid URL ({e}): '{_redact_url(self.url)}'") from None
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
        if self.api_key_env and userinfo:
            raise ValueError("api_key_env: the url carries credentials (user:password@) too, and both would be the "
                             "Authorization header; use one of them")
        if self.api_key_env and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is not set (or is "
                             "empty); it should hold the judge's bearer token")
        self._validate_bounds()

    def _validate_bounds(self) -> None:
        if self.max_response_bytes < 1:
            raise ValueError(f"max_response_bytes: must be >= 1, got {self.max_response_bytes}")
        if self.breaker_failures < 0:
            raise ValueError(f"breaker_failures: must be >= 0 (0: no circuit breaker), got {self.breaker_failures}")
        if not (math.isfinite(self.breaker_cooldown_s) and self.breaker_cooldown_s > 0):
            raise ValueError(f"breaker_cooldown_s: must be a finite number of seconds > 0, got "
                             f"{self.breaker_cooldown_s}")
        for name in ("score_min", "score_max"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and abs(v) <= FLOAT32_MAX):
                raise ValueError(f"{name}: must be a number within float32's finite range or null, got {v!r}")
        if self.score_min is not None and self.score_max is not None and self.score_min > self.score_max:
            raise ValueError(f"score_min: {self.score_min} is above score_max {self.score_max}")


class RemoteRewardError(RuntimeError):
    """Too many of one call's samples could not be scored by the judge (more than max_failure_frac)."""


class _Failed(Exception):
    """An attempt or a batch could not be scored: the short reason, whether it is worth retrying (the judge was
    unavailable: this is also what the circuit breaker counts), and whether the open breaker refused it."""

    def __init__(self, reason: str, retry: bool = False, fast: bool = False):
        super().__init__(reason)
        self.reason, self.retry, self.fast = reason, retry, fast


class _Breaker:
    """The circuit breaker (module docstring): counts attempts in a row that found the judge unavailable."""

    def __init__(self, failures: int, cooldown_s: float):
        self.failures, self.cooldown_s = failures, cooldown_s
        self.streak = 0
        self.open_until: float | None = None
        self.last = ""
        self.opens = 0

    def admit(self) -> bool:
        """Whether the next batch is the half-open probe (one attempt, no retries); `_Failed(fast=True)` while
        the breaker is open."""
        if self.open_until is None:
            return False
        left = self.open_until - time.monotonic()
        if left > 0:
            raise _Failed(f"circuit open: {self.streak} attempts in a row found the judge unavailable (last: "
                          f"{self.last}); no request for {left:.1f}s more", fast=True)
        return True

    def record(self, failure: _Failed | None) -> bool:
        """Count one attempt (`failure` None: it was answered and usable); True when the breaker is now open."""
        if failure is None or not failure.retry:  # the judge answered: it is up
            self.streak, self.open_until = 0, None
            return False
        self.streak += 1
        self.last = failure.reason
        if self.open_until is not None or (self.failures and self.streak >= self.failures):
            self.open_until = time.monotonic() + self.cooldown_s  # tripped, or a failed probe
            self.opens += 1
            return True
        return False


class _LoopThread:
    """A private asyncio event loop on a daemon thread: the requests run there, whatever thread calls the reward
    and whether or not that thread runs an event loop of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="remote-reward", daemon=True)
        self._thread.start()

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


class RemoteReward:
    """The remote reward function: `(responses, golds) -> list[RewardResult]`, scored by the judge at `cfg.url`
    (module docstring: the wire protocol and the bounds). `client` may be injected (tests); then `close()` leaves
    it open."""

    def __init__(self, cfg: RemoteRewardConfig, client: httpx.AsyncClient | None = None):
        cfg.validate()
        if not cfg.url:
            raise ValueError("url: the remote reward needs the judge's URL, e.g. http://127.0.0.1:8001/score")
        self.cfg = cfg
        self._token = os.environ[cfg.api_key_env] if cfg.api_key_env else ""
        self._headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        url = httpx.URL(cfg.url)  # a user:password in it goes as Basic auth, so that httpx's log of the URL has none
        self._url = url.copy_with(userinfo=b"") if url.userinfo else url
        self._auth = httpx.BasicAuth(url.username, url.password) if url.userinfo else None
        self._secrets = [s for s in (self._token, url.password) if s]
        self._shown_url = _redact_url(cfg.url)
        self._client = client if client is not None else httpx.AsyncClient(timeout=cfg.timeout_s)
        self._owns_client = client is None
        self._runner = _LoopThread()
        self._finalizer = weakref.finalize(self, self._runner.close)  # a reward never closed stops its thread
        self._breaker = _Breaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
        self._counts = _zero_counts()

    def __call__(self, responses: list[str], golds: list[str]) -> list[RewardResult]:
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        start = time.monotonic()
        opens = self._breaker.opens
        try:
            results, last_error = self._runner.run(self._score_all(responses, golds))
        finally:
            self._counts["seconds"] += time.monotonic() - start
            self._counts["breaker_opens"] += self._breaker.opens - opens
        failed = sum(r.failed for r in results)
        self._counts["samples"] += len(results)
        self._counts["failed"] += failed
        self._check_failure_budget(failed, len(results), last_error)
        return results

    def pop_counts(self) -> dict[str, float]:
        """Since the last pop: samples scored, samples that could not be, of them those the open circuit breaker
        failed at once, retries made, times the breaker opened, and wall seconds spent in calls (the counters are
        then reset); `remote_metrics` turns them, summed over ranks, into metrics."""
        counts, self._counts = self._counts, _zero_counts()
        return counts

    def pop_metrics(self) -> dict[str, float]:
        """This process's reward/ metrics since the last pop (`pop_counts`, then `remote_metrics`)."""
        return remote_metrics(self.pop_counts())

    def close(self) -> None:
        """Close the HTTP client (unless it was injected) and stop the event loop thread."""
        if self._runner.loop.is_closed():
            return
        if self._owns_client:
            self._runner.run(self._client.aclose())
        self._finalizer()

    # ---- one call, one batch -----------------------------------------------------------------------------
    async def _score_all(self, responses: list[str], golds: list[str]) -> tuple[list[RewardResult], str]:
        results: list[RewardResult] = []
        last_error = ""
        for lo in range(0, len(responses), self.cfg.batch_size):
            batch, error = await self._score_batch(responses[lo:lo + self.cfg.batch_size],
                                                   golds[lo:lo + self.cfg.batch_size], lo)
            results.extend(batch)
            last_error = error or last_error
        return results, last_error

    async def _score_batch(self, responses: list[str], golds: list[str], first: int
                           ) -> tuple[list[RewardResult], str]:
        """The batch's results and the reason of its last failure ('' when every item was scored); logs one
        warning for a batch with failures."""
        n = len(responses)
        try:
            results = await self._post([{"response": r, "gold": g} for r, g in zip(responses, golds)], first)
        except _Failed as e:
            results = [_failed_result(e.reason) for _ in range(n)]
            self._counts["fast_failed"] += n if e.fast else 0
        errors = [r.reasons["remote"] for r in results if r.failed]
        if errors:
            log.warning("reward.remote: %d of %d samples (items %d..%d) could not be scored at %s: %s",
                        len(errors), n, first, first + n - 1, self._shown_url, errors[-1])
        return results, errors[-1] if errors else ""

    async def _post(self, items: list[dict[str, Any]], first: int) -> list[RewardResult]:
        """POST one batch under the retry policy and the circuit breaker: one result per item, or `_Failed`."""
        attempts = 1 if self._breaker.admit() else self.cfg.retries + 1
        failure = _Failed("no attempt")
        for attempt in range(attempts):
            if attempt:
                self._counts["retries"] += 1
                await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                results = _parse_results(await self._attempt(items), len(items), first, self.cfg)
            except _Failed as e:
                failure = e
                if self._breaker.record(e) or not e.retry:
                    break
                continue
            self._breaker.record(None)
            return results
        raise failure

    async def _attempt(self, items: list[dict[str, Any]]) -> Any:
        """One POST under the deadline `timeout_s` (connect, send, and the whole response): the decoded JSON
        body of a 2xx response, or `_Failed`."""
        try:
            return await asyncio.wait_for(self._exchange(items), self.cfg.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException) as e:  # the deadline, or one of httpx's own
            kind = type(e).__name__ if isinstance(e, httpx.TimeoutException) else "deadline"
            raise _Failed(f"timeout after {self.cfg.timeout_s:g}s ({kind})", retry=True) from None

    async def _exchange(self, items: list[dict[str, Any]]) -> Any:
        try:
            async with self._client.stream("POST", self._url, json={"items": items}, headers=self._headers,
                                           auth=self._auth) as response:
                if not response.is_success:
                    head = await _read_head(response, ERROR_BODY_BYTES)
                    raise _Failed(self._scrub(f"HTTP {response.status_code}{_excerpt(head)}"),
                                  retry=_retryable(response.status_code))
                body, over = await _read_capped(response, self.cfg.max_response_bytes)
        except httpx.TimeoutException:
            raise
        except httpx.TransportError as e:  # connect, read, write, protocol errors
            raise _Failed(self._scrub(f"connection error ({type(e).__name__}: {e})"), retry=True) from None
        except httpx.DecodingError as e:  # a body that is not in its declared Content-Encoding
            raise _Failed(self._scrub(f"malformed response: the body does not decode as its Content-Encoding "
                                      f"says ({type(e).__name__}: {e})")) from None
        except (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL) as e:  # every other httpx error
            raise _Failed(self._scrub(f"request error ({type(e).__name__}: {e})")) from None
        if over:
            raise _Failed(f"response too large ({over}): over max_response_bytes={self.cfg.max_response_bytes}")
        return _decode_json(body)

    def _scrub(self, text: str) -> str:
        """`text` with the bearer token and a URL password, should either be echoed anywhere, masked."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _check_failure_budget(self, failed: int, total: int, last_error: str) -> None:
        if not total or failed / total <= self.cfg.max_failure_frac:
            return
        raise RemoteRewardError(
            f"reward.remote: {failed} of {total} samples could not be scored ({failed / total:.0%} > "
            f"max_failure_frac {self.cfg.max_failure_frac:.0%}) at {self._shown_url}: last error: {last_error}; "
            "check the judge server, or raise reward.remote.max_failure_frac")


def _zero_counts() -> dict[str, float]:
    return {"samples": 0.0, "failed": 0.0, "fast_failed": 0.0, "retries": 0.0, "breaker_opens": 0.0,
            "seconds": 0.0}


def _redact_url(url: str) -> str:
    """`url` with a password in it masked."""
    try:
        password = httpx.URL(url).password
    except httpx.InvalidURL:
        return url
    return url.replace(password, "***") if password else url


async def _read_capped(response: httpx.Response, limit: int) -> tuple[bytes, str]:
    """The decoded body, read as a stream up to `limit` bytes: (the bytes, '') or, for a larger one, (its first
    `limit` bytes at most, how large it is: 'Content-Length N' or 'more than N bytes'); the rest is never read."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # a compressed body decodes to at least about as much
        return b"", f"Content-Length {declared}"
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            return bytes(data[:limit]), f"more than {limit} bytes"
    return bytes(data), ""


async def _read_head(response: httpx.Response, limit: int) -> bytes:
    """The first `limit` bytes of the decoded body (a failed response's, for its excerpt); the rest is not read."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= limit:
            break
    return bytes(data[:limit])


def _retryable(status: int) -> bool:
    """HTTP 5xx and 429 (too many requests) are worth another attempt; other statuses are not."""
    return status >= 500 or status == 429


def _excerpt(body: bytes) -> str:
    """': <the start of the body>' of a failed response, or '' for an empty body."""
    text = " ".join(body.decode("utf-8", errors="replace").split())
    if not text:
        return ""
    return f": {text[:BODY_EXCERPT_CHARS]}{'...' if len(text) > BODY_EXCERPT_CHARS else ''}"


def _decode_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors; deep nesting
        raise _Failed("malformed response: not JSON") from None


def _parse_results(body: Any, n: int, first: int, cfg: RemoteRewardConfig) -> list[RewardResult]:
    """One result per item from a decoded response body (module docstring: the protocol); `_Failed` when the body
    as a whole is malformed. `first`: the batch's first item's index in the call (for the reasons)."""
    if not isinstance(body, dict) or not isinstance(body.get("scores"), list):
        raise _Failed("malformed response: no 'scores' list")
    scores = body["scores"]
    correct = body.get("correct")
    if len(scores) != n:
        raise _Failed(f"malformed response: {len(scores)} scores for {n} items")
    if correct is not None and not (isinstance(correct, list) and len(correct) == n):
        raise _Failed(f"malformed response: 'correct' is not a list of {n} bools")
    return [_item_result(first + i, scores[i], None if correct is None else correct[i], cfg) for i in range(n)]


def _item_result(item: int, score: Any, correct: Any, cfg: RemoteRewardConfig) -> RewardResult:
    """Item `item`'s result: its score checked (a number, finite as a float32, within the configured range)."""
    from miles_k3.evals.rewards import RewardResult  # here: rewards.py imports this module

    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return _failed_result(f"malformed response: item {item}: score is not a number: {_short_repr(score)}")
    try:
        value = float(score)
    except OverflowError:  # an integer past float64
        value = math.inf
    if not abs(value) <= FLOAT32_MAX:  # NaN, inf, or inf once it is a float32 training tensor
        return _failed_result(f"malformed response: item {item}: score is not a finite float32 (|score| <= "
                              f"{FLOAT32_MAX:.4g}): {_short_repr(score)}")
    lo, hi = cfg.score_min, cfg.score_max
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        return _failed_result(f"item {item}: score {value:g} is outside reward.remote.score_min..score_max "
                              f"[{'-' if lo is None else f'{lo:g}'}, {'-' if hi is None else f'{hi:g}'}]")
    if correct is not None and not isinstance(correct, bool):
        return _failed_result(f"malformed response: item {item}: correct is not a bool: {_short_repr(correct)}")
    return RewardResult(value, value >= 1.0 if correct is None else correct, {"remote": "ok"})


def _failed_result(reason: str) -> RewardResult:
    from miles_k3.evals.rewards import RewardResult  # here: rewards.py imports this module

    return RewardResult(0.0, False, {"remote": reason}, failed=True)


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def remote_metrics(counts: dict[str, float]) -> dict[str, float]:
    """reward/ metrics from `RemoteReward.pop_counts` (one rank's, or summed over ranks with the seconds their
    maximum): the share of samples that could not be scored, those the open circuit breaker failed at once, the
    retries made, the times the breaker opened, the wall seconds in calls."""
    return {"reward/remote_error_rate": counts["failed"] / counts["samples"] if counts["samples"] else 0.0,
            "reward/remote_fast_failed": counts["fast_failed"], "reward/remote_retries": counts["retries"],
            "reward/remote_breaker_opens": counts["breaker_opens"], "reward/remote_seconds": counts["seconds"]}
