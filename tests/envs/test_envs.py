"""Multi-turn episodes (`miles_k3.envs.env`, `miles_k3.trainer.episodes`) through `collect_rollouts`, with a
scripted engine (a test double of `RolloutEngine.generate`: each call's outputs are scripted, so every token is
known) and a tokenizer whose text round trip changes token ids ("a" "b" sampled as two tokens re-tokenise as one
"ab"): the trainer's batch holds the tokens the engine saw, observations masked out of the loss."""
import threading
import time

import pytest
import torch
from repo_helpers import REPO

from miles_k3.envs.env import EnvConfig, Environment, StepResult, build_env, register_env
from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.rollout.api import EngineCapabilities
from miles_k3.trainer.batch import pack
from miles_k3.trainer.rollouts import PromptStream, RolloutConfig, collect_rollouts


class MergeTok:
    """Characters are ids 10 + ord(c) - ord(' ') ... except that "ab" encodes as one token, AB; decode is exact."""

    AB, EOS = 3, 2
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(self.AB)
                i += 2
            else:
                out.append(100 + ord(text[i]))
                i += 1
        return out

    def decode(self, ids, skip_special_tokens=False):
        return "".join("ab" if t == self.AB else "" if t == self.EOS else chr(t - 100) for t in ids)


TOK = MergeTok()
BASE = REPO / "miles_k3/model/bases/k3_nano_chain_sum"  # a checkpoint directory
A, B = 100 + ord("a"), 100 + ord("b")


class Engine:
    """Answers call k's request r with `script[k][r]` (token ids + EOS); log-prob -0.5 per token; weight version 4;
    routes [P + R - 1, 1, 1] holding 10 * (call + 1) when asked. `cut`: an answer longer than the request's
    max_new_tokens is cut there, finish reason "length" (as the engine does)."""

    max_context = 256
    capabilities = EngineCapabilities()  # it only generates: every turn is prefilled whole

    def __init__(self, script, cut=False):
        self.script, self.calls, self.cut = script, [], cut

    def generate(self, input_ids, sampling_params=None, n=1, return_logprob=True, lora=None,
                 return_routed_experts=False):
        k = len(self.calls)
        self.calls.append([list(x) for x in input_ids])
        outs = []
        for i, ids in enumerate(input_ids):
            for j in range(n):
                toks = list(self.script[k][i * n + j]) + [TOK.EOS]
                cap = sampling_params[i]["max_new_tokens"] if self.cut else len(toks)
                finish = {"type": "stop", "matched": TOK.EOS} if len(toks) <= cap else {"type": "length", "length": cap}
                toks = toks[:cap]
                meta = {"finish_reason": finish, "weight_version": 4,
                        "weight_versions": [4], "output_token_logprobs": [(-0.5, t) for t in toks],
                        "output_token_weight_versions": [4] * len(toks)}
                if return_routed_experts:
                    meta["routed_experts"] = torch.full((len(ids) + len(toks) - 1, 1, 1), 10 * (k + 1),
                                                        dtype=torch.int16)
                outs.append({"output_ids": toks, "meta_info": meta})
        return outs


def _digits(s):
    return [100 + ord(c) for c in s]


def _run(env_cfg, script, problems, reward=None, group_size=1, routes=False, cut=False, **cfg):
    engine = Engine(script, cut)
    rcfg = RolloutConfig(prompts_per_step=len(problems), group_size=group_size, template="plain",
                         dynamic_sampling=False, max_new_tokens=8, **cfg)
    reward = reward or (lambda rs, gs: [RewardResult(float(r == g), r == g, {}) for r, g in zip(rs, gs)])
    samples, m = collect_rollouts(engine, TOK, PromptStream(problems, 0), reward, rcfg, "policy", routes=routes,
                                  env=(build_env(env_cfg), env_cfg))
    return samples, m, engine


