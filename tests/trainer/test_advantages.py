"""Group-relative advantages and the zero-variance test (`miles_k3.trainer.advantages`), against hand-computed
values."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_k3.trainer.advantages import ADVANTAGE_ESTIMATORS, group_advantages, zero_variance_groups

ONE_OF_EIGHT = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])


def test_grpo_one_correct_of_eight():
    # mean = 1/8 = 0.125; deviations +0.875 (x1), -0.125 (x7); sum of squares 0.765625 + 7 * 0.015625 = 0.875;
    # unbiased var 0.875 / 7 = 0.125, std sqrt(0.125) = 0.35355339; + eps 1e-6 -> 0.35355439
    # A_correct = 0.875 / 0.35355439 = 2.4748667; A_wrong = -0.125 / 0.35355439 = -0.3535524
    adv = group_advantages(ONE_OF_EIGHT, 8, "grpo")
    assert adv.dtype == torch.float32
    assert adv[0].item() == pytest.approx(2.4748667, abs=1e-6)
    assert adv[1:].tolist() == pytest.approx([-0.3535524] * 7, abs=1e-6)
    # eps = 0: exactly 0.875 / sqrt(0.125) = 2.4748737 and -0.125 / sqrt(0.125) = -0.3535534
    adv0 = group_advantages(ONE_OF_EIGHT, 8, "grpo", eps=0.0)
    assert adv0[0].item() == pytest.approx(2.4748737, abs=1e-6)
    assert adv0[1].item() == pytest.approx(-0.3535534, abs=1e-6)


def test_dr_grpo_and_rloo_one_correct_of_eight():
    # dr_grpo: r - 0.125
    assert group_advantages(ONE_OF_EIGHT, 8, "dr_grpo").tolist() == pytest.approx([0.875] + [-0.125] * 7)
    # rloo: 8/7 * 0.875 = 1.0 (= 1 - mean of seven zeros); 8/7 * -0.125 = -1/7 (= 0 - mean(1, 0 x6))
    assert group_advantages(ONE_OF_EIGHT, 8, "rloo").tolist() == pytest.approx([1.0] + [-1 / 7] * 7, abs=1e-7)


def test_groups_are_contiguous_and_zero_variance_groups_give_exact_zero():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.1, 0.1, 0.1, 0.1])
    # group 0 = [1, 0, 1, 0.5]: mean 0.625; deviations .375 -.625 .375 -.125; squares sum
    # .140625 + .390625 + .140625 + .015625 = .6875; var .6875 / 3 = .22916667; std .47871355 (+1e-6: .47871455)
    # grpo: .375 / .47871455 = .78334783; -.625 / .47871455 = -1.30557972; -.125 / .47871455 = -.26111594
    # rloo: 4/3 * dev = .5, -.8333333, .5, -.1666667 (e.g. r0: 1 - mean(0, 1, .5) = .5)
    # group 1 = [0.1] * 4: 0.1 - mean can leave float noise; the group is zero-variance, so every estimator gives 0
    grpo = group_advantages(rewards, 4, "grpo")
    assert grpo[:4].tolist() == pytest.approx([0.78334783, -1.30557972, 0.78334783, -0.26111594], abs=1e-6)
    assert group_advantages(rewards, 4, "dr_grpo")[:4].tolist() == pytest.approx([0.375, -0.625, 0.375, -0.125])
    rloo = group_advantages(rewards, 4, "rloo")
    assert rloo[:4].tolist() == pytest.approx([0.5, -5 / 6, 0.5, -1 / 6], abs=1e-7)
    for est in ADVANTAGE_ESTIMATORS:
        assert group_advantages(rewards, 4, est)[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_near_equal_rewards_count_as_zero_variance_everywhere():
    # [0.3, 0.3 + 1e-7]: std = 1e-7 / sqrt(2) = 7.07e-8 <= 1e-6 -> zero-variance; grpo would otherwise give
    # +-5e-8 / (7.07e-8 + 1e-6) = +-0.0469, amplified noise. [0, 1e-5]: std 7.07e-6 > 1e-6 -> kept.
    rewards = torch.tensor([0.3, 0.3 + 1e-7, 0.0, 1e-5], dtype=torch.float64)
    assert zero_variance_groups(rewards, 2).tolist() == [True, False]
    adv = group_advantages(rewards, 2, "grpo")
    assert adv.dtype == torch.float64
    assert adv[:2].tolist() == [0.0, 0.0]
    # [0, 1e-5]: +-5e-6 / (7.0710678e-6 + 1e-6) = +-5 / 8.0710678 = +-0.6194967
    assert adv[2:].tolist() == pytest.approx([-0.6194967, 0.6194967], abs=1e-6)


def test_zero_variance_groups():
    # groups [1, 1] [0, 1] [0.5, 0.5]
    zv = zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2)
    assert zv.dtype == torch.bool and zv.tolist() == [True, False, True]
    assert zv.float().mean().item() == pytest.approx(2 / 3)  # rollout/frac_zero_std
    assert zero_variance_groups(torch.tensor([0.0, 1.0, 2.0]), 1).tolist() == [True, True, True]
    assert zero_variance_groups(torch.zeros(0), 4).tolist() == []


def test_group_of_one():
    r = torch.tensor([1.0, 0.0, 0.5])
    assert group_advantages(r, 1, "grpo").tolist() == [0.0, 0.0, 0.0]
    assert group_advantages(r, 1, "dr_grpo").tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"^group_size: rloo needs >= 2"):
        group_advantages(r, 1, "rloo")


def test_pair_and_integer_rewards():
    # [0, 1] as int64: mean .5, std sqrt(.5) = .70710678 (+1e-6 = .70710778); grpo +-.5 / .70710778 = +-.70710578
    adv = group_advantages(torch.tensor([0, 1]), 2, "grpo")
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([-0.70710578, 0.70710578], abs=1e-7)
    # bool rewards work too: rloo of [True, False] = [1 - 0, 0 - 1]
    assert group_advantages(torch.tensor([True, False]), 2, "rloo").tolist() == [1.0, -1.0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.zeros(6), 4, "grpo"), r"^rewards_B: length 6 is not a multiple of group_size 4"),
        ((torch.tensor([0.0, 1, 0, 1, 0, math.nan]), 2, "grpo"), r"^rewards_B: non-finite reward nan at index 5"),
        ((torch.tensor([0.0, math.inf]), 2, "dr_grpo"), r"^rewards_B: non-finite reward inf at index 1"),
        ((torch.zeros(2, 2), 2, "grpo"), r"^rewards_B: must be a 1-D tensor"),
        ((torch.zeros(4), 0, "grpo"), r"^group_size: must be an int >= 1"),
        ((torch.zeros(4), True, "grpo"), r"^group_size: must be an int >= 1"),
        ((torch.zeros(4), 2, "ppo"), r"^estimator: 'ppo' is not one of grpo, dr_grpo, rloo"),
    ],
)
def test_validation(args, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(*args)


def test_validation_of_eps_and_zero_variance_input():
    with pytest.raises(ValueError, match=r"^eps: must be finite and >= 0"):
        group_advantages(torch.zeros(4), 2, "grpo", eps=-1e-6)
    with pytest.raises(ValueError, match=r"^rewards_B: length 3"):
        zero_variance_groups(torch.zeros(3), 2)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.lists(st.integers(0, 4), min_size=1, max_size=3))
def test_properties(g, seeds):
    """rloo is r minus the mean of the others; grpo and dr_grpo advantages sum to 0 in every group."""
    gen = torch.Generator().manual_seed(sum(seeds) * 31 + len(seeds))
    r = torch.randint(0, 3, (g * len(seeds),), generator=gen).double() / 2
    rloo = group_advantages(r, g, "rloo").view(-1, g)
    r_PG = r.view(-1, g)
    others = (r_PG.sum(1, keepdim=True) - r_PG) / (g - 1)
    assert torch.allclose(rloo, r_PG - others, atol=1e-12)
    for est in ("grpo", "dr_grpo"):
        assert torch.allclose(group_advantages(r, g, est).view(-1, g).sum(1), torch.zeros(len(seeds), dtype=torch.float64),
                              atol=1e-9)
