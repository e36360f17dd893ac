"""The remote reward (reward.name=remote) against a local stub judge server: scores in order over batches,
`correct` by default and as sent, retries on 5xx / 429 / timeouts and none on other 4xx, malformed responses
failing their batch or only their item, the failure budget, the bearer token (sent, never logged or shown),
the metrics, and the config's refusals (directly and through compose_config). Then the bounds, each against a
judge on 127.0.0.1 that misbehaves: one that trickles its answer (cut at the per-attempt deadline), one that
accepts connections and never answers (the circuit breaker opens and later items fail at once; the cost at the
defaults, hand-worked), one that lies about its Content-Encoding, scores past float32 or outside the configured
range, oversized bodies, and rollout/reward_mean over the scored samples only."""
from __future__ import annotations

import ast
import base64
import inspect
import itertools
import json
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from miles_k3.evals.remote_reward import RemoteReward, RemoteRewardConfig, RemoteRewardError
from miles_k3.evals.rewards import RewardConfig, RewardResult, build_reward, grade_outcome

TOKEN = "sk-test-TOKEN-5f3a9c"


# ---- the stub judge -------------------------------------------------------------------------------------------
@dataclass
class Judge:
    """What the stub does per request: the next scripted action, or ("ok",) once the script is empty.

    Actions: ("ok",) scores each item len(response); ("status", code) answers with that status; ("sleep", s)
    sleeps s seconds, then answers ("ok",); ("body", bytes) answers 200 with that raw body; ("json", obj) answers
    200 with obj as JSON; ("echo_auth", code) answers that status with the Authorization header in its body;
    ("trickle", s) writes an ("ok",) answer (status line, headers, body) one byte every s seconds; ("raw",
    headers, bytes) answers 200 with those extra headers and that body; ("flood", n) answers 200 without a
    Content-Length and writes n bytes, 64 KiB at a time, until the client hangs up (the bytes written go to
    `sent`, then `flooded` is set). Every request's items and Authorization header are recorded."""

    url: str = ""
    script: queue.Queue = field(default_factory=queue.Queue)
    requests: list = field(default_factory=list)
    sent: int = 0
    flooded: threading.Event = field(default_factory=threading.Event)

    def reset(self, *actions: tuple) -> None:
        self.script = queue.Queue()
        for action in actions:
            self.script.put(action)
        self.requests.clear()
        self.sent = 0
        self.flooded.clear()


def _handler(judge: Judge) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
            judge.requests.append({"items": items, "authorization": self.headers.get("Authorization")})
            try:
                action = judge.script.get_nowait()
            except queue.Empty:
                action = ("ok",)
            try:
                self._answer(action, items)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                pass
            finally:
                judge.flooded.set()

        def _answer(self, action: tuple, items: list[dict]) -> None:
            kind = action[0]
            if kind == "sleep":
                time.sleep(action[1])
                kind = "ok"
            if kind == "trickle":
                body = json.dumps({"scores": [len(it["response"]) for it in items]}).encode()
                raw = (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(body), body))
                for i in range(len(raw)):
                    self.wfile.write(raw[i:i + 1])
                    time.sleep(action[1])
                self.close_connection = True
            elif kind == "raw":
                self.send_response(200)
                for name, value in action[1].items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(action[2])))
                self.end_headers()
                self.wfile.write(action[2])
            elif kind == "flood":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                chunk = b" " * 65536
                while judge.sent < action[1]:
                    self.wfile.write(chunk)
                    judge.sent += len(chunk)
            elif kind == "status":
                self._send(action[1], b"judge says no")
            elif kind == "echo_auth":
                self._send(action[1], f"bad credentials: {self.headers.get('Authorization')}".encode())
            elif kind == "body":
                self._send(200, action[1])
            elif kind == "json":
                self._send(200, json.dumps(action[1]).encode())
            else:
                self._send(200, json.dumps({"scores": [len(it["response"]) for it in items]}).encode())

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet
            pass

    return Handler


@pytest.fixture(scope="module")
def server():
    judge = Judge()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(judge))
    judge.url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield judge
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def judge(server):
    server.reset()
    return server


def remote(judge: Judge, **kw) -> RemoteReward:
    kw = {"url": judge.url, "backoff_s": 0.01, "timeout_s": 5.0, **kw}
    return RemoteReward(RemoteRewardConfig(**kw))


