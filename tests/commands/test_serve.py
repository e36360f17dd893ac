"""`python -m miles_k3.serve`: the OpenAI-compatible endpoint, driven by the real `openai` client against a uvicorn
server in a background thread (one for the module) over the shipped k3_nano base on the CPU. Its tokenizer is
the small byte-level one (byte b is id b, [EOS] 257, <|end_of_msg|> 259, no chat template), so the expected
prompt ids are the bytes of the fallback format's text: `user: hi\\nassistant: ` is list(b"user: hi\\nassistant: ").

A `ScriptedEngine` stands between the server and the real engine: with a script it returns the scripted output
ids (hand-picked: a reply whose bytes are invalid UTF-8) instead of sampling; it records every prompt the server
sent, so a test checks exactly what the engine saw."""
import concurrent.futures as cf
import json
import re
import socket
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # after the skips: the serve extra
from repo_helpers import REPO as ROOT

from miles_k3.config import ConfigFieldError, compose_config
from miles_k3.rollout.api import EngineCapabilities
from miles_k3.rollout.server import ServerConfig, ServerConfigError, build_app, render_messages
from miles_k3.serve import eval_engine, is_loopback

MAX_CONTEXT = 160
MAX_BODY = 65536
EOS, END_OF_MSG = 257, 259


class ScriptedEngine:
    """The real engine, or scripted outputs when `script` is set: a list of output id lists (one per prompt, in
    order) or a function of the prompt. `gate`: an event each call waits for (to hold the engine busy)."""

    def __init__(self, engine):
        self.engine, self.script, self.prompts, self.gate = engine, [], [], None

    capabilities = EngineCapabilities(keeps_state=True)  # the real engine's; scripted outputs keep none (no id)

    @property
    def max_context(self):
        return self.engine.max_context

    def generate(self, input_ids, sampling_params, n, return_logprob, lora, keep_state=False, states=None):
        self.prompts.append([list(p) for p in input_ids])
        if self.gate is not None:
            self.gate.wait(timeout=30)
        if not self.script:
            return self.engine.generate(input_ids=input_ids, sampling_params=sampling_params, n=n,
                                        return_logprob=return_logprob, lora=lora, keep_state=keep_state,
                                        states=states)
        return [self.scripted(p) for p in input_ids for _ in range(n)]

    def release_states(self, ids):
        self.engine.release_states(ids)

    def scripted(self, prompt):
        out = self.script(prompt) if callable(self.script) else self.script.pop(0)
        stop = out[-1] in (EOS, END_OF_MSG)
        finish = {"type": "stop", "matched": out[-1]} if stop else {"type": "length"}
        return {"output_ids": list(out),
                "meta_info": {"finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(out),
                              "cached_tokens": 0, "weight_version": 7, "weight_versions": [7],
                              "output_token_logprobs": [(-0.5, t) for t in out],
                              "output_token_weight_versions": [7] * len(out)}}


@pytest.fixture(scope="module")
def served():
    """(openai client, base url, scripted engine, real engine, tokenizer) of one server for the module."""
    cfg = compose_config("serve", ["device=cpu", f"engine.max_context={MAX_CONTEXT}", f"max_body_bytes={MAX_BODY}",
                                   "engine.memory_budget_bytes=8388608"])
    engine, tokenizer, lora = eval_engine(cfg)
    scripted = ScriptedEngine(engine)
    app = build_app(scripted, tokenizer, cfg, lora)
    scripted.server = app.state.server
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    base = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=60)
    yield client, base, scripted, engine, tokenizer
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()
    engine.close()


def record(base: str, sid: str) -> dict:
    r = httpx.get(f"{base}/sessions/{sid}")
    assert r.status_code == 200, r.text
    return r.json()