def test_guess_episode_keeps_the_sampled_tokens_masks_observations_and_scores_the_find():
    """Secret 7: turns "ab3" (sampled as a, b, 3: re-tokenised it would be AB, 3), "9", "7". Observations
    " higher\\n" and " lower\\n" come back as ids; the third turn finds it: reward 1, 3 turns."""
    script = [[[A, B] + _digits("3")], [_digits("9")], [_digits("7")]]
    samples, m, engine = _run(EnvConfig(name="guess", max_turns=6), script, [Problem("g", "guess:", "7")])
    s = samples[0]
    e = TOK.EOS
    higher, lower = TOK.encode(" higher\n"), TOK.encode(" lower\n")
    want = [A, B, *_digits("3"), e, *higher, *_digits("9"), e, *lower, *_digits("7"), e]
    assert s.prompt_ids == TOK.encode("guess:") and s.response_ids == want
    assert s.loss_mask == [1] * 4 + [0] * len(higher) + [1] * 2 + [0] * len(lower) + [1] * 2
    assert s.reward == 1.0 and s.in_loss
    # the second call's prompt is the first turn's tokens as sampled (A, B), not re-tokenised (AB)
    assert engine.calls[1] == [s.prompt_ids + want[:4 + len(higher)]]
    assert TOK.encode(TOK.decode([A, B])) == [TOK.AB]  # the round trip that would have changed them
    assert s.rollout_logprobs == [-0.5] * 4 + [0.0] * len(higher) + [-0.5] * 2 + [0.0] * len(lower) + [-0.5] * 2
    assert s.token_versions == [4] * len(want)
    batch = pack(samples, 0, 400)
    p = len(s.prompt_ids)
    assert batch.mask_BT[0, p - 1:].tolist() == [float(x) for x in s.loss_mask]
    assert batch.targets_BT[0, p - 1:].tolist() == want
    assert s.num_loss_tokens == 8 == batch.num_tokens  # the loss's token normaliser: the policy's tokens only
    assert m["env/turns_mean"] == 3.0 and m["env/error_rate"] == 0.0 and m["rollout/reward_mean"] == 1.0


def test_guess_runs_out_of_turns_and_an_unparsable_turn_is_an_observation():
    script = [[_digits("x")], [_digits("1")]]
    samples, m, engine = _run(EnvConfig(name="guess", max_turns=2), script, [Problem("g", "guess:", "7")])
    s = samples[0]
    assert s.response_ids == [*_digits("x"), TOK.EOS, *TOK.encode(" not a number\n"), *_digits("1"), TOK.EOS]
    assert s.reward == 0.0 and m["env/max_turns_rate"] == 1.0 and m["env/invalid"] == 1.0 and len(engine.calls) == 2


def test_tools_episode_answers_a_calculator_call_and_grades_the_final_turn():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    script = [[TOK.encode(call)], [_digits("42")]]
    samples, m, _ = _run(EnvConfig(name="tools", max_turns=3, tools=["calculator"]), script,
                         [Problem("t", "what is 6*7?", "42")])
    s = samples[0]
    obs = TOK.encode("\n<tool_response>42</tool_response>\n")
    assert s.response_ids == [*TOK.encode(call), TOK.EOS, *obs, *_digits("42"), TOK.EOS]
    assert s.reward == 1.0 and m["env/tool_calls"] == 1.0 and m["env/tool_call_errors"] == 0.0


@register_env("test_raises")
def _raises(cfg):
    class Env(Environment):
        def reset(self, problem, rng):
            return None

        def step(self, turn):
            raise KeyError("boom")
    return Env


@register_env("test_slow")
def _slow(cfg):
    class Env(Environment):
        def reset(self, problem, rng):
            return None

        def step(self, turn):
            time.sleep(1.0)
            return StepResult(done=True, reward=1.0)
    return Env


def test_an_environment_that_raises_or_hangs_ends_its_episode_not_the_run():
    samples, m, _ = _run(EnvConfig(name="test_raises", max_turns=3), [[_digits("1")]], [Problem("e", "q", "1")])
    assert not samples[0].in_loss and samples[0].reward == 0.0 and m["env/error_rate"] == 1.0
    t0 = time.perf_counter()
    samples, m, _ = _run(EnvConfig(name="test_slow", max_turns=3, step_timeout_s=0.1), [[_digits("1")]],
                         [Problem("e", "q", "1")])
    assert time.perf_counter() - t0 < 0.9  # the run did not wait for the step
    assert not samples[0].in_loss and m["env/timeout_rate"] == 1.0