# ---- scoring ----------------------------------------------------------------------------------------------
def test_scores_in_order_over_several_batches(judge):
    reward = remote(judge, batch_size=2)
    try:
        results = reward(["", "a", "bb", "ccc", "d"], ["g0", "g1", "g2", "g3", "g4"])
    finally:
        reward.close()
    assert [r.score for r in results] == [0.0, 1.0, 2.0, 3.0, 1.0]
    assert [r.correct for r in results] == [False, True, True, True, True]  # score >= 1.0
    assert all(r.reasons == {"remote": "ok"} and not r.failed for r in results)
    assert [[it["response"] for it in q["items"]] for q in judge.requests] == [["", "a"], ["bb", "ccc"], ["d"]]
    assert judge.requests[2]["items"] == [{"response": "d", "gold": "g4"}]
    assert judge.requests[0]["authorization"] is None  # no api_key_env, no header


def test_correct_as_the_judge_sends_it(judge):
    judge.reset(("json", {"scores": [0.5, 2], "correct": [True, False]}))
    with_correct = remote(judge)
    assert [(r.score, r.correct) for r in with_correct(["x", "y"], ["x", "x"])] == [(0.5, True), (2.0, False)]


def test_build_reward_by_name(judge):
    reward = build_reward(RewardConfig(name="remote", remote=RemoteRewardConfig(url=judge.url)))
    try:
        assert [r.score for r in reward(["abc"], ["3"])] == [3.0]
    finally:
        reward.close()


def test_an_empty_call_sends_nothing(judge):
    assert remote(judge)([], []) == []
    assert judge.requests == []


# ---- retries --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [503, 429])
def test_a_transient_status_is_retried(judge, status):
    judge.reset(("status", status))
    reward = remote(judge)
    results = reward(["ab", "c"], ["", ""])
    assert [(r.score, r.failed) for r in results] == [(2.0, False), (1.0, False)]
    assert len(judge.requests) == 2
    metrics = reward.pop_metrics()
    assert metrics["reward/remote_retries"] == 1
    assert metrics["reward/remote_error_rate"] == 0.0
    assert metrics["reward/remote_seconds"] > 0
    assert reward.pop_metrics() == {"reward/remote_error_rate": 0.0, "reward/remote_fast_failed": 0.0,
                                    "reward/remote_retries": 0.0, "reward/remote_breaker_opens": 0.0,
                                    "reward/remote_seconds": 0.0}  # reset by the pop


def test_retries_run_out(judge, caplog):
    judge.reset(*[("status", 503)] * 3)
    reward = remote(judge, retries=2, max_failure_frac=1.0)
    with caplog.at_level(logging.WARNING, logger="miles_k3.evals.remote_reward"):
        results = reward(["a", "b"], ["", ""])
    assert len(judge.requests) == 3  # 1 + 2 retries
    assert all(r.failed and r.score == 0.0 and not r.correct for r in results)
    assert results[0].reasons == {"remote": "HTTP 503: judge says no"}
    assert grade_outcome(results[0]) == "error"
    assert reward.pop_metrics()["reward/remote_error_rate"] == 1.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "HTTP 503" in warnings[0].getMessage()  # once per batch


def test_a_client_error_is_not_retried(judge):
    judge.reset(("status", 400))
    reward = remote(judge, max_failure_frac=1.0)
    results = reward(["a"], [""])
    assert len(judge.requests) == 1
    assert results[0].failed and results[0].reasons["remote"].startswith("HTTP 400")
    assert reward.pop_metrics()["reward/remote_retries"] == 0


def test_a_timeout_is_retried_then_fails(judge):
    judge.reset(("sleep", 1.0), ("sleep", 1.0))
    reward = remote(judge, timeout_s=0.2, retries=1, max_failure_frac=1.0)
    start = time.monotonic()
    results = reward(["a"], [""])
    assert time.monotonic() - start < 0.9  # gave up on each attempt, did not wait for the judge
    assert len(judge.requests) == 2
    assert results[0].failed and results[0].reasons["remote"].startswith("timeout after 0.2s")
    assert reward.pop_metrics()["reward/remote_retries"] == 1


def test_an_unreachable_judge_fails_its_samples():
    reward = RemoteReward(RemoteRewardConfig(url="http://127.0.0.1:9/score", retries=1, backoff_s=0.01,
                                             max_failure_frac=1.0))
    results = reward(["a"], [""])
    assert results[0].failed and results[0].reasons["remote"].startswith("connection error")