def test_config_defaults_bind_loopback_and_serve_the_shipped_base():
    cfg = compose_config("serve")
    assert (cfg.host, cfg.port, cfg.max_body_bytes) == ("127.0.0.1", 8000, 1048576)
    assert cfg.model.name == "k3_nano" and cfg.model.path == "builtin:k3_nano_chain_sum"
    assert cfg.adapter is None and cfg.api_key_env is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    with pytest.raises(ConfigFieldError, match="port: must be in 1..65535"):
        compose_config("serve", ["port=0"])
    with pytest.raises(ConfigFieldError, match="engine.backend: python -m miles_k3.serve serves the native"):
        compose_config("serve", ["engine.backend=sglang"])
    with pytest.raises(ConfigFieldError, match="api_key_env: the environment variable MILES_K3_NO_SUCH_VAR"):
        compose_config("serve", ["api_key_env=MILES_K3_NO_SUCH_VAR"])


def test_the_library_serves_a_config_of_its_own_and_imports_without_fastapi_or_the_command():
    """The server is a library under rollout/ (`miles_k3.rollout.server`): it serves over a plain `ServerConfig`
    (no model name: "policy"), the command's `ServeConfig` is one (its fields keep their flat names), and a fresh
    interpreter imports it without FastAPI, uvicorn, torch or any entry point (this one has them all)."""
    import subprocess

    from fastapi.testclient import TestClient

    from miles_k3.model.tokenizer import small_tokenizer

    with TestClient(build_app(ScriptedEngine(None), small_tokenizer(512), ServerConfig())) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["policy"]
    cfg = compose_config("serve", ["max_sessions=8", "max_n=8", "served_model_name=mine"])
    assert isinstance(cfg, ServerConfig) and (cfg.max_sessions, cfg.model_id()) == (8, "mine")
    code = ("import sys, miles_k3.rollout, miles_k3.rollout.server\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'torch') or m in "
            "('miles_k3.serve', 'miles_k3.config', 'miles_k3.launch', 'miles_k3.agent', 'miles_k3.eval')))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stderr


def test_help_prints_usage(monkeypatch, capsys):
    """`python -m miles_k3.serve --help`, in this process (a subprocess would import torch again)."""
    from miles_k3 import serve

    monkeypatch.setattr(sys, "argv", ["miles_k3.serve", "--help"])
    with pytest.raises(SystemExit) as done:
        serve.main()
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m miles_k3.serve [model=NAME]") and "host=127.0.0.1" in out


def test_render_uses_the_chat_template_when_there_is_one():
    from miles_k3.model.tokenizer import small_tokenizer

    tok = small_tokenizer(512)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "ann"}]
    assert render_messages(tok, msgs) == "system: be brief\nuser (ann): hi\nassistant: "
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert render_messages(tok, msgs) == "<system>be brief<user>hi<assistant>"


def test_models_lists_the_served_model(served):
    client, *_ = served
    assert [m.id for m in client.models.list().data] == ["k3_nano"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_session_keeps_the_sampled_ids_not_a_retokenisation(served):
    """Turn 2 samples the bytes E2 82 (the first two of the three of "€") and [EOS]: decoded, they are one
    U+FFFD, which tokenises as EF BF BD. The session keeps E2 82, and turn 3's prompt carries them."""
    client, base, scripted, _, tokenizer = served
    scripted.script = [[104, 105, END_OF_MSG], [0xE2, 0x82, EOS], [33, END_OF_MSG]]
    msgs = [{"role": "user", "content": "hi"}]
    r1 = client.chat.completions.create(model="k3_nano", messages=msgs, max_tokens=5)
    sid = r1.session_id
    assert r1.choices[0].message.content == "hi" and r1.choices[0].finish_reason == "stop"
    prompt = list(b"user: hi\nassistant: ")
    assert scripted.prompts[-1] == [prompt]

    msgs += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "ok"}]
    r2 = client.chat.completions.create(model="k3_nano", messages=msgs, max_tokens=5, extra_body={"session_id": sid})
    assert r2.session_id == sid
    new = list(b"user: ok\nassistant: ")
    assert scripted.prompts[-1] == [prompt + [104, 105, END_OF_MSG] + new]
    text = r2.choices[0].message.content
    assert text == "\ufffd"
    assert tokenizer.encode(text, add_special_tokens=False) == [0xEF, 0xBF, 0xBD]  # not what was sampled

    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "?"}]
    client.chat.completions.create(model="k3_nano", messages=msgs, max_tokens=5, extra_body={"session_id": sid})
    third = list(b"user: ?\nassistant: ")
    ids = prompt + [104, 105, END_OF_MSG] + new + [0xE2, 0x82, EOS] + third + [33, END_OF_MSG]
    assert scripted.prompts[-1] == [ids[:-2]]
    rec = record(base, sid)
    assert rec["ids"] == ids and rec["prompt_ids"] == prompt
    mask = [0] * len(prompt) + [1] * 3 + [0] * len(new) + [1] * 3 + [0] * len(third) + [1] * 2
    assert rec["loss_mask"] == mask
    assert rec["logprobs"] == [-0.5 if m else 0.0 for m in mask]
    assert rec["weight_versions"] == [7 if m else None for m in mask]
    assert [(t["context_start"], t["output_start"], t["output_end"]) for t in rec["turns"]] == [
        (0, 20, 23), (23, 43, 46), (46, 65, 67)]
    assert rec["messages"][-1] == {"role": "assistant", "content": "!"} and rec["end"] is None


