"""env=agent (`miles_k3.agent`): agent code written against the OpenAI client plays the rollouts over an in-process
server, on the shipped k3_nano base (CPU). The trainer's samples are the exact tokens the engine saw (checked against
the engine's own generate with the seeds the trainer derives, the agent's sampling fields replaced by the
rollout's), the agent's answer is what the reward grades, and an agent that raises, never calls, or runs over is
left out of the loss. Agents: tests/commands/agent_helpers.py."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from agent_helpers import ANSWERS, FOLLOW_UP
from repo_helpers import REPO

from miles_k3.agent import AgentRollouts, load_agent
from miles_k3.config import compose_config
from miles_k3.envs.env import EnvConfig
from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.rollout.api import EngineCapabilities
from miles_k3.serve import eval_engine
from miles_k3.trainer.rollouts import PromptStream, RolloutConfig, collect_rollouts

NEW = 6


@pytest.fixture(scope="module")
def served():
    cfg = compose_config("serve", ["device=cpu", "engine.max_context=160", "engine.memory_budget_bytes=8388608"])
    engine, tokenizer, _ = eval_engine(cfg)
    return engine, tokenizer


def _collect(served, agent: str, problems, timeout_s=60.0, group_size=2, **sampling):
    engine, tok = served
    env_cfg = EnvConfig(name="agent", agent=f"agent_helpers:{agent}", max_turns=2, step_timeout_s=timeout_s)
    env_cfg.validate()
    agents = AgentRollouts(load_agent(env_cfg.agent), engine, tok, env_cfg, None)
    graded = []

    def reward(responses, golds):
        graded.extend(responses)
        return [RewardResult(float(r.strip() == g), r.strip() == g, {}) for r, g in zip(responses, golds)]

    rcfg = RolloutConfig(prompts_per_step=len(problems), group_size=group_size, template="plain",
                         dynamic_sampling=False, max_new_tokens=NEW, **{"temperature": 1.0} | sampling)
    try:
        samples, metrics = collect_rollouts(engine, tok, PromptStream(problems, 0), reward, rcfg, None,
                                            env=(agents, env_cfg))
    finally:
        agents.close()
    return samples, metrics, graded, rcfg


def test_agent_episodes_are_the_engines_exact_tokens_graded_on_the_agents_answer(served):
    """Episode j of problem d: the trainer's seed s = seed * 1_000_003 + d * group_size, turn k samples with
    (s + j) * 1009 + k at the rollout's temperature and max_new_tokens (the agent asked for 5.0 and 99). Its sample
    is prompt (the fallback chat rendering of the problem) -> turn 1 -> the follow-up's rendering -> turn 2."""
    engine, tok = served
    problems = [Problem("a", "15-43=", "-28"), Problem("b", "2+3=", "5")]
    samples, metrics, graded, rcfg = _collect(served, "two_turns", problems)
    assert len(samples) == 4 and metrics["env/turns_mean"] == 2.0 and metrics["env/error_rate"] == 0.0
    follow = list(f"user: {FOLLOW_UP}\nassistant: ".encode())
    for k, s in enumerate(samples):
        d, j = divmod(k, 2)
        prompt = list(f"user: {problems[d].problem}\nassistant: ".encode())
        seed = (rcfg.seed * 1_000_003 + d * 2 + j) * 1009
        sp = {"max_new_tokens": NEW, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
        (one,) = engine.generate(input_ids=[prompt], sampling_params=sp | {"sampling_seed": seed})
        out1 = one["output_ids"]
        (two,) = engine.generate(input_ids=[prompt + out1 + follow], sampling_params=sp | {"sampling_seed": seed + 1})
        out2 = two["output_ids"]
        assert s.prompt_ids == prompt and s.response_ids == out1 + follow + out2
        assert s.loss_mask == [1] * len(out1) + [0] * len(follow) + [1] * len(out2)
        lps = [lp for lp, _ in one["meta_info"]["output_token_logprobs"] + two["meta_info"]["output_token_logprobs"]]
        got = [lp for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m]
        assert got == pytest.approx(lps, abs=1e-5)
        assert s.in_loss and s.token_versions == [0] * len(s.response_ids)
        assert graded[k] == tok.decode(out2[:-1] if out2[-1] in (257, 259) else out2)  # the agent's answer


def test_an_agent_that_raises_never_calls_or_runs_over_is_left_out_and_counted(served):
    problems = [Problem("a", "1+1=", "2")]
    for agent, rate, timeout in (("raises", "env/error_rate", 60.0), ("never_calls", "env/error_rate", 60.0),
                                 ("too_slow", "env/timeout_rate", 0.5)):
        samples, metrics, graded, _ = _collect(served, agent, problems, timeout_s=timeout)
        assert [s.in_loss for s in samples] == [False, False] and metrics[rate] == 1.0, agent
        assert graded == []
    samples, metrics, graded, _ = _collect(served, "returns_a_reward", problems)
    assert [s.reward for s in samples] == [0.25, 0.25] and graded == [] and metrics["env/turns_mean"] == 1.0


def test_the_loops_held_out_eval_plays_agent_episodes(tmp_path):
    """eval.every_n_steps with env=agent: the held-out problems are played by the agent code. The agent plays two
    turns and then answers from a table, right for 2+3= and wrong for 15-43=: avg@2 is 0.5, pass@2 0.5, two turns
    per episode, the graded text the agent's answer. At step 0 the adapter is a no-op, so problem i's episode j is
    the base engine's turns with seeds (eval.seed + 2i + j) * 1009 and + 1, at the eval's temperature and
    max_new_tokens, prompt -> turn 1 -> the follow-up -> turn 2."""
    from miles_k3.train import train

    rows = [{"id": "a", "question": "15-43=", "answer": "-28"}, {"id": "b", "question": "2+3=", "answer": "5"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_config("train", [
        "env.name=agent", "env.agent=agent_helpers:two_turns_then_answers", "env.max_turns=2", f"data.source={data}",
        "data.problem_field=null", f"eval.data.source={data}", "eval.data.problem_field=null",
        "eval.data.split=null", "steps=1", "eval.every_n_steps=1", "eval.samples=2",
        "eval.max_new_tokens=5", "eval.temperature=1.0", "eval.seed=7", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=5", "engine.max_context=96", f"run_dir={tmp_path}/run"])
    run = train(cfg, "")
    for step in (0, 1):
        summary = json.loads((tmp_path / f"run/eval/step_{step:06d}/summary.json").read_text())
        assert summary["avg@2"] == 0.5 and summary["pass@2"] == 0.5 and summary["turns_mean"] == 2.0, summary
    graded = [json.loads(x) for x in (tmp_path / "run/eval/step_000000/results.jsonl").read_text().splitlines()]
    wrong = ANSWERS["15-43="]
    assert [(r["id"], r["sample"], r["extracted"], r["score"]) for r in graded] == [
        ("a", 0, wrong, 0.0), ("a", 1, wrong, 0.0), ("b", 0, "5", 1.0), ("b", 1, "5", 1.0)]
    engine, tok = run.engine, run.tokenizer
    follow = list(f"user: {FOLLOW_UP}\nassistant: ".encode())
    sp = {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    for r in graded:
        i = "ab".index(r["id"])
        prompt = list(f"user: {rows[i]['question']}\nassistant: ".encode())
        seed = (7 + 2 * i + r["sample"]) * 1009
        (one,) = engine.generate(input_ids=[prompt], sampling_params=sp | {"sampling_seed": seed})
        (two,) = engine.generate(input_ids=[prompt + one["output_ids"] + follow],
                                 sampling_params=sp | {"sampling_seed": seed + 1})
        assert r["response"] == tok.decode(one["output_ids"] + follow + two["output_ids"], skip_special_tokens=False)


def test_agent_samples_carry_the_unfiltered_logprobs_the_loss_takes(served):
    """rollout.top_k=1 at temperature 1 keeps one token: the engine samples the argmax, its filtered log-prob is
    log 1 = 0 and its unfiltered one the log-softmax of the logits, which greedy decoding reports for the same token.
    So each turn of the two-turn agent is the greedy one, the sample's rollout_logprobs are 0 on its sampled tokens
    and its unfiltered_logprobs are greedy's log-probs (the server used to keep only the filtered ones), which pack
    gives the loss (old_logprobs=rollout, TIS)."""
    from miles_k3.trainer.batch import pack

    engine, _ = served
    problems = [Problem("a", "15-43=", "-28")]
    (s,), *_ = _collect(served, "two_turns", problems, group_size=1, top_k=1)
    prompt, follow = list(b"user: 15-43=\nassistant: "), list(f"user: {FOLLOW_UP}\nassistant: ".encode())
    greedy = {"max_new_tokens": NEW, "temperature": 0.0}
    (one,) = engine.generate(input_ids=[prompt], sampling_params=greedy)
    (two,) = engine.generate(input_ids=[prompt + one["output_ids"] + follow], sampling_params=greedy)
    assert s.response_ids == one["output_ids"] + follow + two["output_ids"]
    sampled = [k for k, m in enumerate(s.loss_mask) if m]
    full = [lp for lp, _ in one["meta_info"]["output_token_logprobs"] + two["meta_info"]["output_token_logprobs"]]
    assert [s.rollout_logprobs[k] for k in sampled] == [0.0] * len(full) and all(lp < 0 for lp in full)
    assert [s.unfiltered_logprobs[k] for k in sampled] == pytest.approx(full, abs=1e-5)
    batch = pack([s], 0, 512)
    p = len(s.prompt_ids)
    assert batch.rollout_logp_BT[0, p - 1:].tolist() == pytest.approx(s.unfiltered_logprobs, abs=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["env.name=agent"], "env.agent: env=agent needs env.agent=MODULE:FUNCTION"),
    (["env.agent=agent_helpers:two_turns"], "env.agent: env.agent is set but env=single runs no agent code"),
    (["env.name=agent", "env.agent=x:y", "eval.every_n_steps=0", "rollout.mode=partial",
      "trainer.loss.tis=token_truncate"], "rollout.mode=partial"),
    (["env.name=agent", "env.agent=x:y", "eval.every_n_steps=0", "trainer.routing_replay=true"],
     "env=agent: the server does not record routes"),
])
def test_agent_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(Exception, match=message):
        compose_config("train", overrides)


def test_agent_spec_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="give MODULE:FUNCTION"):
        load_agent("agent_helpers")
    with pytest.raises(ValueError, match="cannot import module 'no_such_agents'"):
        load_agent("no_such_agents:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_agent("agent_helpers:nope")


# ---- the in-training server: its key, its episodes' sessions --------------------------------------------------------
class HeldEngine:
    """An engine double: every reply is "!" [EOS]; while `hold` is clear a call waits for it (on the engine's
    worker thread), so a test can close an episode while its turn runs."""

    max_context = 96
    capabilities = EngineCapabilities()  # it only generates

    def __init__(self):
        self.hold, self.calls = __import__("threading").Event(), 0

    def generate(self, input_ids, sampling_params, n, return_logprob, lora):
        self.calls += 1
        self.hold.wait(timeout=30)
        meta = {"finish_reason": {"type": "stop", "matched": 257}, "weight_version": 0, "weight_versions": [0],
                "output_token_logprobs": [(-0.5, 33), (-0.25, 257)]}
        return [{"output_ids": [33, 257], "meta_info": meta} for _ in input_ids for _ in range(n)]

    def release_states(self, ids):
        pass


def test_the_in_training_server_needs_its_key_and_deletes_each_episodes_session_when_it_ends():
    """The /v1 endpoints need the run's key; an episode's URL needs none (its random id is its credential). An
    episode closed while its turn runs gives the record before that turn, and its session is deleted when the turn
    ends; one closed during its first turn leaves no session either (it used to stay forever)."""
    import asyncio

    from fastapi.testclient import TestClient

    from miles_k3.config import ServeConfig
    from miles_k3.model.tokenizer import small_tokenizer
    from miles_k3.serve import Server, build_app

    engine = HeldEngine()
    engine.hold.set()
    app = build_app(engine, small_tokenizer(512), ServeConfig(), api_key="run-key")
    server = app.state.server
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4, "seed": 0, "max_turns": 3}
    user = [{"role": "user", "content": "hi"}]
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"authorization": "Bearer run-key"}).status_code == 200
        assert c.post("/v1/chat/completions", json={"messages": user}).status_code == 401
        server.open_episode("e0", params)
        r = c.post("/episodes/e0/v1/chat/completions", json={"messages": user},
                   headers={"authorization": "Bearer unused"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "!"
        assert server.close_episode("e0")["ids"] == list(b"user: hi\nassistant: ") + [33, 257]
        assert len(server.sessions) == 0
        assert c.post("/episodes/e0/v1/chat/completions", json={"messages": user}).status_code == 404

    server = Server(engine, small_tokenizer(512), ServeConfig())  # the same logic, driven without HTTP

    async def close_during_turns():
        engine.hold.set()
        calls = engine.calls
        server.open_episode("e1", params)
        first = await server.episode_chat({"messages": user}, "e1")
        engine.hold.clear()
        more = [*user, first["choices"][0]["message"], {"role": "user", "content": "?"}]
        turn = asyncio.ensure_future(server.episode_chat({"messages": more}, "e1"))
        while engine.calls < calls + 2:  # e1's turn 2 holds the engine
            await asyncio.sleep(0.01)
        server.open_episode("e2", params)
        opening = asyncio.ensure_future(server.episode_chat({"messages": user}, "e2"))
        while not server.pending:  # e2's turn 1 waits for the engine
            await asyncio.sleep(0.01)
        rec = server.close_episode("e1")
        assert server.close_episode("e2") is None and len(rec["turns"]) == 1 and len(server.sessions) == 1
        engine.hold.set()
        await turn
        await opening
        return len(server.sessions)

    try:
        assert asyncio.run(close_during_turns()) == 0
    finally:
        engine.hold.set()
        server.worker.shutdown()
        server.tokenize_pool.shutdown()


def test_the_docs_env_agent_commands_compose():
    """`python -m miles_k3.train env=agent env.agent=...` as agents.md and serve.md write it composes (env=agent is
    a group file, recipes/env/agent.yaml; it failed with "Could not find 'env/agent'")."""
    import re
    import shlex

    docs = REPO / "docs/concepts"
    commands = [c for doc in ("agents.md", "serve.md")
                for c in re.findall(r"python -m miles_k3\.train (env=agent [^`\n#]*)", (docs / doc).read_text())]
    assert len(commands) >= 2, commands
    for line in commands:
        cfg = compose_config("train", [a for a in shlex.split(line) if a != "..."])
        assert cfg.env.name == "agent" and cfg.env.agent in ("my_agents:solve", "MODULE:FUNCTION"), line
        assert cfg.env.max_turns == 4


@pytest.mark.parametrize("env", [["env=single"], ["env=guess"], ["env=agent", "env.agent=my_agents:solve"]])
def test_the_filtered_logprobs_config_check_is_the_engines_in_every_env(env):
    """Under top-k the loss takes the engine's unfiltered log-probs (old_logprobs=rollout here): the native engine
    reports them and every env carries them into its samples (env=agent through the server's session record), so
    each env is accepted on it; SGLang reports only the filtered ones, refused in each env (env=agent refuses SGLang
    outright)."""
    from miles_k3.config import ConfigFieldError

    filtered = ["rollout.top_k=3", "trainer.old_logprobs=rollout"]
    compose_config("train", env + filtered)
    message = ("env=agent: the in-process OpenAI-compatible server runs over the native engine" if "env=agent" in env
               else "trainer.old_logprobs=rollout: with engine.backend=sglang and rollout.top_p=1.0 rollout.top_k=3")
    with pytest.raises(ConfigFieldError, match=message):
        compose_config("train", env + filtered + ["engine.backend=sglang", "model.hf_path=/ckpt/qwen3",
                                                  "env.keep_state=false"])