# ---- malformed responses ----------------------------------------------------------------------------------
@pytest.mark.parametrize("action, reason", [
    (("body", b"not json"), "malformed response: not JSON"),
    (("json", {"score": [1, 1]}), "malformed response: no 'scores' list"),
    (("json", [1, 1]), "malformed response: no 'scores' list"),
    (("json", {"scores": [1]}), "malformed response: 1 scores for 2 items"),
    (("json", {"scores": [1, 1], "correct": [True]}), "malformed response: 'correct' is not a list of 2 bools"),
])
def test_a_malformed_response_fails_its_whole_batch(judge, action, reason):
    judge.reset(action)
    reward = remote(judge, batch_size=2, max_failure_frac=1.0)
    results = reward(["a", "bb", "ccc"], ["", "", ""])
    assert [r.failed for r in results] == [True, True, False]  # the second batch is scored
    assert results[0].reasons["remote"] == results[1].reasons["remote"] == reason
    assert results[2].score == 3.0
    assert len(judge.requests) == 2  # not retried


NOT_FLOAT32 = "is not a finite float32 (|score| <= 3.403e+38)"


@pytest.mark.parametrize("body, reason", [
    (b'{"scores": [1.0, NaN, 2.0]}', f"{NOT_FLOAT32}: nan"),
    (b'{"scores": [1.0, Infinity, 2.0]}', f"{NOT_FLOAT32}: inf"),
    (b'{"scores": [1.0, 1e39, 2.0]}', f"{NOT_FLOAT32}: 1e+39"),  # finite in float64, inf as a float32 tensor
    (b'{"scores": [1.0, -1e39, 2.0]}', f"{NOT_FLOAT32}: -1e+39"),
    (b'{"scores": [1.0, 1' + b"0" * 400 + b', 2.0]}', f"{NOT_FLOAT32}: 1000000000000000000000000000000000000000..."),
    (b'{"scores": [1.0, "0.5", 2.0]}', "is not a number: '0.5'"),
    (b'{"scores": [1.0, true, 2.0]}', "is not a number: True"),
    (b'{"scores": [1.0, null, 2.0]}', "is not a number: None"),
])
def test_a_bad_score_fails_only_its_item(judge, body, reason, caplog):
    judge.reset(("body", body))
    reward = remote(judge, max_failure_frac=0.5)
    with caplog.at_level(logging.WARNING, logger="miles_k3.evals.remote_reward"):
        results = reward(["a", "b", "c"], ["", "", ""])
    assert [(r.score, r.failed) for r in results] == [(1.0, False), (0.0, True), (2.0, False)]
    assert results[1].reasons["remote"] == f"malformed response: item 1: score {reason}"
    assert torch.isfinite(torch.tensor([r.score for r in results], dtype=torch.float32)).all()
    assert reward.pop_metrics()["reward/remote_error_rate"] == pytest.approx(1 / 3)
    (warning,) = caplog.records  # names the judge and the item
    assert warning.getMessage() == (f"reward.remote: 1 of 3 samples (items 0..2) could not be scored at "
                                    f"{judge.url}: malformed response: item 1: score {reason}")


def test_a_score_outside_the_configured_range_fails_its_item(judge):
    judge.reset(("json", {"scores": [0.5, 1.5, -0.25, 1, 0]}))
    results = remote(judge, score_min=0.0, score_max=1.0, max_failure_frac=1.0)(["a"] * 5, [""] * 5)
    assert [(r.score, r.failed) for r in results] == [(0.5, False), (0.0, True), (0.0, True), (1.0, False),
                                                      (0.0, False)]
    assert results[1].reasons["remote"] == "item 1: score 1.5 is outside reward.remote.score_min..score_max [0, 1]"
    assert results[2].reasons["remote"] == "item 2: score -0.25 is outside reward.remote.score_min..score_max [0, 1]"


def test_a_bad_correct_entry_fails_only_its_item(judge):
    judge.reset(("json", {"scores": [1, 0], "correct": [True, "yes"]}))
    results = remote(judge, max_failure_frac=1.0)(["a", "b"], ["", ""])
    assert [(r.correct, r.failed) for r in results] == [(True, False), (False, True)]
    assert results[1].reasons["remote"] == "malformed response: item 1: correct is not a bool: 'yes'"


# ---- the failure budget and the token ---------------------------------------------------------------------
def test_the_failure_budget(judge):
    judge.reset(("json", {"scores": [1, 2, "x", 3]}))
    with pytest.raises(RemoteRewardError) as e:
        remote(judge, max_failure_frac=0.1)(["a", "b", "c", "d"], [""] * 4)
    message = str(e.value)
    assert message.startswith("reward.remote: 1 of 4 samples could not be scored (25% > max_failure_frac 10%) "
                              f"at {judge.url}: last error: malformed response: item 2: score is not a number")
    assert message.endswith("check the judge server, or raise reward.remote.max_failure_frac")

    judge.reset(("json", {"scores": [1, 2, "x", 3]}))
    reward = remote(judge, max_failure_frac=0.5)
    assert [r.failed for r in reward(["a", "b", "c", "d"], [""] * 4)] == [False, False, True, False]
    assert reward.pop_metrics()["reward/remote_error_rate"] == 0.25