def test_greedy_and_seeded_turns_equal_the_engines_own_generate(served):
    """Real sampling: turn 1 greedy, turn 2 seeded; each equals the engine's generate over the same ids, and the
    record is prompt + turn 1 + the next message + turn 2."""
    client, base, _, engine, _ = served
    msgs = [{"role": "user", "content": "15-43-75="}]
    r1 = client.chat.completions.create(model="k3_nano", messages=msgs, max_tokens=6, temperature=0, logprobs=True)
    sid = r1.session_id
    prompt = list(b"user: 15-43-75=\nassistant: ")
    greedy = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 6, "temperature": 0.0})[0]
    out1 = greedy["output_ids"]
    assert record(base, sid)["ids"] == prompt + out1
    lps = [c.logprob for c in r1.choices[0].logprobs.content]
    assert lps == pytest.approx([lp for lp, _ in greedy["meta_info"]["output_token_logprobs"]])

    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "2+3="}]
    before = engine.kept_state_stats
    client.chat.completions.create(model="k3_nano", messages=msgs, max_tokens=6, seed=11,
                                   extra_body={"session_id": sid})
    after = engine.kept_state_stats  # turn 2 continued on the state of turn 1: prompt + out1 but its last token
    assert after["continued"] - before["continued"] == 1
    assert after["kept_tokens"] - before["kept_tokens"] == len(prompt) + len(out1) - 1
    new = list(b"user: 2+3=\nassistant: ")
    out2 = engine.generate(input_ids=[prompt + out1 + new], sampling_params={
        "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11})[0]["output_ids"]
    rec = record(base, sid)
    assert rec["ids"] == prompt + out1 + new + out2
    assert rec["loss_mask"] == [0] * len(prompt) + [1] * len(out1) + [0] * len(new) + [1] * len(out2)
    assert rec["weight_versions"][len(prompt)] == 0 and len(rec["turns"]) == 2
    parked = engine.runner.kept_states.num_parked
    assert httpx.delete(f"{base}/sessions/{sid}").status_code == 200
    deadline = time.time() + 20  # DELETE frees its engine state (on the engine's worker thread)
    while engine.runner.kept_states.num_parked != parked - 1 and time.time() < deadline:
        time.sleep(0.01)
    assert engine.runner.kept_states.num_parked == parked - 1


def test_n_forks_start_one_session_each(served):
    client, base, _, engine, _ = served
    r = client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": "7+8="}], n=2,
                                       max_tokens=4, seed=5)
    prompt = list(b"user: 7+8=\nassistant: ")
    outs = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 4, "sampling_seed": 5}, n=2)
    sids = [c.session_id for c in r.choices]
    assert len(set(sids)) == 2 and r.session_id == sids[0]
    assert [record(base, s)["ids"] for s in sids] == [prompt + o["output_ids"] for o in outs]
    with pytest.raises(openai.BadRequestError, match="a session continues with one sample"):
        client.chat.completions.create(model="k3_nano", n=2, extra_body={"session_id": sids[0]}, messages=[
            {"role": "user", "content": "7+8="}, {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "?"}])


