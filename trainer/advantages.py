"""Group-relative advantages of outcome rewards (GRPO, Dr. GRPO, RLOO) and the zero-variance test of dynamic
sampling.

The rewards of one step arrive flat, grouped contiguously: rows g*G .. g*G+G-1 are the G completions of prompt g.
Every estimator subtracts a baseline built from the completion's own group; the scalar advantage is later
broadcast to every response token of the completion. Statistics are computed in float64. A group is
zero-variance when its rewards' sample std is <= ZERO_STD (1e-6, the dynamic-sampling threshold); such a group
carries no learning signal and gets an advantage of exactly 0 for every member under every estimator (the
subtraction alone can leave float noise such as 0.1 - mean([0.1] * 3) != 0). With G == 1 every group is
zero-variance: grpo and dr_grpo give 0 everywhere, and rloo, which needs other members, refuses it.

Legend: B completions (sequences), G group size, P = B/G groups (prompts).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
ZERO_STD = 1e-6  # a group whose float64 sample std is at most this is zero-variance


def group_advantages(rewards_B: Tensor, group_size: int, estimator: str, eps: float = 1e-6) -> Tensor:
    """Advantages [B] of rewards [B] grouped contiguously in groups of `group_size` (G).

    grpo: (r - group mean) / (group sample std (N - 1) + eps); dr_grpo: r - group mean; rloo: G / (G - 1) *
    (r - group mean), which equals r minus the mean of the other G - 1 rewards. Zero-variance groups (see
    `zero_variance_groups`) give exactly 0. G == 1 gives 0 for grpo and dr_grpo; rloo needs G >= 2.

    rewards_B: any real dtype (bool and integers allowed), finite. Returns the rewards' dtype when it is a
    floating one, else float32; computed in float64. Raises ValueError naming the argument on bad input.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator: '{estimator}' is not one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: must be finite and >= 0, got {eps}")
    r_PG = _grouped(rewards_B, group_size)  # [P, G] float64
    out_dtype = rewards_B.dtype if rewards_B.is_floating_point() else torch.float32
    if group_size == 1 and estimator == "rloo":
        raise ValueError("group_size: rloo needs >= 2 completions per prompt (a leave-one-out baseline), got 1")
    if group_size == 1 or r_PG.numel() == 0:
        return torch.zeros(rewards_B.shape, dtype=out_dtype, device=rewards_B.device)
    centred = r_PG - r_PG.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = centred / (r_PG.std(dim=1, keepdim=True) + eps)
    elif estimator == "dr_grpo":
        adv = centred
    else:
        adv = centred * (group_size / (group_size - 1))
    adv = torch.where(_zero_std(r_PG)[:, None], torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(out_dtype)


def zero_variance_groups(rewards_B: Tensor, group_size: int) -> Tensor:
    """Bool [P]: True where a group's float64 sample std (N - 1) is <= 1e-6, i.e. all its rewards are (nearly)
    equal. Dynamic sampling drops these groups; their mean is the `rollout/frac_zero_std` metric. A group of one
    (G == 1) is always zero-variance. Same validation as `group_advantages`."""
    return _zero_std(_grouped(rewards_B, group_size))


def _zero_std(r_PG: Tensor) -> Tensor:
    if r_PG.shape[1] == 1 or r_PG.shape[0] == 0:
        return torch.ones(r_PG.shape[0], dtype=torch.bool, device=r_PG.device)
    return r_PG.std(dim=1) <= ZERO_STD


def _grouped(rewards_B: Tensor, group_size: int) -> Tensor:
    """The validated rewards as float64 [P, G]."""
    if not isinstance(rewards_B, Tensor) or rewards_B.dim() != 1:
        shape = tuple(rewards_B.shape) if isinstance(rewards_B, Tensor) else type(rewards_B).__name__
        raise ValueError(f"rewards_B: must be a 1-D tensor [B], got {shape}")
    if rewards_B.is_complex():
        raise ValueError(f"rewards_B: must be real, got {rewards_B.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: must be an int >= 1, got {group_size!r}")
    b = rewards_B.shape[0]
    if b % group_size:
        raise ValueError(f"rewards_B: length {b} is not a multiple of group_size {group_size}")
    r_B = rewards_B.detach().to(torch.float64)
    bad = (~torch.isfinite(r_B)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"rewards_B: non-finite reward {r_B[i].item()} at index {i}")
    return r_B.reshape(b // group_size, group_size)