def test_the_failure_budget_counts_the_whole_call(judge):
    judge.reset(("status", 500), ("status", 500))  # the first batch (2 of 4) fails for good
    reward = remote(judge, batch_size=2, retries=1, max_failure_frac=0.5)
    assert [r.failed for r in reward(["a", "b", "c", "d"], [""] * 4)] == [True, True, False, False]  # 50%: ok
    judge.reset(("status", 500), ("status", 500))
    with pytest.raises(RemoteRewardError, match=r"^reward\.remote: 2 of 3 samples could not be scored \(67% "):
        reward(["a", "b", "c"], [""] * 3)
    metrics = reward.pop_metrics()  # both calls, the one that raised too
    assert metrics["reward/remote_error_rate"] == pytest.approx(4 / 7)
    assert metrics["reward/remote_retries"] == 2


def test_the_bearer_token_is_sent_and_never_shown(judge, monkeypatch, caplog):
    monkeypatch.setenv("MILES_K3_TEST_JUDGE_TOKEN", TOKEN)
    judge.reset(("ok",), ("status", 401))
    reward = remote(judge, api_key_env="MILES_K3_TEST_JUDGE_TOKEN", batch_size=2, max_failure_frac=0.1)
    with caplog.at_level(logging.DEBUG), pytest.raises(RemoteRewardError) as e:
        reward(["a", "b", "c", "d"], [""] * 4)
    assert [q["authorization"] for q in judge.requests] == [f"Bearer {TOKEN}"] * 2
    assert "2 of 4 samples" in str(e.value) and judge.url in str(e.value) and "HTTP 401" in str(e.value)
    assert caplog.records and all(TOKEN not in r.getMessage() for r in caplog.records)
    assert TOKEN not in str(e.value) and TOKEN not in repr(e.value)


def test_a_token_echoed_by_the_judge_is_masked(judge, monkeypatch, caplog):
    monkeypatch.setenv("MILES_K3_TEST_JUDGE_TOKEN", TOKEN)
    judge.reset(("echo_auth", 403))
    reward = remote(judge, api_key_env="MILES_K3_TEST_JUDGE_TOKEN", max_failure_frac=1.0)
    with caplog.at_level(logging.WARNING):
        results = reward(["a"], [""])
    assert results[0].reasons["remote"] == "HTTP 403: bad credentials: Bearer ***"
    assert all(TOKEN not in r.getMessage() for r in caplog.records)