def test_requests_that_wait_share_the_next_engine_call(served):
    """While a call holds the engine, three requests arrive; they go into the next call together, and each gets
    its own prompt's output (the script echoes the user's letter)."""
    client, base, scripted, _, _ = served
    scripted.script = lambda prompt: [prompt[6], END_OF_MSG]  # "user: b\nassistant: " -> "b"
    scripted.gate = threading.Event()
    calls = len(scripted.prompts)

    def ask(letter):
        r = client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": letter}],
                                           max_tokens=2)
        return r.choices[0].message.content, r.session_id

    def wait_for(cond):
        deadline = time.time() + 20
        while not cond() and time.time() < deadline:
            time.sleep(0.01)
        assert cond()

    try:
        with cf.ThreadPoolExecutor(4) as pool:
            first = pool.submit(ask, "a")
            wait_for(lambda: len(scripted.prompts) == calls + 1)  # the first call holds the engine
            rest = {c: pool.submit(ask, c) for c in "bcd"}
            wait_for(lambda: len(scripted.server.pending) == 3)
            scripted.gate.set()
            answers = {"a": first.result(), **{c: f.result() for c, f in rest.items()}}
    finally:
        scripted.gate, scripted.script = None, []
    assert {c: text for c, (text, _) in answers.items()} == {"a": "a", "b": "b", "c": "c", "d": "d"}
    assert len(scripted.prompts) == calls + 2  # two engine calls for four requests
    assert sorted(scripted.prompts[-1]) == [list(f"user: {c}\nassistant: ".encode()) for c in "bcd"]
    for c, (_, sid) in answers.items():
        assert record(base, sid)["ids"] == list(f"user: {c}\nassistant: ".encode()) + [ord(c), END_OF_MSG]


def test_completions_text_and_token_ids(served):
    client, base, scripted, _, _ = served
    scripted.script = [[50, 51], [52, EOS]]
    r = client.completions.create(model="k3_nano", prompt="1+1=", max_tokens=2, logprobs=0)
    assert r.choices[0].text == "23" and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.token_logprobs == [-0.5, -0.5]
    r2 = client.completions.create(model="k3_nano", prompt=[10, 61], max_tokens=2,
                                   extra_body={"session_id": r.session_id})
    assert r2.choices[0].text == "4"
    assert scripted.prompts[-1] == [list(b"1+1=") + [50, 51, 10, 61]]
    rec = record(base, r.session_id)
    assert rec["ids"] == list(b"1+1=") + [50, 51, 10, 61, 52, EOS]
    assert rec["loss_mask"] == [0, 0, 0, 0, 1, 1, 0, 0, 1, 1] and rec["kind"] == "completion"


def test_unknown_and_deleted_sessions_answer_404_and_the_server_goes_on(served):
    client, base, scripted, _, _ = served
    with pytest.raises(openai.NotFoundError, match="unknown or ended"):
        client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"session_id": "no-such-session"})
    assert httpx.get(f"{base}/sessions/nope").status_code == 404
    scripted.script = [[104, END_OF_MSG]]
    r = client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content == "h"
    assert httpx.delete(f"{base}/sessions/{r.session_id}").json()["deleted"] is True
    assert httpx.get(f"{base}/sessions/{r.session_id}").status_code == 404
    with pytest.raises(openai.NotFoundError, match="unknown or ended"):
        client.chat.completions.create(model="k3_nano", extra_body={"session_id": r.session_id}, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "h"}, {"role": "user", "content": "x"}])


