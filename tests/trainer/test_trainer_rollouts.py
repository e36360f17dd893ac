"""A step's rollouts (`miles_k3.trainer.rollouts`): the resumable prompt stream, sampling seeds, rewards and
group advantages, dynamic sampling, overlong handling. The engine here is a scripted test double of
`RolloutEngine.generate` (not the engine), so every sample's content is known."""
import pytest

from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.model.tokenizer import small_tokenizer
from miles_k3.rollout.api import EngineCapabilities
from miles_k3.trainer.rollouts import (
    PromptStream,
    RolloutConfig,
    check_on_policy,
    collect_rollouts,
    overlong_penalty,
)

TOK = small_tokenizer(300)
PROBLEMS = [Problem(f"p{i}", f"problem number {i}", str(i)) for i in range(5)]


class Scripted:
    """Sample j of a prompt with seed s answers its gold when (s + j) % 2 == 0, else 999; problem 'p0' always
    answers 999 (a flat group); it stops by length when (s + j) % 3 == 0 (8 tokens), else after 4 tokens."""

    capabilities = EngineCapabilities()  # it only generates

    def __init__(self):
        self.seeds = []

    def generate(self, input_ids, sampling_params, n, return_logprob, lora, return_routed_experts=False):
        out = []
        for ids, sp in zip(input_ids, sampling_params):
            i = int(TOK.decode(ids).split("problem number ")[1].split()[0].rstrip("."))
            self.seeds.append((i, sp["sampling_seed"]))
            for j in range(n):
                s = sp["sampling_seed"] + j
                ans = str(i) if s % 2 == 0 and i != 0 else "999"
                toks = TOK.encode(f"\\boxed{{{ans}}}")
                trunc = s % 3 == 0
                out.append({"output_ids": toks, "meta_info": {
                    "finish_reason": {"type": "length" if trunc else "stop"}, "weight_version": 7,
                    "output_token_logprobs": [(-0.1 * (k + 1), t) for k, t in enumerate(toks)]}})
        return out


def exact_reward(responses, golds):
    return [RewardResult(float(r == f"\\boxed{{{g}}}"), r == f"\\boxed{{{g}}}", {}) for r, g in zip(responses, golds)]


def test_prompt_stream_is_seeded_reshuffled_per_epoch_and_resumable():
    a = PromptStream(PROBLEMS, seed=1)
    first = [p.id for _, p in a.take(5)]
    second = [p.id for _, p in a.take(5)]
    assert sorted(first) == sorted(second) == [p.id for p in PROBLEMS] and first != second
    b = PromptStream(PROBLEMS, seed=1)
    b.take(3)
    saved = b.state()
    rest = [(d, p.id) for d, p in b.take(6)]
    c = PromptStream(PROBLEMS, seed=1)
    c.load_state(saved)
    assert [(d, p.id) for d, p in c.take(6)] == rest and rest[0][0] == 3
    assert [p.id for _, p in PromptStream(PROBLEMS, seed=2).take(5)] != first


def test_samples_seeds_rewards_and_group_advantages():
    eng = Scripted()
    cfg = RolloutConfig(prompts_per_step=2, group_size=4, seed=0, template="plain", max_new_tokens=8)
    stream = PromptStream(PROBLEMS[1:], seed=0)
    samples, m = collect_rollouts(eng, TOK, stream, exact_reward, cfg, lora="policy")
    assert [s for _, s in eng.seeds] == [0, 4]  # seed * 1_000_003 + draw * group_size
    assert len(samples) == 8 and [s.group for s in samples] == [0] * 4 + [1] * 4
    # sample j of draw d has seed 4d + j: even -> correct -> rewards 1 0 1 0 in both groups (mean .5, std .57735)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0] * 2
    assert [round(s.advantage, 4) for s in samples[:4]] == [0.866, -0.866, 0.866, -0.866]
    assert samples[0].rollout_logprobs == pytest.approx([-0.1 * (k + 1) for k in range(len(samples[0].response_ids))])
    assert samples[0].weight_version == 7 and samples[0].truncated and not samples[1].truncated
    assert m["rollout/reward_mean"] == 0.5 and m["rollout/frac_zero_std"] == 0.0 and m["rollout/groups_kept"] == 2