# ---- bounds: judges that misbehave --------------------------------------------------------------------------
@pytest.fixture
def black_hole():
    """A judge that accepts connections (the kernel's backlog does) and never reads or answers them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    sock.close()


def black_hole_cost_s(cfg: RemoteRewardConfig) -> float:
    """Hand-worked: a call against a judge that never answers, from a closed breaker, with breaker_failures <=
    retries + 1: the first batch's first breaker_failures attempts each wait out the deadline, with backoff sleeps
    1 .. breaker_failures - 1 between them; then the breaker is open and every other batch fails at once."""
    k = cfg.breaker_failures
    return k * cfg.timeout_s + sum(cfg.backoff_s * 2 ** (j - 1) for j in range(1, k))


def test_what_a_black_holed_judge_costs_at_the_defaults():
    """At the defaults: 3 attempts x 30 s + 0.5 s + 1 s of backoff = 91.5 s in the first step, then nothing for
    the 60 s cool-down, then one 30 s probe (no retries) per cool-down: at most one deadline per later step.
    Without the breaker every 64-sample batch of every step cost 4 x 30 s + 0.5 + 1 + 2 s = 123.5 s."""
    cfg = RemoteRewardConfig()
    assert (cfg.timeout_s, cfg.retries, cfg.backoff_s, cfg.breaker_failures, cfg.breaker_cooldown_s) == \
        (30.0, 3, 0.5, 3, 60.0)
    assert cfg.breaker_failures <= cfg.retries + 1  # black_hole_cost_s's premise
    assert black_hole_cost_s(cfg) == 3 * 30.0 + 0.5 + 1.0 == 91.5
    assert (cfg.retries + 1) * cfg.timeout_s + sum(cfg.backoff_s * 2 ** (k - 1) for k in (1, 2, 3)) == 123.5


def test_a_trickling_judge_is_cut_at_the_deadline(judge):
    """The judge writes its ~100-byte answer one byte every 50 ms (~5 s), so each read finishes well within
    httpx's per-read timeout; the 0.3 s deadline covers the whole attempt. Two attempts (retries=1) and one 10 ms
    backoff: 2 x 0.3 + 0.01 = 0.61 s, not ~10 s."""
    judge.reset(("trickle", 0.05), ("trickle", 0.05))
    reward = remote(judge, timeout_s=0.3, retries=1, backoff_s=0.01, max_failure_frac=1.0)
    start = time.monotonic()
    results = reward(["a", "bb"], ["", ""])
    elapsed = time.monotonic() - start
    assert 0.6 <= elapsed < 0.61 + 0.5  # the bound, plus slack for a loaded machine
    assert len(judge.requests) == 2
    assert all(r.failed and r.reasons["remote"] == "timeout after 0.3s (deadline)" for r in results)
    assert reward.pop_metrics()["reward/remote_retries"] == 1
    reward.close()


def test_a_black_holed_judge_opens_the_breaker_and_later_items_fail_fast(black_hole):
    """4 one-item batches against a judge that never answers, deadline 0.25 s, 3 retries, breaker after 2: the
    first batch's 2 attempts wait out their deadlines (2 x 0.25 + 0.01 = 0.51 s: `black_hole_cost_s`), then the
    breaker is open and batches 2-4 fail at once; a second call fails at once whole. Without the breaker: 4 x (4 x
    0.25 + 0.01 + 0.02 + 0.04) = 4.28 s per call."""
    cfg = RemoteRewardConfig(url=black_hole, timeout_s=0.25, retries=3, backoff_s=0.01, breaker_failures=2,
                             breaker_cooldown_s=60.0, batch_size=1, max_failure_frac=1.0)
    reward = RemoteReward(cfg)
    start = time.monotonic()
    results = reward(["a", "b", "c", "d"], [""] * 4)
    elapsed = time.monotonic() - start
    assert black_hole_cost_s(cfg) == pytest.approx(0.51)
    assert 0.5 <= elapsed < black_hole_cost_s(cfg) + 0.5
    assert all(r.failed for r in results)
    assert results[0].reasons["remote"].startswith("timeout after 0.25s")
    assert all(r.reasons["remote"].startswith("circuit open: 2 attempts in a row found the judge unavailable (last: "
                                              "timeout after 0.25s") for r in results[1:])
    start = time.monotonic()
    again = reward(["e", "f", "g", "h"], [""] * 4)
    assert time.monotonic() - start < 0.1 and all(r.failed for r in again)  # no network wait
    assert reward.pop_metrics() == {"reward/remote_error_rate": 1.0, "reward/remote_fast_failed": 7.0,
                                    "reward/remote_retries": 1.0, "reward/remote_breaker_opens": 1.0,
                                    "reward/remote_seconds": pytest.approx(elapsed, abs=0.1)}
    reward.close()


def test_the_breaker_probes_after_its_cool_down(judge):
    """Deadline 0.6 s, breaker after 2, cool-down 0.3 s: two timeouts open it; during the cool-down nothing is
    sent; after it one probe goes out (no retries), and fails: open again; after the next cool-down the probe is
    answered and the breaker closes (retries work again). (A 0.2 s deadline missed the answer once in a loaded CI.)"""
    judge.reset(("sleep", 2.0), ("sleep", 2.0), ("sleep", 2.0), ("ok",), ("status", 503))
    reward = remote(judge, timeout_s=0.6, retries=3, backoff_s=0.01, breaker_failures=2, breaker_cooldown_s=0.3,
                    max_failure_frac=1.0)
    assert reward(["a"], [""])[0].failed and len(judge.requests) == 2
    assert reward(["a"], [""])[0].reasons["remote"].startswith("circuit open") and len(judge.requests) == 2
    time.sleep(0.35)
    assert reward(["a"], [""])[0].reasons["remote"].startswith("timeout") and len(judge.requests) == 3  # the probe
    assert reward(["a"], [""])[0].reasons["remote"].startswith("circuit open") and len(judge.requests) == 3
    time.sleep(0.35)
    assert [r.score for r in reward(["abc"], [""])] == [3.0] and len(judge.requests) == 4  # answered: closed
    assert [r.score for r in reward(["ab"], [""])] == [2.0] and len(judge.requests) == 6  # a 503, then a retry
    metrics = reward.pop_metrics()
    assert (metrics["reward/remote_breaker_opens"], metrics["reward/remote_fast_failed"],
            metrics["reward/remote_retries"]) == (2.0, 2.0, 2.0)
    reward.close()


def test_a_body_that_lies_about_its_encoding_is_counted_not_raised(judge):
    judge.reset(("raw", {"Content-Type": "application/json", "Content-Encoding": "gzip"}, b'{"scores": [1, 2]}'))
    reward = remote(judge, max_failure_frac=1.0)
    results = reward(["a", "b"], ["", ""])  # httpx.DecodingError inside: a failure of the batch
    assert all(r.failed for r in results)
    assert results[0].reasons["remote"].startswith("malformed response: the body does not decode as its "
                                                   "Content-Encoding says (DecodingError: ")
    assert len(judge.requests) == 1  # a malformed answer is not retried
    assert reward.pop_metrics()["reward/remote_error_rate"] == 1.0
    assert [r.score for r in reward(["abc"], [""])] == [3.0]  # the judge answered: the breaker stays closed
    reward.close()


def test_an_oversized_response_is_refused_by_its_content_length(judge):
    judge.reset(("json", {"scores": [1], "pad": "x" * 10_000}))  # '{"scores": [1], "pad": "' + 10,000 x + '"}'
    results = remote(judge, max_response_bytes=4096, max_failure_frac=1.0)(["a"], [""])
    assert results[0].failed
    assert results[0].reasons["remote"] == "response too large (Content-Length 10026): over max_response_bytes=4096"


def test_an_endless_response_is_read_no_further_than_the_bound(judge):
    """The judge streams up to 256 MiB with no Content-Length; the client stops after 4 KiB and hangs up, so the
    judge gets to write only what the socket buffers hold."""
    judge.reset(("flood", 256 << 20))
    reward = remote(judge, max_response_bytes=4096, max_failure_frac=1.0)
    start = time.monotonic()
    results = reward(["a"], [""])
    assert time.monotonic() - start < 1.0
    assert results[0].reasons["remote"] == ("response too large (more than 4096 bytes): over "
                                            "max_response_bytes=4096")
    assert judge.flooded.wait(2.0) and judge.sent < 64 << 20
    reward.close()


def test_reward_mean_leaves_out_the_samples_whose_reward_failed(judge):
    """One group of 4 scored [1, fail, 0, 1] by the judge: rollout/reward_mean = (1 + 0 + 1) / 3 = 2/3 (not
    2/4), rollout/reward_failed 1, accuracy 2/3 (score >= 1 is correct), no grader error; the failed sample is out
    of the loss with advantage 0, and the others' baseline is over the three scored ones."""
    from miles_k3.evals.problems import Problem
    from miles_k3.model.tokenizer import small_tokenizer
    from miles_k3.rollout.api import EngineCapabilities
    from miles_k3.trainer.rollouts import PromptStream, RolloutConfig, collect_rollouts

    tok = small_tokenizer(300)

    class Engine:  # a scripted double of RolloutEngine.generate: every sample answers "7" in 2 tokens
        capabilities = EngineCapabilities()  # it only generates

        def generate(self, input_ids, sampling_params, n, return_logprob, lora, return_routed_experts=False):
            ids = tok.encode("7")
            return [{"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": 0,
                                                      "output_token_logprobs": [(-0.5, t) for t in ids]}}
                    for _ in input_ids for _ in range(n)]

    judge.reset(("json", {"scores": [1, "x", 0, 1]}))
    reward = remote(judge, max_failure_frac=0.5)
    cfg = RolloutConfig(prompts_per_step=1, group_size=4, template="plain", max_new_tokens=4)
    samples, m = collect_rollouts(Engine(), tok, PromptStream([Problem("p", "what is 3 + 4?", "7")], 0), reward,
                                  cfg, None)
    assert m["rollout/reward_mean"] == pytest.approx(2 / 3) and m["rollout/reward_failed"] == 1.0
    assert m["rollout/accuracy"] == pytest.approx(2 / 3) and m["rollout/grader_error_rate"] == 0.0
    assert m["reward/remote_error_rate"] == 0.25
    assert [(s.reward_failed, s.in_loss) for s in samples] == [(False, True), (True, False), (False, True),
                                                               (False, True)]
    assert samples[1].advantage == 0.0
    assert sum(s.advantage for s in samples) == pytest.approx(0.0) and samples[0].advantage > 0 > samples[2].advantage
    reward.close()