def test_altered_history_is_409_naming_the_message(served):
    client, base, scripted, _, _ = served
    scripted.script = [[104, 105, END_OF_MSG]]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    sid = client.chat.completions.create(model="k3_nano", messages=msgs, max_tokens=3).session_id
    edited = [msgs[0], {"role": "user", "content": "HI"}, {"role": "assistant", "content": "hi"},
              {"role": "user", "content": "more"}]
    with pytest.raises(openai.ConflictError, match=r"messages\[1\] differs"):
        client.chat.completions.create(model="k3_nano", messages=edited, extra_body={"session_id": sid})
    reply_changed = [*msgs, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    with pytest.raises(openai.ConflictError, match=r"messages\[2\] differs.*assistant 'hi'"):
        client.chat.completions.create(model="k3_nano", messages=reply_changed, extra_body={"session_id": sid})
    with pytest.raises(openai.ConflictError, match="adds none"):
        client.chat.completions.create(model="k3_nano", messages=msgs, extra_body={"session_id": sid})
    assert len(record(base, sid)["turns"]) == 1  # refused requests change nothing


def test_past_the_context_is_400_and_ends_the_session_truncated(served):
    client, base, scripted, _, _ = served
    with pytest.raises(openai.BadRequestError, match=f"exceed the engine's max_context {MAX_CONTEXT}"):
        client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=MAX_CONTEXT)
    scripted.script = [[104, END_OF_MSG]]
    msgs = [{"role": "user", "content": "hi"}]
    sid = client.chat.completions.create(model="k3_nano", messages=msgs, max_tokens=3).session_id
    msgs += [{"role": "assistant", "content": "h"}, {"role": "user", "content": "x" * 150}]
    with pytest.raises(openai.BadRequestError, match=f"ended truncated.*GET /v1/sessions/{sid}"):
        client.chat.completions.create(model="k3_nano", messages=msgs, extra_body={"session_id": sid})
    rec = record(base, sid)
    assert rec["truncated"] is True and rec["end"] == "truncated" and len(rec["ids"]) == 22
    with pytest.raises(openai.NotFoundError, match="has ended"):
        client.chat.completions.create(model="k3_nano", messages=msgs[:1], extra_body={"session_id": sid})