def test_an_episode_at_the_context_limit_ends_truncated():
    """max_total_tokens 12: prompt "guess:" (6) + turn "1" + EOS (2) = 8; " higher\\n" (8) would pass 12."""
    samples, m, engine = _run(EnvConfig(name="guess", max_turns=4, max_total_tokens=12), [[_digits("1")]],
                              [Problem("g", "guess:", "7")])
    assert samples[0].truncated and samples[0].response_ids == [*_digits("1"), TOK.EOS]
    assert m["env/context_rate"] == 1.0 and len(engine.calls) == 1


def test_overlong_penalty_counts_each_policy_turn_against_the_per_turn_cap():
    """max_new_tokens 8, secret 7, a group of three (turn lengths include the stop token; observations never count):
    e0: "123" (4) -> lower, "9" (2) -> lower, "7" (2) found: longest turn 4 < 8, reward 1 + 0 = 1 (the whole
        response, 4 + 7 + 2 + 7 + 2 = 22 tokens, used to cost -1);
    e1: "1" (2) -> higher, "7xxxxxxxx" cut at 8 tokens "7xxxxxxx", found: reward 1 - 1 = 0;
    e2: "123456789" cut at 8 -> lower (a cut turn is answered as any other), "7" (2) found: 1 - 1 = 0.
    Both are truncated, so under mask they are left out; with overlong_buffer 4 a longest turn of 6 costs
    (8 - 4 - 6) / 4 = -0.5."""
    script = [[_digits("123"), _digits("1"), _digits("123456789")], [_digits("9"), _digits("7xxxxxxxx"), _digits("7")],
              [_digits("7")]]
    env = EnvConfig(name="guess", max_turns=4)
    samples, m, engine = _run(env, script, [Problem("g", "guess:", "7")], group_size=3, cut=True, overlong="penalty")
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0] and [s.truncated for s in samples] == [False, True, True]
    assert samples[2].response_ids[:8] == _digits("12345678") and len(engine.calls) == 3
    assert m["env/turns_mean"] == pytest.approx(7 / 3) and m["rollout/truncated_frac"] == pytest.approx(2 / 3)
    masked, _, _ = _run(env, script, [Problem("g", "guess:", "7")], group_size=3, cut=True, overlong="mask")
    assert [s.in_loss for s in masked] == [True, False, False] and [s.reward for s in masked] == [1.0] * 3
    ramp, _, _ = _run(env, [[_digits("12345")], [_digits("7")]], [Problem("g", "guess:", "7")], cut=True,
                      overlong="penalty", overlong_buffer=4)
    assert ramp[0].reward == 0.5 and not ramp[0].truncated


CANCELLED: list[str] = []


@register_env("test_sleepy")
def _sleepy(cfg):
    class Env(Environment):
        """A turn "s..." sleeps 0.5 s; "h..." hangs until cancelled (10 s at most); any other answers at once."""

        def reset(self, problem, rng):
            self.stop = threading.Event()

        def step(self, turn):
            if turn.startswith("s"):
                time.sleep(0.5)
            elif turn.startswith("h"):
                self.stop.wait(10.0)
            return StepResult(done=True, reward=1.0)

        def cancel(self):
            CANCELLED.append(threading.current_thread().name)
            self.stop.set()
    return Env


def test_the_steps_of_a_round_run_at_once_each_on_its_own_clock():
    """Six episodes whose steps each take 0.5 s, step_timeout_s 1: they run at once (about 0.5 s in all, not 3 s
    one after another), and none times out."""
    t0 = time.perf_counter()
    samples, m, _ = _run(EnvConfig(name="test_sleepy", max_turns=2, step_timeout_s=1.0), [[_digits("s")] * 6],
                         [Problem("e", "q", "1")], group_size=6)
    assert time.perf_counter() - t0 < 2.0
    assert m["env/timeout_rate"] == 0.0 and [s.reward for s in samples] == [1.0] * 6