def test_a_password_in_the_url_is_sent_as_basic_auth_and_never_shown(judge, caplog):
    url = judge.url.replace("http://", "http://judge:s3cret-pw@")
    judge.reset(("ok",), ("status", 401))
    reward = RemoteReward(RemoteRewardConfig(url=url, max_failure_frac=0.0))
    with caplog.at_level(logging.DEBUG), pytest.raises(RemoteRewardError) as e:  # httpx logs each request's URL
        assert [r.score for r in reward(["ab"], [""])] == [2.0]
        reward(["a"], [""])
    assert [q["authorization"] for q in judge.requests] == ["Basic " + base64.b64encode(b"judge:s3cret-pw").decode()] * 2
    assert judge.url.replace("http://", "http://judge:***@") in str(e.value) and "HTTP 401" in str(e.value)
    assert caplog.records and all("s3cret-pw" not in r.getMessage() for r in caplog.records)
    assert "s3cret-pw" not in str(e.value)
    reward.close()


# ---- config -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("remote_kw, message", [
    ({"url": "ftp://judge/score"}, "remote.url: must start with http:// or https://, got 'ftp://judge/score'"),
    ({"batch_size": 0}, "remote.batch_size: must be >= 1, got 0"),
    ({"timeout_s": 0.0}, "remote.timeout_s: must be a finite number of seconds > 0"),
    ({"timeout_s": float("inf")}, "remote.timeout_s: must be a finite number of seconds > 0"),
    ({"retries": -1}, "remote.retries: must be >= 0, got -1"),
    ({"backoff_s": -0.5}, "remote.backoff_s: must be a finite number of seconds >= 0"),
    ({"max_failure_frac": 1.5}, "remote.max_failure_frac: must be between 0 and 1, got 1.5"),
    ({"max_failure_frac": -0.1}, "remote.max_failure_frac: must be between 0 and 1, got -0.1"),
    ({"api_key_env": "MILES_K3_TEST_NO_SUCH_VAR"},
     "remote.api_key_env: the environment variable MILES_K3_TEST_NO_SUCH_VAR is not set"),
    ({"max_response_bytes": 0}, "remote.max_response_bytes: must be >= 1, got 0"),
    ({"breaker_failures": -1}, "remote.breaker_failures: must be >= 0 (0: no circuit breaker), got -1"),
    ({"breaker_cooldown_s": 0.0}, "remote.breaker_cooldown_s: must be a finite number of seconds > 0, got 0.0"),
    ({"score_max": 1e39}, "remote.score_max: must be a number within float32's finite range or null, got 1e+39"),
    ({"score_min": float("nan")}, "remote.score_min: must be a number within float32's finite range or null"),
    ({"score_min": 1.0, "score_max": 0.0}, "remote.score_min: 1.0 is above score_max 0.0"),
    ({"url": "http://[::1/score"}, "remote.url: not a valid URL"),
    ({"url": "http://u:pw@judge:1/score", "api_key_env": "MILES_K3_TEST_NO_SUCH_VAR"},
     "remote.api_key_env: the url carries credentials (user:password@) too"),
])
def test_remote_validation_names_the_field(remote_kw, message, monkeypatch):
    monkeypatch.delenv("MILES_K3_TEST_NO_SUCH_VAR", raising=False)
    cfg = RewardConfig(name="remote", remote=RemoteRewardConfig(**{"url": "http://judge:1/score", **remote_kw}))
    with pytest.raises(ValueError) as e:
        cfg.validate()
    assert str(e.value).startswith(message)
    with pytest.raises(ValueError, match=f"^{message.split(':')[0]}: "):
        build_reward(cfg)