def test_bad_bodies_are_refused_without_a_crash(served):
    client, base, _, _, _ = served
    r = httpx.post(f"{base}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    assert httpx.post(f"{base}/chat/completions", json=[1, 2]).status_code == 400
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": "x" * (MAX_BODY + 1)}])
    assert e.value.status_code == 413
    big = httpx.post(f"{base}/completions", content=(b"x" * 1024 for _ in range(MAX_BODY // 1024 + 1)))  # chunked
    assert big.status_code == 413
    with pytest.raises(openai.BadRequestError, match=r"unknown or unsupported field\(s\) \['frequency_penalty'\]"):
        client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": "hi"}],
                                       frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="temperature: must be a number"):
        client.chat.completions.create(model="k3_nano", messages=[{"role": "user", "content": "hi"}],
                                       temperature=-1)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="k3_nano", messages=[{"role": "robot", "content": "hi"}])
    assert [m.id for m in client.models.list().data] == ["k3_nano"]  # still serving


@pytest.mark.slow  # peft's import, which writing and reading an adapter directory need: seconds
def test_adapter_dir_is_served(served, tmp_path):
    """adapter=DIR (a PEFT directory as training saves it): the server generates with it, as the engine does with
    its adapter, and not as the base does."""
    import torch
    from fastapi.testclient import TestClient

    from miles_k3.model.adapter import save_adapter
    from miles_k3.model.build import build_model
    from miles_k3.model.lora import LoRAConfig, lora_parameters

    _, _, _, base_engine, _ = served
    overrides = ["device=cpu", f"engine.max_context={MAX_CONTEXT}", "engine.memory_budget_bytes=8388608"]
    cfg = compose_config("serve", overrides)
    lora = LoRAConfig(rank=4, alpha=8.0)
    model = build_model(cfg.model, torch.device("cpu"), torch.float32, lora=lora)
    with torch.no_grad():
        for t in lora_parameters(model).values():
            t.normal_(0, 0.5)
    save_adapter(model, lora, tmp_path / "adapter", base_model_name_or_path="k3_nano")
    cfg = compose_config("serve", [*overrides, f"adapter={tmp_path}/adapter"])
    engine, tokenizer, name = eval_engine(cfg)
    assert name == "policy"
    prompt = list(b"15-43-75=")
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    try:
        with TestClient(build_app(engine, tokenizer, cfg, name)) as c:
            r = c.post("/v1/completions", json={"model": "k3_nano", "prompt": prompt, "max_tokens": 8,
                                                "temperature": 0})
            assert r.status_code == 200, r.text
            ids = c.get(f"/v1/sessions/{r.json()['session_id']}").json()["ids"][len(prompt):]
        tuned = engine.generate(input_ids=[prompt], sampling_params=greedy, lora="policy")[0]["output_ids"]
    finally:
        engine.close()
    base = base_engine.generate(input_ids=[prompt], sampling_params=greedy)[0]["output_ids"]
    assert ids == tuned and ids != base


def test_a_template_that_refuses_and_a_body_nested_too_deep_are_400():
    from fastapi.testclient import TestClient

    from miles_k3.model.tokenizer import small_tokenizer

    tok = small_tokenizer(512)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with TestClient(build_app(ScriptedEngine(None), tok, compose_config("serve"))) as c:
        r = c.post("/v1/chat/completions", json={"model": "k3_nano", "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]
        deep = c.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)
        assert deep.status_code == 400 and "not JSON" in deep.json()["error"]["message"]


def test_api_key_is_required_when_configured(monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("MILES_K3_TEST_KEY", "s3cret")
    cfg = compose_config("serve", ["api_key_env=MILES_K3_TEST_KEY"])
    with TestClient(build_app(ScriptedEngine(None), None, cfg)) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        ok = c.get("/v1/models", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and "s3cret" not in json.dumps(ok.json())


# ---- limits: integers, n, sessions, the event loop ---------------------------------------------------------------
def _app(overrides=(), script=lambda prompt: [33, END_OF_MSG], **kw):
    """A TestClient app over a scripted engine double (every reply "!") and the small byte tokenizer."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from miles_k3.model.tokenizer import small_tokenizer

    engine = ScriptedEngine(SimpleNamespace(max_context=MAX_CONTEXT, release_states=lambda ids: None))
    engine.script = script
    app = build_app(engine, small_tokenizer(512), compose_config("serve", list(overrides)), **kw)
    return TestClient(app), app.state.server


def test_an_integer_of_5000_digits_is_400_naming_where_it_is():
    """Python's int() refuses a 5,000-digit literal inside json.loads (a ValueError: it answered 500); the body is
    refused with 400 naming the field, and a 64-digit one still parses (and is refused by n's own check)."""
    c, _ = _app()
    with c:
        r = c.post("/v1/chat/completions", content=b'{"model": "k3_nano", "messages": [{"role": "user", "content": '
                   b'"hi"}], "n": ' + b"9" * 5000 + b"}", headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == ("n: an integer of 5000 digits; this server reads integers of up to 64 "
                                                "digits")
        r = c.post("/v1/completions", content=b'{"prompt": [1, 2, -' + b"1" * 5000 + b"]}")
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[2]: an integer of 5000 digits")
        r = c.post("/v1/completions", json={"prompt": [1, 2], "n": 10**63})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"n: {10**63} exceeds max_n=64")


def test_n_is_capped_and_new_sessions_evict_only_idle_ones_never_a_live_one():
    """max_sessions=4, max_n=3, session_idle_s=60, on a clock the test sets. A starts a session at t=0, B three at
    t=1: 4 kept. C asks for three at t=2: every session is live (used in the last 60 s), so C gets 429 and nothing
    is evicted; A goes on at t=3. At t=62 B's three (last used t=1) have been idle 61 s, A's (t=3) 59 s: C's three
    evict B's, and A goes on. At t=200 all are idle; one new session evicts the least recently used: C's first
    (t=62; A was used at t=63). n=4 is past max_n: 400."""
    c, server = _app(["max_sessions=4", "max_n=3", "session_idle_s=60"])
    now = [0.0]
    server.sessions.clock = lambda: now[0]

    def start(n):
        return c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "n": n})

    def go_on(sid):
        return c.post("/v1/completions", json={"prompt": [3], "max_tokens": 2, "session_id": sid})

    with c:
        r = start(4)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("n: 4 exceeds max_n=3")
        a = start(1).json()["session_id"]
        now[0] = 1
        b = [ch["session_id"] for ch in start(3).json()["choices"]]
        now[0] = 2
        r = start(3)
        assert r.status_code == 429, r.text
        msg = r.json()["error"]["message"]
        assert msg.startswith("max_sessions=4: this request needs 3 new session(s), and only 0 of the 4 kept can be "
                              "evicted; a session is evicted only when idle (no turn running, unused for "
                              "session_idle_s=60 s)"), msg
        assert len(server.sessions) == 4
        now[0] = 3
        assert go_on(a).status_code == 200
        now[0] = 62
        cs = [ch["session_id"] for ch in start(3).json()["choices"]]
        assert [c.get(f"/v1/sessions/{s}").status_code for s in b] == [404] * 3
        now[0] = 63
        assert go_on(a).status_code == 200
        now[0] = 200
        assert start(1).status_code == 200
        assert [c.get(f"/v1/sessions/{s}").status_code for s in cs] == [404, 200, 200]
        assert c.get(f"/v1/sessions/{a}").json()["ids"] == [1, 2, 33, END_OF_MSG, 3, 33, END_OF_MSG] + [
            3, 33, END_OF_MSG]
    with pytest.raises(ConfigFieldError, match="max_n: 5 exceeds max_sessions=4"):
        compose_config("serve", ["max_sessions=4", "max_n=5"])


def test_tokenising_a_prompt_leaves_the_event_loop_serving(served, monkeypatch):
    """While a prompt is tokenised (held here by an event, as a very large prompt would hold it) the server answers
    other requests: tokenising runs on its own thread, not on the event loop."""
    from miles_k3.rollout.server import endpoints

    client, _, scripted, _, _ = served
    scripted.script = [[50, EOS]]
    gate, threads, real = threading.Event(), [], endpoints.encode

    def held_encode(tokenizer, text):
        threads.append(threading.current_thread().name)
        gate.wait(timeout=30)
        return real(tokenizer, text)

    monkeypatch.setattr(endpoints, "encode", held_encode)
    with cf.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(client.completions.create, model="k3_nano", prompt="1+1=", max_tokens=2)
        deadline = time.time() + 20
        while not threads and time.time() < deadline:
            time.sleep(0.01)
        assert threads == ["serve-tokenize_0"]
        t0 = time.time()
        assert [m.id for m in client.models.list().data] == ["k3_nano"]  # answered while the prompt is held
        assert time.time() - t0 < 10 and not reply.done()
        gate.set()
        assert reply.result().choices[0].text == "2"


def test_the_session_keeps_the_unfiltered_logprobs_of_a_filtered_turn(served):
    """top_k=1 keeps one token, so the engine samples the argmax and its filtered log-prob is log 1 = 0; the
    unfiltered one, log-softmax of the logits at temperature 1, is what greedy decoding reports for the same token.
    The session's record keeps both, the turn marked filtered."""
    client, base, _, engine, _ = served
    prompt = list(b"15-43-75=")
    r = client.completions.create(model="k3_nano", prompt=prompt, max_tokens=6, seed=3, extra_body={"top_k": 1})
    greedy = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 6, "temperature": 0.0})[0]
    rec = record(base, r.session_id)
    out = rec["ids"][len(prompt):]
    assert out == greedy["output_ids"] and rec["turns"][0]["filtered"] is True
    assert rec["logprobs"] == [0.0] * len(rec["ids"])
    full = [lp for lp, _ in greedy["meta_info"]["output_token_logprobs"]]
    assert all(lp < 0 for lp in full)
    assert rec["unfiltered_logprobs"][:len(prompt)] == [0.0] * len(prompt)
    assert rec["unfiltered_logprobs"][len(prompt):] == pytest.approx(full, abs=1e-5)


def test_chat_formats_render_the_messages():
    """chat_format: role_lines, the tokenizer's template, or a prompt template applied to each user message (other
    messages as their text); auto without a chat template is role_lines."""
    from miles_k3.model.tokenizer import small_tokenizer

    tok = small_tokenizer(512)
    msgs = [{"role": "user", "content": "15 - 43 - 75"}, {"role": "assistant", "content": "-103"},
            {"role": "user", "content": "12+5"}]
    assert render_messages(tok, msgs, "equation") == "15-43-75=-10312+5="
    assert render_messages(tok, msgs[:1], "plain") == "15 - 43 - 75"
    assert render_messages(tok, msgs[:1], "role_lines") == render_messages(tok, msgs[:1]) == \
        "user: 15 - 43 - 75\nassistant: "
    with pytest.raises(ServerConfigError, match="^chat_format: tokenizer needs a tokenizer with a chat template"):
        build_app(ScriptedEngine(None), tok, compose_config("serve", ["chat_format=tokenizer"]))
    with pytest.raises(ConfigFieldError, match="^chat_format: 'lines' is not one of auto, tokenizer, role_lines, "):
        compose_config("serve", ["chat_format=lines"])


def test_auto_chat_format_is_the_template_the_model_was_trained_with(tmp_path):
    """auto: the shipped chain_sum base's recipe (equation), an adapter's run config beside it (rollout.template),
    role_lines for the multi-turn guess base, an adapter from elsewhere or a random init; the tokenizer's own chat
    template first; an explicit chat_format as given."""
    from trained_run_helpers import train_yaml

    from miles_k3.model.tokenizer import small_tokenizer
    from miles_k3.serve import resolve_chat_format

    tok = small_tokenizer(512)
    step = tmp_path / "run/checkpoints/step_00000001"
    (step / "adapter").mkdir(parents=True)
    (step / "config.yaml").write_text(train_yaml("steps=1", "rollout.template=plain"))
    (tmp_path / "elsewhere").mkdir()
    cases = {(): "equation", (f"adapter={step}/adapter",): "plain", ("model.path=builtin:k3_nano_guess",): "role_lines",
             (f"adapter={tmp_path}/elsewhere",): "role_lines", ("model=k3_tiny",): "role_lines",
             ("chat_format=boxed",): "boxed"}
    for overrides, want in cases.items():
        assert resolve_chat_format(compose_config("serve", list(overrides)), tok) == want, overrides
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert resolve_chat_format(compose_config("serve"), tok) == "tokenizer"


def test_the_shipped_base_answers_a_chat_request_with_an_integer():
    """Issue 57: as served by `python -m miles_k3.serve` (`serving_app`), the shipped base's chat reply to "15-43-75"
    is an integer; before, its chat form `user: ...\\nassistant: ` made it stop at once with ''."""
    from fastapi.testclient import TestClient

    from miles_k3.serve import serving_app

    app, engine = serving_app(compose_config("serve", ["device=cpu", "engine.memory_budget_bytes=8388608"]))
    try:
        with TestClient(app) as c:
            r = c.post("/v1/chat/completions", json={"model": "k3_nano", "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "15-43-75"}]})
            assert r.status_code == 200, r.text
            ids = c.get(f"/v1/sessions/{r.json()['session_id']}").json()["prompt_ids"]
    finally:
        engine.close()
    assert ids == list(b"15-43-75=")
    assert re.fullmatch(r"-?\d+", r.json()["choices"][0]["message"]["content"]), r.json()
