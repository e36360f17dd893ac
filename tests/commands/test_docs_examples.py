"""The docs' eval and serve examples return real answers with what ships (issue 57): every `python -m miles_k3.eval`
and `python -m miles_k3.serve` line of docs/guides/eval.md, docs/concepts/serve.md and docs/getting-started.md
is run in this process (or is listed in NOT_RUN, with the reason), and so is serve.md's `openai` client example,
against a uvicorn server on 127.0.0.1. A chain_sum answer of the shipped base must parse as an integer; an eval
must grade real answers (answer_rate > 0), not "no final answer" everywhere.

The quickstart's adapter in the examples (runs/train-20261201-123541/...) is stood in for by the shipped base's
LoRA (B = 0) beside the quickstart's config.yaml (`trained_run_helpers`)."""
import json
import re
import shlex
import socket
import threading
import time

import pytest
from repo_helpers import REPO as ROOT
from trained_run_helpers import save_run, train_yaml

from miles_k3.config import compose_config
from miles_k3.eval import compose_eval, run

DOCS = ("docs/guides/eval.md", "docs/concepts/serve.md", "docs/getting-started.md")
EXAMPLE_ADAPTER = "runs/train-20261201-123541/checkpoints/step_00001000/adapter"
SMALL = ["device=cpu", "engine.memory_budget_bytes=8388608"]
NOT_RUN = {
    "python -m miles_k3.eval recipe=aime_eval model.path=/ckpt/kimi-k3 adapter=runs/x/adapter": "the real K3",
    "python -m miles_k3.serve model.path=/ckpt/kimi-k3 device=cuda engine.max_context=32768": "the real K3, CUDA",
    "python -m miles_k3.serve --help": "prints usage (tests/commands/test_serve.py::test_help_prints_usage)",
    "python -m miles_k3.serve": "serve.md's client example below runs against it",
}


def example_lines(doc: str) -> list[str]:
    """The eval / serve command lines of `doc`'s bash blocks, without their comments."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if re.match(r"python -m miles_k3\.(eval|serve)\b", line)]


EXAMPLES = sorted({line: doc for doc in reversed(DOCS) for line in example_lines(doc)  # a line once: its first doc
                   if line not in NOT_RUN}.items())


def test_every_example_is_run_or_listed_with_its_reason():
    found = {line for doc in DOCS for line in example_lines(doc)}
    assert set(NOT_RUN) <= found, set(NOT_RUN) - found  # a stale entry
    assert len(EXAMPLES) >= 4, EXAMPLES


@pytest.fixture(scope="module")
def quickstart_adapter(tmp_path_factory):
    return str(save_run(tmp_path_factory.mktemp("quickstart"), train_yaml("steps=1")))


def _args(line: str, adapter: str) -> list[str]:
    return [a.replace(EXAMPLE_ADAPTER, adapter) for a in shlex.split(line)[3:]]


def _is_integer(text: str) -> bool:
    return re.fullmatch(r"-?\d+", text) is not None


@pytest.mark.parametrize("line, doc", EXAMPLES, ids=[line.removeprefix("python -m ") for line, _ in EXAMPLES])
def test_the_example_returns_real_answers(line, doc, quickstart_adapter, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _args(line, quickstart_adapter)
    if line.startswith("python -m miles_k3.eval"):
        if "eval.data.source=problems.jsonl" in args:  # the file the doc shows, written as the doc shows it
            block = re.search(r"`problems.jsonl`.*?```json\n(.*?)```", (ROOT / doc).read_text(), flags=re.DOTALL)
            (tmp_path / "problems.jsonl").write_text(block.group(1))
        else:  # the run's 300 held-out problems, fewer of them (the same template, grader and task)
            args += ["eval.data.size=8", "eval.batch_problems=8"]
        summary = run(compose_eval([*args, *SMALL, f"run_dir={tmp_path}/out"]))
        rows = [json.loads(x) for x in (tmp_path / "out/results.jsonl").read_text().splitlines()]
        assert summary["answer_rate"] > 0.5, summary
        assert sum(_is_integer(r["response"]) for r in rows) > len(rows) / 2, [r["response"] for r in rows]
        return
    from fastapi.testclient import TestClient

    from miles_k3.serve import serving_app

    args = [a for a in args if not a.startswith("port=")]  # TestClient needs no port
    app, engine = serving_app(compose_config("serve", [*args, *SMALL]))
    try:
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={"model": "k3_nano", "max_tokens": 16,
                                                          "messages": [{"role": "user", "content": "15-43-75"}]})
    finally:
        engine.close()
    assert r.status_code == 200, r.text
    assert _is_integer(r.json()["choices"][0]["message"]["content"]), r.json()


def test_the_serve_client_example_returns_integers():
    """serve.md's python block, verbatim but for its base_url, against `python -m miles_k3.serve`'s app (the
    shipped base) under uvicorn on 127.0.0.1."""
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    import httpx

    from miles_k3.serve import serving_app

    code = re.search(r"```python\n(.*?)```", (ROOT / "docs/concepts/serve.md").read_text(), flags=re.DOTALL).group(1)
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    app, engine = serving_app(compose_config("serve", SMALL))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        namespace: dict = {"print": lambda *a: None}
        exec(code.replace("http://127.0.0.1:8000/v1", base), namespace)  # noqa: S102
        record = httpx.get(f"{base}/sessions/{namespace['r'].session_id}").json()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        engine.close()
    first, second = namespace["messages"][1]["content"], namespace["r"].choices[0].message.content
    assert _is_integer(first) and _is_integer(second), (first, second)
    assert len(record["turns"]) == 2  # the second request continued the first's session