def test_the_api_key_variable_is_named_not_its_value(monkeypatch):
    monkeypatch.setenv("MILES_K3_TEST_JUDGE_TOKEN", "")
    with pytest.raises(ValueError, match="MILES_K3_TEST_JUDGE_TOKEN is not set"):
        RemoteRewardConfig(url="http://judge:1", api_key_env="MILES_K3_TEST_JUDGE_TOKEN").validate()
    monkeypatch.setenv("MILES_K3_TEST_JUDGE_TOKEN", TOKEN)
    RemoteRewardConfig(url="http://judge:1", api_key_env="MILES_K3_TEST_JUDGE_TOKEN").validate()


@pytest.mark.parametrize("cfg, message", [
    (RewardConfig(name="remote"),
     "remote.url: reward.name=remote needs the judge's URL, e.g. reward.remote.url=http://127.0.0.1:8001/score"),
    (RewardConfig(name="aime", remote=RemoteRewardConfig(url="http://judge:1/score")),
     ("remote: reward.remote.* is set but reward.name=aime, where it does nothing; set reward.name=remote or "
      "leave reward.remote at its defaults")),
    (RewardConfig(name="math", remote=RemoteRewardConfig(retries=0)),
     "remote: reward.remote.* is set but reward.name=math"),
    (RewardConfig(name="remote", format_bonus=0.1, remote=RemoteRewardConfig(url="http://judge:1/score")),
     "format_bonus: the remote reward's scores come from the judge"),
])
def test_reward_config_refusals(cfg, message):
    with pytest.raises(ValueError) as e:
        cfg.validate()
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_a_remote_reward_without_a_url_is_refused():
    with pytest.raises(ValueError, match="^url: the remote reward needs the judge's URL"):
        RemoteReward(RemoteRewardConfig())


