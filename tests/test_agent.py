"""env=agent (`miles_k3.agent`): agent code written against the OpenAI client plays the rollouts over an in-process
server, on the shipped k3_nano base (CPU). The trainer's samples are the exact tokens the engine saw (checked against
the engine's own generate with the seeds the trainer derives, the agent's sampling fields replaced by the
rollout's), the agent's answer is what the reward grades, and an agent that raises, never calls, or runs over is
left out of the loss. Agents: tests/agent_helpers.py."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from agent_helpers import ANSWERS, FOLLOW_UP

from miles_k3.agent import AgentRollouts, load_agent
from miles_k3.config import compose_config
from miles_k3.envs.env import EnvConfig
from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.serve import eval_engine
from miles_k3.trainer.rollouts import PromptStream, RolloutConfig, collect_rollouts

NEW = 6


@pytest.fixture(scope="module")
def served():
    cfg = compose_config("serve", ["device=cpu", "engine.max_context=160", "engine.memory_budget_bytes=8388608"])
    engine, tokenizer, _ = eval_engine(cfg)
    return engine, tokenizer


def _collect(served, agent: str, problems, timeout_s=60.0, group_size=2):
    engine, tok = served
    env_cfg = EnvConfig(name="agent", agent=f"agent_helpers:{agent}", max_turns=2, step_timeout_s=timeout_s)
    env_cfg.validate()
    agents = AgentRollouts(load_agent(env_cfg.agent), engine, tok, env_cfg, None)
    graded = []

    def reward(responses, golds):
        graded.extend(responses)
        return [RewardResult(float(r.strip() == g), r.strip() == g, {}) for r, g in zip(responses, golds)]

    rcfg = RolloutConfig(prompts_per_step=len(problems), group_size=group_size, template="plain",
                         dynamic_sampling=False, max_new_tokens=NEW, temperature=1.0)
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