def test_dynamic_sampling_drops_flat_groups_and_refills():
    eng = Scripted()
    problems = [PROBLEMS[0], PROBLEMS[1], PROBLEMS[0], PROBLEMS[2]]  # p0's group is always flat (reward 0)
    stream = PromptStream(problems, seed=0)
    stream._order = [0, 1, 2, 3]  # a known order: flat, ok, flat, ok
    cfg = RolloutConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, template="plain", max_new_tokens=8)
    samples, m = collect_rollouts(eng, TOK, stream, exact_reward, cfg, lora=None)
    # round 1: p0 (flat, dropped), p1 (kept); each later round draws the one missing prompt: p0 again (dropped),
    # then p2 (kept)
    assert [i for i, _ in eng.seeds] == [0, 1, 0, 2]
    assert {s.group for s in samples} == {0, 1} and len(samples) == 4
    assert m["rollout/groups_drawn"] == 4 and m["rollout/groups_kept"] == 2 and m["rollout/sampling_rounds"] == 3
    assert m["rollout/frac_zero_std"] == 0.5
    one_round = RolloutConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, max_sampling_rounds=1,
                              template="plain", max_new_tokens=8)
    stream = PromptStream(problems, seed=0)
    stream._order = [0, 2, 1, 3]
    samples, m = collect_rollouts(Scripted(), TOK, stream, exact_reward, one_round, lora=None)
    assert samples == [] and m["rollout/groups_kept"] == 0  # both flat, no rounds left: nothing to train on


class Lengths:
    """Each prompt's sample j is `lengths[j]` tokens of 'a' (a wrong answer) or, where `right[j]`, the gold
    followed by padding; it stops by length at max_new_tokens, else by eos."""

    capabilities = EngineCapabilities()  # it only generates

    def __init__(self, lengths, right, max_new_tokens, unfiltered=None):
        self.lengths, self.right, self.max_new, self.unfiltered = lengths, right, max_new_tokens, unfiltered

    def generate(self, input_ids, sampling_params, n, return_logprob, lora, return_routed_experts=False):
        out = []
        for ids in input_ids:
            gold = TOK.decode(ids).split("problem number ")[1].split()[0].rstrip(".")
            for j in range(n):
                text = (gold + " " if self.right[j] else "") + "a" * self.lengths[j]
                toks = TOK.encode(text)[:self.lengths[j]]
                meta = {"finish_reason": {"type": "length" if len(toks) >= self.max_new else "stop"},
                        "weight_version": 2, "weight_versions": [2],
                        "output_token_logprobs": [(-0.5, t) for t in toks]}
                if self.unfiltered is not None:
                    meta["output_token_logprobs_unfiltered"] = [self.unfiltered] * len(toks)
                out.append({"output_ids": toks, "meta_info": meta})
        return out


def prefix_reward(responses, golds):
    """1 when the response starts with its gold (the Lengths engine's right answers)."""
    return [RewardResult(float(r.startswith(g + " ")), r.startswith(g + " "), {}) for r, g in zip(responses, golds)]