def test_compose_config_needs_the_url():
    from miles_k3.config import compose_config

    with pytest.raises(Exception) as e:
        compose_config("train", ["reward.name=remote"])
    assert "reward.remote.url: reward.name=remote needs the judge's URL" in str(e.value)
    with pytest.raises(Exception) as e:
        compose_config("train", ["reward.name=remote", "reward.remote.url=http://judge:1",
                                 "reward.remote.retries=-1"])
    assert str(e.value).startswith("reward.remote.retries: must be >= 0")  # named once, in full
    cfg = compose_config("train", ["reward.name=remote", "reward.remote.url=http://judge:1/score",
                                   "reward.remote.batch_size=8", "reward.remote.score_min=0",
                                   "reward.remote.breaker_failures=0"])
    assert cfg.reward.remote == RemoteRewardConfig(url="http://judge:1/score", batch_size=8, score_min=0.0,
                                                   breaker_failures=0)


def test_every_remote_field_is_documented():
    from miles_k3.evals import remote_reward

    RemoteRewardConfig().validate()
    body = next(n for n in ast.parse(inspect.getsource(remote_reward)).body
                if isinstance(n, ast.ClassDef) and n.name == "RemoteRewardConfig").body
    fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
    documented = [a.target.id for a, b in itertools.pairwise(body) if isinstance(a, ast.AnnAssign)
                  and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)]
    assert fields == documented == ["url", "batch_size", "timeout_s", "retries", "backoff_s", "max_failure_frac",
                                    "api_key_env", "max_response_bytes", "breaker_failures", "breaker_cooldown_s",
                                    "score_min", "score_max"]


def test_old_reward_results_still_build():
    assert RewardResult(1.0, True, {}) == RewardResult(1.0, True, {}, failed=False)


@pytest.mark.parametrize("first", ["miles_k3.evals.rewards", "miles_k3.evals.remote_reward"])
def test_either_module_imports_first(first):
    code = (f"import {first}\n"
            "from miles_k3.evals.rewards import RewardConfig, build_reward, reward_names\n"
            "from miles_k3.evals.remote_reward import RemoteRewardConfig\n"
            "assert 'remote' in reward_names()\n"
            "build_reward(RewardConfig(name='remote', remote=RemoteRewardConfig(url='http://judge:1'))).close()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("field, value", [("timeout_s", 9.0), ("workers", 2), ("channel", "none"), ("max_chars", 10)])
def test_the_local_grading_fields_are_refused_with_the_remote_reward(field, value):
    from miles_k3.evals.rewards import RewardConfig

    cfg = RewardConfig(name="remote", remote=RemoteRewardConfig(url="http://127.0.0.1:9/score"))
    cfg.validate()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=rf"^{field}: reward.name=remote grades in the judge server"):
        cfg.validate()


def test_step_metrics_sum_the_replicas_counts(monkeypatch):
    """Two replicas: this one scored 10 samples (2 failed, 1 of them at once by the open breaker, 1 retry, the
    breaker opened once, 3 s), the other 30 (none failed, 2 retries, 5 s). The step's error rate is 2 / 40 = 0.05
    (this replica's alone: 0.2), fast failures 1, retries 3, breaker openings 1, seconds the slower 5."""
    from miles_k3.trainer import rollouts

    class Counted:
        def pop_counts(self):
            return {"samples": 10.0, "failed": 2.0, "fast_failed": 1.0, "retries": 1.0, "breaker_opens": 1.0,
                    "seconds": 3.0}

    other = [30.0, 0.0, 0.0, 2.0, 0.0]  # the same keys but seconds, in order
    monkeypatch.setattr(rollouts, "sum_over", lambda values, group: [v + o for v, o in zip(values, other)])
    monkeypatch.setattr(rollouts, "max_over", lambda values, group: [max(values[0], 5.0)])
    assert rollouts.reward_metrics(Counted()) == {"reward/remote_error_rate": 0.05, "reward/remote_fast_failed": 1.0,
                                                  "reward/remote_retries": 3.0, "reward/remote_breaker_opens": 1.0,
                                                  "reward/remote_seconds": 5.0}
    assert rollouts.reward_metrics(lambda rs, gs: []) == {}  # a reward without counts