def test_a_step_past_its_deadline_is_cancelled_and_holds_up_no_other_episode():
    """Five episodes whose steps hang and two that answer at once, step_timeout_s 0.3: each hanging step is
    cancelled (its environment's cancel() called, from the waiting thread) and its episode ends env_timeout, out of
    the loss; the two others are scored (with steps queued on a pool of 4 workers, the hung steps held every worker
    and timed them out too)."""
    CANCELLED.clear()
    samples, m, _ = _run(EnvConfig(name="test_sleepy", max_turns=2, step_timeout_s=0.3),
                         [[_digits("h")] * 5 + [_digits("a")] * 2], [Problem("e", "q", "1")], group_size=7)
    assert len(CANCELLED) == 5 and threading.current_thread().name in CANCELLED
    assert [s.in_loss for s in samples] == [False] * 5 + [True] * 2 and [s.reward for s in samples[5:]] == [1.0] * 2
    assert m["env/timeout_rate"] == pytest.approx(5 / 7)


def test_a_replayed_guess_env_remembers_the_guesses_without_stepping():
    """Secret 7: "5" -> higher. A fresh env told that answer (resume: `replay`) counts "5" again as a repeat."""
    played, resumed = build_env(EnvConfig(name="guess", max_turns=3))(), build_env(EnvConfig(name="guess"))()
    for env in (played, resumed):
        env.reset(Problem("g", "guess:", "7"), None)
    res = played.step("5")
    resumed.replay("5", res)
    assert res.observation == " higher\n" and resumed.step("5") == played.step("5") == StepResult(
        " higher\n", 0.0, info={"repeats": 1.0})


def test_routes_of_each_turn_come_from_that_turns_call():
    """Turn 1 (call 1, routes 10) covers positions P-1 .. P; turn 2 (call 2, routes 20) the rest; the final call's
    prefill gives the observation's positions."""
    script = [[_digits("1")], [_digits("7")]]
    samples, _, _ = _run(EnvConfig(name="guess", max_turns=3), script, [Problem("g", "guess:", "7")], routes=True)
    s = samples[0]
    p, higher = len(s.prompt_ids), len(TOK.encode(" higher\n"))
    r = s.routed_experts[:, 0, 0].tolist()
    assert len(r) == s.length - 1
    assert r[:p - 1] == [20] * (p - 1)  # the prompt: the final call's prefill
    assert r[p - 1:p + 1] == [10, 10]  # the positions that produced "1" and EOS: turn 1's call
    assert r[p + 1:] == [20] * (higher + 2)  # the observation's positions (its last produced "7") and 7's: call 2


def test_single_env_is_one_call_graded_by_the_reward():
    samples, m, engine = _run(EnvConfig(), [[_digits("5"), _digits("4")]], [Problem("s", "q", "5")], group_size=2)
    assert len(engine.calls) == 1 and [s.reward for s in samples] == [1.0, 0.0]
    assert samples[0].loss_mask == [] and not any(k.startswith("env/") for k in m)


@pytest.mark.parametrize("overrides, message", [
    (["env.name=nope"], "env.name: 'nope' is not a registered environment"),
    (["env.max_turns=3"], "env.max_turns: env=single has one turn"),
    (["env=tools", "env.tools=[]"], "env.tools: env=tools needs at least one tool"),
    (["env=tools", "env.tools=[shell]"], "env.tools: 'shell' is not a tool; known: calculator, python"),
    (["env.tools=[calculator]"], "env.tools: env.tools is set but env=single calls no tools"),
    (["env=guess", "engine.backend=sglang", "model=k3_nano", f"model.path={BASE}"],
     "env.keep_state: keeping an episode's state in the engine between turns needs engine.backend=native"),
])
def test_env_settings_that_cannot_work_are_refused(overrides, message):
    from miles_k3.config import compose_config

    with pytest.raises(Exception, match=message):
        compose_config("train", overrides)