def test_overlong_penalty_is_the_dapo_ramp_by_length():
    # L_max 100, L_buf 20: free up to 80 tokens, then (80 - L) / 20 down to -1 at 100
    assert overlong_penalty(80, 100, 20) == 0.0 and overlong_penalty(79, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == -0.5 and overlong_penalty(85, 100, 20) == -0.25
    assert overlong_penalty(100, 100, 20) == -1.0 and overlong_penalty(130, 100, 20) == -1.0
    assert overlong_penalty(99, 100, 0) == 0.0 and overlong_penalty(100, 100, 0) == -1.0


def test_overlong_penalty_applies_to_responses_that_end_on_their_own():
    # lengths 90 (ended by eos, inside the ramp), 70 (free), 100 (truncated), 95 (ended by eos)
    eng = Lengths([90, 70, 100, 95], [True, True, False, False], max_new_tokens=100)
    cfg = RolloutConfig(prompts_per_step=1, group_size=4, template="plain", max_new_tokens=100, overlong="penalty",
                        overlong_buffer=20)
    samples, _ = collect_rollouts(eng, TOK, PromptStream(PROBLEMS[3:4], 0), prefix_reward, cfg, None)
    assert [len(s.response_ids) for s in samples] == [90, 70, 100, 95]
    assert [s.truncated for s in samples] == [False, False, True, False]
    assert [s.reward for s in samples] == pytest.approx([1 - 0.5, 1.0, -1.0, -0.75])
    assert all(s.in_loss for s in samples)


def test_masked_overlong_samples_are_left_out_of_the_group_baseline():
    # rewards 1, 0 (ended on their own), 1, 0 (truncated at 10 tokens): with mask the baseline is over the first two
    eng = Lengths([6, 6, 10, 10], [True, False, True, False], max_new_tokens=10)
    cfg = RolloutConfig(prompts_per_step=1, group_size=4, template="plain", max_new_tokens=10, overlong="mask")
    samples, m = collect_rollouts(eng, TOK, PromptStream(PROBLEMS[3:4], 0), prefix_reward, cfg, None)
    assert [s.in_loss for s in samples] == [True, True, False, False]
    # grpo over [1, 0]: mean 0.5, sample std 0.70711 -> +-0.70711; masked members get 0
    assert [s.advantage for s in samples] == pytest.approx([0.70711, -0.70711, 0.0, 0.0], abs=1e-5)
    kept = RolloutConfig(prompts_per_step=1, group_size=4, template="plain", max_new_tokens=10)  # overlong=none
    samples, _ = collect_rollouts(eng, TOK, PromptStream(PROBLEMS[3:4], 0), prefix_reward, kept, None)
    assert [s.advantage for s in samples] == pytest.approx([0.86603, -0.86603, 0.86603, -0.86603], abs=1e-5)
    # only one member left in the loss: no baseline, a flat group that dynamic sampling drops
    one = Lengths([6, 10, 10, 10], [True, False, True, False], max_new_tokens=10)
    dyn = RolloutConfig(prompts_per_step=1, group_size=4, template="plain", max_new_tokens=10, overlong="mask",
                        dynamic_sampling=True, max_sampling_rounds=1)
    samples, m = collect_rollouts(one, TOK, PromptStream(PROBLEMS[3:4], 0), prefix_reward, dyn, None)
    assert samples == [] and m["rollout/frac_zero_std"] == 1.0


def test_grading_failures_and_accuracy_are_counted_and_warned(caplog):
    reasons = ["correct", "timeout after 5.0s", "grader error: worker process died (exit code -9)",
               "math-verify error on the gold: ParseError: x", "wrong answer 3 (gold 4)", "correct",
               "gold error: bad", "no final answer"]

    def graded(responses, golds):
        return [RewardResult(1.1 if r == "correct" else 0.1, r == "correct", {"grade": r}) for r in reasons]

    cfg = RolloutConfig(prompts_per_step=1, group_size=8, template="plain", max_new_tokens=10)
    eng = Lengths([3] * 8, [False] * 8, max_new_tokens=10)
    with caplog.at_level("WARNING", logger="miles_k3.train"):
        _, m = collect_rollouts(eng, TOK, PromptStream(PROBLEMS[3:4], 0), graded, cfg, None)
    assert m["rollout/grader_timeout_rate"] == 1 / 8 and m["rollout/grader_error_rate"] == 3 / 8
    assert m["rollout/accuracy"] == 2 / 8  # the reward (with a bonus of 0.1) is not the accuracy
    assert "50% of this step's samples were not graded" in caplog.text
    caplog.clear()
    reasons = ["correct"] * 8
    with caplog.at_level("WARNING", logger="miles_k3.train"):
        _, m = collect_rollouts(eng, TOK, PromptStream(PROBLEMS[3:4], 0), graded, cfg, None)
    assert m["rollout/grader_timeout_rate"] == m["rollout/grader_error_rate"] == 0 and m["rollout/accuracy"] == 1
    assert "not graded" not in caplog.text


def test_sample_versions_and_the_on_policy_check():
    eng = Lengths([3, 3], [True, False], max_new_tokens=10, unfiltered=-0.75)
    cfg = RolloutConfig(prompts_per_step=1, group_size=2, template="plain", max_new_tokens=10)
    samples, m = collect_rollouts(eng, TOK, PromptStream(PROBLEMS[3:4], 0), prefix_reward, cfg, None)
    assert (samples[0].weight_version, samples[0].weight_version_max) == (2, 2)
    assert m["rollout/logprob_filter_gap"] == pytest.approx(0.25)  # filtered -0.5 vs unfiltered -0.75
    check_on_policy(samples, 2)
    with pytest.raises(RuntimeError, match="sample 0 was drawn with weight versions 2..2, the trainer's adapter is "
                                           "version 3"):
        check_on_policy(samples, 3)
    samples[1].weight_version = 1  # a push landed mid-sample: its oldest token is of version 1
    with pytest.raises(RuntimeError, match="sample 1 was drawn with weight versions 1..2"):
        check_on_policy(samples, 2)


def test_real_aime_reward_through_the_pool():
    from miles_k3.evals.rewards import RewardConfig, build_reward

    reward = build_reward(RewardConfig(name="aime"))
    try:
        cfg = RolloutConfig(prompts_per_step=1, group_size=2, template="plain", max_new_tokens=8)
        samples, _ = collect_rollouts(Scripted(), TOK, PromptStream(PROBLEMS[2:3], 0), reward, cfg, None)
    finally:
        reward.close()
    assert [s.reward for s in samples] == [1.0, 0.0]


@pytest.mark.parametrize("override, field", [({"group_size": 0}, "group_size"), ({"advantage": "ppo"}, "advantage"),
                                             ({"overlong": "cut"}, "overlong"), ({"template": "x"}, "template"),
                                             ({"advantage": "rloo", "group_size": 1}, "group_size"),
                                             ({"group_size": 1}, "group_size"),  # grpo: no signal either
                                             ({"overlong_buffer": 512}, "overlong_buffer")])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        RolloutConfig(**override).validate()
