"""A step's rollouts (`miles_k3.trainer.rollouts`): the resumable prompt stream, sampling seeds, rewards and
group advantages, dynamic sampling, overlong handling. The engine here is a scripted test double of
`RolloutEngine.generate` (not the engine), so every sample's content is known."""
import pytest

from miles_k3.evals.datasets import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.tokenizer import small_tokenizer
from miles_k3.trainer.rollouts import PromptStream, RolloutConfig, collect_rollouts

TOK = small_tokenizer(300)
PROBLEMS = [Problem(f"p{i}", f"problem number {i}", str(i)) for i in range(5)]


class Scripted:
    """Sample j of a prompt with seed s answers its gold when (s + j) % 2 == 0, else 999; problem 'p0' always
    answers 999 (a flat group); it stops by length when (s + j) % 3 == 0 (8 tokens), else after 4 tokens."""

    def __init__(self):
        self.seeds = []

    def generate(self, input_ids, sampling_params, n, return_logprob, lora):
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


@pytest.mark.parametrize("mode", ["none", "mask", "penalty"])
def test_overlong_modes(mode):
    cfg = RolloutConfig(prompts_per_step=1, group_size=4, template="plain", max_new_tokens=8, overlong=mode,
                        overlong_buffer=4 if mode == "penalty" else 0)
    samples, _ = collect_rollouts(Scripted(), TOK, PromptStream(PROBLEMS[3:4], 0), exact_reward, cfg, None)
    for s in samples:
        base = 1.0 if s.response_ids == TOK.encode("\\boxed{3}") else 0.0
        n = len(s.response_ids)  # 9 tokens "\boxed{3}" / 11 "\boxed{999}"; free = 8 - 4 = 4 -> penalty -1 (clamped)
        want = base + (max(-1.0, (4 - n) / 4) if (mode == "penalty" and s.truncated) else 0.0)
        assert s.reward == pytest.approx(want)
        assert s.in_loss == (not (mode == "mask" and s.truncated))


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
                                             ({"overlong_buffer": 512}, "overlong_buffer")])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        RolloutConfig(**override).validate()
