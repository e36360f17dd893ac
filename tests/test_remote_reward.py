"""The remote reward (reward.name=remote) against a local stub judge server: scores in order over batches,
`correct` by default and as sent, retries on 5xx / 429 / timeouts and none on other 4xx, malformed responses
failing their batch or only their item, the failure budget, the bearer token (sent, never logged or shown),
the metrics, and the config's refusals (directly and through compose_config)."""
from __future__ import annotations

import ast
import inspect
import itertools
import json
import logging
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_k3.evals.remote_reward import RemoteReward, RemoteRewardConfig, RemoteRewardError
from miles_k3.evals.rewards import RewardConfig, RewardResult, build_reward, grade_outcome

TOKEN = "sk-test-TOKEN-5f3a9c"


# ---- the stub judge -------------------------------------------------------------------------------------------
@dataclass
class Judge:
    """What the stub does per request: the next scripted action, or ("ok",) once the script is empty.

    Actions: ("ok",) scores each item len(response); ("status", code) answers with that status; ("sleep", s)
    sleeps s seconds, then answers ("ok",); ("body", bytes) answers 200 with that raw body; ("json", obj) answers
    200 with obj as JSON; ("echo_auth", code) answers that status with the Authorization header in its body.
    Every request's items and Authorization header are recorded."""

    url: str = ""
    script: queue.Queue = field(default_factory=queue.Queue)
    requests: list = field(default_factory=list)

    def reset(self, *actions: tuple) -> None:
        self.script = queue.Queue()
        for action in actions:
            self.script.put(action)
        self.requests.clear()


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

        def _answer(self, action: tuple, items: list[dict]) -> None:
            kind = action[0]
            if kind == "sleep":
                time.sleep(action[1])
                kind = "ok"
            if kind == "status":
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
    assert reward.pop_metrics() == {"reward/remote_error_rate": 0.0, "reward/remote_retries": 0.0,
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


@pytest.mark.parametrize("body, bad", [
    (b'{"scores": [1.0, NaN, 2.0]}', "nan"),
    (b'{"scores": [1.0, Infinity, 2.0]}', "inf"),
    (b'{"scores": [1.0, "0.5", 2.0]}', "'0.5'"),
    (b'{"scores": [1.0, true, 2.0]}', "True"),
    (b'{"scores": [1.0, null, 2.0]}', "None"),
])
def test_a_bad_score_fails_only_its_item(judge, body, bad):
    judge.reset(("body", body))
    reward = remote(judge, max_failure_frac=0.5)
    results = reward(["a", "b", "c"], ["", "", ""])
    assert [(r.score, r.failed) for r in results] == [(1.0, False), (0.0, True), (2.0, False)]
    assert results[1].reasons["remote"] == f"malformed response: scores[1] is not a finite number: {bad}"
    assert reward.pop_metrics()["reward/remote_error_rate"] == pytest.approx(1 / 3)


def test_a_bad_correct_entry_fails_only_its_item(judge):
    judge.reset(("json", {"scores": [1, 0], "correct": [True, "yes"]}))
    results = remote(judge, max_failure_frac=1.0)(["a", "b"], ["", ""])
    assert [(r.correct, r.failed) for r in results] == [(True, False), (False, True)]
    assert results[1].reasons["remote"] == "malformed response: correct[1] is not a bool: 'yes'"


# ---- the failure budget and the token ---------------------------------------------------------------------
def test_the_failure_budget(judge):
    judge.reset(("json", {"scores": [1, 2, "x", 3]}))
    with pytest.raises(RemoteRewardError) as e:
        remote(judge, max_failure_frac=0.1)(["a", "b", "c", "d"], [""] * 4)
    message = str(e.value)
    assert message.startswith("reward.remote: 1 of 4 samples could not be scored (25% > max_failure_frac 10%) "
                              f"at {judge.url}: last error: malformed response: scores[2] is not a finite number")
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
                                   "reward.remote.batch_size=8"])
    assert cfg.reward.remote == RemoteRewardConfig(url="http://judge:1/score", batch_size=8)


def test_every_remote_field_is_documented():
    from miles_k3.evals import remote_reward

    RemoteRewardConfig().validate()
    body = next(n for n in ast.parse(inspect.getsource(remote_reward)).body
                if isinstance(n, ast.ClassDef) and n.name == "RemoteRewardConfig").body
    fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
    documented = [a.target.id for a, b in itertools.pairwise(body) if isinstance(a, ast.AnnAssign)
                  and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)]
    assert fields == documented == ["url", "batch_size", "timeout_s", "retries", "backoff_s", "max_failure_frac",
                                    "api_key_env"]


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
    """Two replicas: this one scored 10 samples (2 failed, 1 retry, 3 s), the other 30 (none failed, 2 retries,
    5 s). The step's error rate is 2 / 40 = 0.05 (this replica's alone: 0.2), retries 3, seconds the slower 5."""
    from miles_k3.trainer import rollouts

    class Counted:
        def pop_counts(self):
            return {"samples": 10.0, "failed": 2.0, "retries": 1.0, "seconds": 3.0}

    monkeypatch.setattr(rollouts, "sum_over", lambda values, group: [v + o for v, o in zip(values, [30.0, 0.0, 2.0])])
    monkeypatch.setattr(rollouts, "max_over", lambda values, group: [max(values[0], 5.0)])
    assert rollouts.reward_metrics(Counted()) == {"reward/remote_error_rate": 0.05, "reward/remote_retries": 3.0,
                                                  "reward/remote_seconds": 5.0}
    assert rollouts.reward_metrics(lambda rs, gs: []) == {}  # a reward without counts
