"""GRPO-family policy losses and chunked log-probs / entropy (`miles_k3.trainer.losses`), against hand-computed
values, gradients and the micro-batch contract."""
import dataclasses
import itertools
import math

import pytest
import torch

from miles_k3.trainer import losses
from miles_k3.trainer.logprobs import token_logprobs, token_logprobs_and_entropy
from miles_k3.trainer.losses import LossConfig, policy_loss


def token_entropy(logits, chunk_size=256):
    return token_logprobs_and_entropy(logits, torch.zeros(logits.shape[:2], dtype=torch.long), chunk_size)[1]

LN = math.log


def two_sequences(dtype=torch.float32, pad=math.nan):
    """The worked example. Row 0: 3 tokens, ratios 1, 1.5, 0.5, A = +1. Row 1: 2 tokens, ratios 0.5, 2.0,
    A = -2, then a padded position whose log-prob is `pad` (ignored). old log-probs are arbitrary."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[0.0, LN(1.5), LN(0.5)], [LN(0.5), LN(2.0), 0.0]], dtype=torch.float64)
    logp = old + log_ratio
    logp[1, 2] = pad
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=dtype)
    return logp.to(dtype).requires_grad_(), old.to(dtype), adv, mask

# Per-token losses of the example with eps_low 0.2, eps_high 0.28 (clip range [0.8, 1.28]):
#   row 0, A = +1: r 1 -> -1; r 1.5 -> -min(1.5, 1.28) = -1.28 (clipped, high side); r 0.5 -> -min(0.5, 0.8) = -0.5
#   row 1, A = -2: r 0.5 -> -min(-1, -1.6) = 1.6 (clipped, low side); r 2 -> -min(-4, -2.56) = 4.0 (not clipped)
# sum = -1 - 1.28 - 0.5 + 1.6 + 4.0 = 2.82 over 5 tokens; row sums -2.78 (3 tokens) and 5.6 (2 tokens)
# d L_it / d logp_it = -A_i r_it where unclipped, 0 where clipped: row 0: -1, 0, -0.5; row 1: 0, 4.0


@pytest.mark.parametrize(
    ("aggregation", "loss", "grad"),
    [
        # token_mean: 2.82 / 5 = 0.564; gradient / 5
        ("token_mean", 0.564, [[-0.2, 0.0, -0.1], [0.0, 0.8, 0.0]]),
        # seq_mean: (-2.78 / 3 + 5.6 / 2) / 2 = (-0.9266667 + 2.8) / 2 = 0.9366667; gradient / (n_i * 2)
        ("seq_mean", 0.9366667, [[-1 / 6, 0.0, -0.5 / 6], [0.0, 1.0, 0.0]]),
        # seq_sum_norm with seq_sum_norm_len 4: 2.82 / (2 * 4) = 0.3525; gradient / 8
        ("seq_sum_norm", 0.3525, [[-0.125, 0.0, -0.0625], [0.0, 0.5, 0.0]]),
    ],
)
def test_worked_example_per_aggregation(aggregation, loss, grad):
    logp, old, adv, mask = two_sequences()
    cfg = LossConfig(aggregation=aggregation, seq_sum_norm_len=4)
    value, metrics = policy_loss(logp, old, adv, mask, cfg)
    assert value.dtype == torch.float32 and value.shape == ()
    assert value.item() == pytest.approx(loss, rel=1e-6)
    value.backward()
    assert logp.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in grad]  # NaN pad: gradient 0, no NaN
    assert metrics["train/pg_loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["train/clip_frac"] == pytest.approx(2 / 5)  # (0, 1) and (1, 0)
    assert metrics["train/ratio_mean"] == pytest.approx(5.5 / 5, rel=1e-6)  # (1 + 1.5 + 0.5 + 0.5 + 2) / 5
    assert metrics["train/ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert set(metrics) == {"train/pg_loss", "train/clip_frac", "train/ratio_mean", "train/ratio_max"}
    assert all(isinstance(v, float) for v in metrics.values())


def test_float_mask_matches_bool_mask_and_defaults_are_dapo():
    assert (LossConfig().eps_low, LossConfig().eps_high, LossConfig().aggregation) == (0.2, 0.28, "token_mean")
    logp, old, adv, mask = two_sequences()
    a, _ = policy_loss(logp, old, adv, mask, LossConfig())
    b, _ = policy_loss(logp, old, adv, mask.float(), LossConfig())
    assert a.item() == b.item() == pytest.approx(0.564, rel=1e-6)


def test_clip_sides_for_positive_and_negative_advantages():
    # one token per row, num_tokens=1 so the loss is the plain sum of L and the gradient is d L / d logp
    ratio = torch.tensor([1.3, 1.25, 0.7, 0.75, 0.85, 1.3], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    logp = ratio.log()[:, None].clone().requires_grad_()
    old = torch.zeros(6, 1, dtype=torch.float64)
    mask = torch.ones(6, 1, dtype=torch.bool)
    loss, metrics = policy_loss(logp, old, adv, mask, LossConfig(), num_tokens=1)
    # A>0: 1.3 -> -1.28 (clipped above at 1 + eps_high); 1.25 -> -1.25 (inside); 0.7 -> -0.7 (no lower clip)
    # A<0: 0.75 -> 0.8 (clipped below at 1 - eps_low); 0.85 -> 0.85; 1.3 -> 1.3 (no upper clip for A<0)
    # sum = -1.28 - 1.25 - 0.7 + 0.8 + 0.85 + 1.3 = -0.28
    assert loss.item() == pytest.approx(-0.28, abs=1e-12)
    loss.backward()
    # gradient -A r where unclipped: 0, -1.25, -0.7, 0, 0.85, 1.3
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, -1.25, -0.7, 0.0, 0.85, 1.3], abs=1e-12)
    assert metrics["train/clip_frac"] == pytest.approx(2 / 6)
    # with eps_high 0.2 the bound is 1.2 and the 1.25 token is clipped too:
    # -1.2 - 1.2 - 0.7 + 0.8 + 0.85 + 1.3 = -0.15
    loss2, metrics2 = policy_loss(logp, old, adv, mask, LossConfig(eps_high=0.2), num_tokens=1)
    assert loss2.item() == pytest.approx(-0.15, abs=1e-12)
    assert metrics2["train/clip_frac"] == pytest.approx(3 / 6)


def test_dual_clip_caps_negative_advantage_tokens():
    logp, old, adv, mask = two_sequences()
    # c = 1.5: row 1 token 1 (A = -2, r = 2): min(4.0, -1.5 * -2 = 3.0) = 3.0, gradient 0; token 0: 1.6 < 3 kept.
    # row 0 (A > 0) untouched. token_mean (2.82 - 4.0 + 3.0) / 5 = 0.364
    loss, metrics = policy_loss(logp, old, adv, mask, LossConfig(dual_clip_c=1.5))
    assert loss.item() == pytest.approx(0.364, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx(r, abs=1e-6) for r in [[-0.2, 0, -0.1], [0, 0, 0]]]
    assert metrics["train/dual_clip_frac"] == pytest.approx(1 / 5)
    assert metrics["train/clip_frac"] == pytest.approx(2 / 5)
    # c = 3: cap 6 > 4, nothing changes
    loss3, metrics3 = policy_loss(logp, old, adv, mask, LossConfig(dual_clip_c=3.0))
    assert loss3.item() == pytest.approx(0.564, rel=1e-6) and metrics3["train/dual_clip_frac"] == 0.0


def test_gspo_sequence_ratio():
    logp, old, adv, mask = two_sequences()
    cfg = LossConfig(policy="sequence_clip", aggregation="seq_mean")
    # row 0: mean log ratio (0 + ln 1.5 + ln 0.5) / 3 = ln(0.75) / 3 -> s0 = 0.75 ** (1/3) = 0.9085603, inside
    #   [0.8, 1.28]: L = -0.9085603 on each of its 3 tokens. row 1: (ln 0.5 + ln 2) / 2 = 0 -> s1 = 1: L = 2.0
    # seq_mean: (-0.9085603 + 2.0) / 2 = 0.5457199
    loss, metrics = policy_loss(logp, old, adv, mask, cfg)
    assert loss.item() == pytest.approx(0.5457199, rel=1e-6)
    loss.backward()
    # d s_i / d logp_it = s_i / n_i: row 0: -(0.9085603 / 3) / 2 = -0.1514267 on every token (same for all);
    # row 1: -(-2) * (1 / 2) / 2 = 0.5 on both tokens; pad 0
    assert logp.grad.tolist() == [pytest.approx(r, abs=1e-6) for r in [[-0.1514267] * 3, [0.5, 0.5, 0.0]]]
    # token-weighted: (3 * 0.9085603 + 2 * 1) / 5 = 0.9451361; no clipping
    assert metrics["train/ratio_mean"] == pytest.approx(0.9451361, rel=1e-6)
    assert metrics["train/ratio_max"] == pytest.approx(1.0, rel=1e-6)
    assert metrics["train/clip_frac"] == 0.0
    # token_mean: (3 * -0.9085603 + 2 * 2) / 5 = 1.2743191 / 5 = 0.2548638
    tm, _ = policy_loss(logp, old, adv, mask, LossConfig(policy="sequence_clip"))
    assert tm.item() == pytest.approx(0.2548638, rel=1e-6)


def test_gspo_clipped_sequence_gets_no_gradient():
    old = torch.zeros(1, 3)
    logp = torch.full((1, 3), 0.3).requires_grad_()  # s = exp(0.3) = 1.3498588 > 1.28, A = +1
    loss, metrics = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), LossConfig(policy="sequence_clip"))
    assert loss.item() == pytest.approx(-1.28, rel=1e-6)  # -1.28 on each token, mean over 3
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0]]
    assert metrics["train/clip_frac"] == 1.0 and metrics["train/ratio_max"] == pytest.approx(1.3498588, rel=1e-6)


@pytest.mark.parametrize(
    ("estimator", "kl", "grad"),
    [
        # d = logp - ref = [0.5, -1.0]; gradients of 0.1 * mean(k) = 0.05 * k'(d)
        ("k1", -0.25, [0.05, 0.05]),  # k = d: (0.5 - 1) / 2; k' = 1
        ("k2", 0.3125, [0.025, -0.05]),  # k = d^2 / 2 = 0.125, 0.5 -> mean 0.3125; k' = d
        # k = e^-d + d - 1: e^-0.5 - 0.5 = 0.1065307, e - 2 = 0.7182818 -> mean 0.4124062;
        # k' = 1 - e^-d: 0.3934693, 1 - e = -1.7182818
        ("k3", 0.4124062, [0.05 * 0.3934693, 0.05 * -1.7182818]),
    ],
)
def test_kl_estimators(estimator, kl, grad):
    logp = torch.tensor([[0.5, -1.0]], requires_grad=True)
    ref = torch.zeros(1, 2)
    adv = torch.zeros(1)  # A = 0: the policy term is 0
    cfg = LossConfig(kl_coef=0.1, kl_estimator=estimator)
    loss, metrics = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2), cfg, ref_logp_BT=ref)
    assert loss.item() == pytest.approx(0.1 * kl, rel=1e-6)
    assert metrics["train/kl"] == pytest.approx(kl, rel=1e-6) and metrics["train/pg_loss"] == 0.0
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx(grad, rel=1e-5)


def test_kl_is_aggregated_like_the_policy_term_and_only_logged_without_a_coefficient():
    # d = [[0.5, x], [-1.0, -1.0]] with x masked; k1 seq_mean: (0.5 / 1 + -2 / 2) / 2 = -0.25
    logp = torch.tensor([[0.5, 7.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    cfg = LossConfig(kl_coef=1.0, kl_estimator="k1", aggregation="seq_mean")
    loss, metrics = policy_loss(logp, logp, torch.zeros(2), mask, cfg, ref_logp_BT=torch.zeros(2, 2))
    assert loss.item() == pytest.approx(-0.25)
    assert metrics["train/kl"] == pytest.approx(-0.5)  # token mean (0.5 - 1 - 1) / 3
    loss0, metrics0 = policy_loss(logp, logp, torch.zeros(2), mask, LossConfig(kl_estimator="k1"),
                                  ref_logp_BT=torch.zeros(2, 2))
    assert loss0.item() == 0.0 and metrics0["train/kl"] == pytest.approx(-0.5)


def test_entropy_bonus_sign():
    logp = torch.zeros(1, 2, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0]], requires_grad=True)
    cfg = LossConfig(entropy_coef=0.01)
    loss, metrics = policy_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), cfg, entropy_BT=entropy)
    # loss = 0 - 0.01 * (1 + 2) / 2 = -0.015; d loss / d entropy = -0.01 / 2: descending the loss raises entropy
    assert loss.item() == pytest.approx(-0.015)
    assert metrics["train/entropy"] == pytest.approx(1.5)
    loss.backward()
    assert entropy.grad.tolist() == [pytest.approx([-0.005, -0.005])]


def test_tis_token_truncate():
    old = torch.tensor([[-1.0, -2.0]])
    rollout = (old - torch.tensor([[LN(3.0), LN(0.5)]])).requires_grad_()  # old - rollout = ln 3, ln 0.5
    logp = old.clone().requires_grad_()  # ratio 1
    old_leaf = old.clone().requires_grad_()
    cfg = LossConfig(tis="token_truncate", tis_clip=2.0)
    loss, metrics = policy_loss(logp, old_leaf, torch.tensor([1.0]), torch.ones(1, 2), cfg, rollout_logp_BT=rollout)
    # w = min(3, 2) = 2, min(0.5, 2) = 0.5; L = -1 * w -> -2, -0.5; token_mean -1.25
    assert loss.item() == pytest.approx(-1.25, rel=1e-6)
    assert metrics["train/tis_weight_mean"] == pytest.approx(1.25, rel=1e-6)
    # |old - rollout| mean: (ln 3 + ln 2) / 2 = (1.0986123 + 0.6931472) / 2 = 0.8958797
    assert metrics["train/rollout_logprob_abs_diff"] == pytest.approx(0.8958797, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-1.0, -0.25], rel=1e-6)]  # -A r w / 2
    assert rollout.grad is None and old_leaf.grad is None  # the weights and old log-probs are constants


def test_tis_seq_mask():
    # rows of old - rollout (tis_mask_bound 2: keep iff |mean over the row's tokens| <= ln 2 = 0.6931472):
    #   [0.7, 0.68] mean 0.69 keep; [0.7, 0.7] 0.70 mask; [-0.8, -0.6] -0.70 mask (below 1/2); [-0.69, pad] keep;
    #   [0.5, 0.5] mean 0.5 keep (its sum, 1.0, is past ln 2: the old sum rule masked it);
    #   [5, 5] with no masked token: weight irrelevant, not counted in tis_masked_frac
    diff = torch.tensor([[0.7, 0.68], [0.7, 0.7], [-0.8, -0.6], [-0.69, 9.0], [0.5, 0.5], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.bool)
    old = torch.full((6, 2), -1.0)
    logp = old.clone().requires_grad_()  # ratio 1, A = 1: L = -1 per token
    cfg = LossConfig(tis="seq_mask", tis_mask_bound=2.0)
    loss, metrics = policy_loss(logp, old, torch.ones(6), mask, cfg, rollout_logp_BT=old - diff)
    # kept tokens: 2 (row 0) + 1 (row 3) + 2 (row 4) -> (-5) / 9 masked tokens
    assert loss.item() == pytest.approx(-5 / 9, rel=1e-6)
    assert metrics["train/tis_masked_frac"] == pytest.approx(2 / 5)
    assert metrics["train/tis_weight_mean"] == pytest.approx(5 / 9, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx(r) for r in
                                  [[-1 / 9, -1 / 9], [0, 0], [0, 0], [-1 / 9, 0], [-1 / 9, -1 / 9], [0, 0]]]


@pytest.mark.parametrize("bound, kept", [(1.01, True), (1.004, False)])
def test_tis_seq_mask_treats_long_and_short_samples_alike(bound, kept):
    # a 100-token and a 1,000-token sample, both 0.005 nats/token off the engine: their sums, 0.5 and 5.0, put them
    # on either side of ln 2 = 0.693 (the sum rule kept the short one and masked the long, stale one); their means
    # are both 0.005, inside ln 1.01 = 0.00995 and outside ln 1.004 = 0.00399: both kept, or both masked
    mask = torch.zeros(2, 1000, dtype=torch.bool)
    mask[0, :100], mask[1] = True, True
    old = torch.full((2, 1000), -1.0, dtype=torch.float64)
    logp = old.clone().requires_grad_()  # ratio 1: L = -A per token
    cfg = LossConfig(tis="seq_mask", tis_mask_bound=bound)
    loss, metrics = policy_loss(logp, old, torch.tensor([1.0, 2.0], dtype=torch.float64), mask, cfg,
                                rollout_logp_BT=old - 0.005)
    assert metrics["train/tis_masked_frac"] == (0.0 if kept else 1.0)
    # token_mean over 1,100 tokens: -(100 * 1 + 1000 * 2) / 1100 with both kept, 0 with both masked
    assert loss.item() == pytest.approx(-2100 / 1100 if kept else 0.0, rel=1e-12)


def test_rollout_logprobs_without_tis_are_only_logged():
    logp, old, adv, mask = two_sequences()
    loss, metrics = policy_loss(logp, old, adv, mask, LossConfig(), rollout_logp_BT=old - 0.25)
    assert loss.item() == pytest.approx(0.564, rel=1e-6)
    assert metrics["train/rollout_logprob_abs_diff"] == pytest.approx(0.25, rel=1e-5)
    assert "train/tis_weight_mean" not in metrics


def test_rows_without_tokens_contribute_zero():
    logp, old, adv, mask = two_sequences()
    logp = torch.cat([logp.detach(), torch.full((1, 3), math.nan)]).requires_grad_()
    old = torch.cat([old, torch.full((1, 3), math.inf)])
    adv, mask = torch.cat([adv, torch.tensor([5.0])]), torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    cfg = LossConfig(aggregation="seq_mean", kl_coef=0.1, policy="sequence_clip", tis="seq_mask")
    # GSPO seq_mean with B = 3 (the empty row counts, with loss 0): (-0.9085603 + 2.0) / 3 = 0.3638133; KL = 0
    # because ref = logp on the masked tokens; TIS keeps rows 0, 1 (rollout = old)
    loss, _ = policy_loss(logp, old, adv, mask, cfg, rollout_logp_BT=old, ref_logp_BT=logp.detach())
    assert loss.item() == pytest.approx(0.3638133, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[2].tolist() == [0.0, 0.0, 0.0]
    # nothing masked at all: loss 0, metrics 0, gradient 0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    logp0 = torch.randn(2, 3, requires_grad=True)
    loss0, m0 = policy_loss(logp0, torch.randn(2, 3), torch.ones(2), empty, LossConfig(aggregation="token_mean"))
    loss0.backward()
    assert loss0.item() == 0.0 and set(m0.values()) == {0.0} and logp0.grad.abs().sum().item() == 0.0


def random_batch(b=6, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 0.8  # ratios 0.67 .. 1.49
    lens = [7, 3, 5, 1, 0, 4]  # rows 2.. fit in 5 positions
    mask = torch.tensor([[1] * n + [0] * (t - n) for n in lens], dtype=torch.bool)
    extra = {
        "rollout_logp_BT": old + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 1.0,
        "ref_logp_BT": old + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 0.5,
        "entropy_BT": torch.rand(b, t, generator=g, dtype=torch.float64) * 2,
    }
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, extra


MICRO_CFGS = [
    LossConfig(),
    LossConfig(aggregation="seq_mean", policy="sequence_clip", tis="seq_mask", tis_mask_bound=1.15),  # masks 2 rows
    LossConfig(aggregation="seq_sum_norm", seq_sum_norm_len=16, tis="token_truncate", kl_coef=0.1,
               entropy_coef=0.01, dual_clip_c=1.2, kl_estimator="k2"),
    LossConfig(kl_coef=0.05, entropy_coef=0.02, tis="token_truncate", tis_clip=1.2),
]


@pytest.mark.parametrize("cfg", MICRO_CFGS, ids=lambda c: f"{c.aggregation}-{c.policy}-{c.tis}")
def test_micro_batches_add_up_to_the_full_batch(cfg):
    logp, old, adv, mask, extra = random_batch()
    full = logp.clone().requires_grad_()
    loss_full, _ = policy_loss(full, old, adv, mask, cfg, **extra)
    loss_full.backward()
    total_tokens, total_seqs = int(mask.sum()), mask.shape[0]  # 20 tokens, 6 rows
    split = logp.clone().requires_grad_()
    parts = []
    for rows, t in ((slice(0, 2), 7), (slice(2, 6), 5)):  # the second micro-batch is padded to 5 positions
        kw = {k: v[rows, :t] for k, v in extra.items()}
        part, _ = policy_loss(split[rows, :t], old[rows, :t], adv[rows], mask[rows, :t], cfg,
                              num_tokens=total_tokens, num_seqs=total_seqs, **kw)
        parts.append(part)
    sum(parts).backward()
    assert sum(parts).item() == pytest.approx(loss_full.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(split.grad, full.grad, rtol=1e-12, atol=1e-15)
    assert full.grad.abs().sum() > 0


def test_micro_batches_without_step_totals_do_not_add_up():
    # why num_tokens matters: per-micro-batch token means weight the 9 tokens of batch 1 like the 11 of batch 2
    logp, old, adv, mask, _ = random_batch()
    full, _ = policy_loss(logp, old, adv, mask, LossConfig())
    a, _ = policy_loss(logp[:2], old[:2], adv[:2], mask[:2], LossConfig())
    b, _ = policy_loss(logp[2:], old[2:], adv[2:], mask[2:], LossConfig())
    assert abs((a + b).item() - full.item()) > 1e-3


@pytest.mark.parametrize("cfg", [
    LossConfig(),
    LossConfig(aggregation="seq_mean", kl_coef=0.1, entropy_coef=0.05),
    LossConfig(aggregation="seq_sum_norm", seq_sum_norm_len=5, policy="sequence_clip", kl_coef=0.2),
    LossConfig(dual_clip_c=1.3, tis="token_truncate", kl_estimator="k1", kl_coef=0.3),
], ids=["token_mean", "seq_mean+kl+entropy", "gspo+seq_sum_norm", "dual+tis"])
def test_gradcheck_float64(cfg):
    # log ratios away from the kinks of the clip (ln 0.8 = -0.223, ln 1.28 = 0.247) and of the dual clip (ln 1.3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.0, 0.5, -0.5], [-0.4, 0.1, 0.35]], dtype=torch.float64)).requires_grad_()
    entropy = torch.tensor([[1.0, 0.5, 2.0], [0.2, 0.3, 0.4]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ref, rollout = old - 0.1, old + torch.tensor([[0.3, -0.2, 0.9], [0.0, 0.1, 0.2]], dtype=torch.float64)

    def f(lp, ent):
        return policy_loss(lp, old, adv, mask, cfg, rollout_logp_BT=rollout, ref_logp_BT=ref, entropy_BT=ent)[0]

    assert torch.autograd.gradcheck(f, (logp, entropy))


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps_low", -0.1), ("eps_low", 1.0), ("eps_low", math.nan), ("eps_high", -0.01), ("eps_high", math.inf),
        ("policy", "seq"), ("aggregation", "mean"), ("seq_sum_norm_len", 0), ("seq_sum_norm_len", 2.5),
        ("entropy_coef", -0.1), ("kl_coef", -1.0), ("kl_coef", math.nan), ("kl_estimator", "k4"),
        ("tis", "icepop"), ("tis_clip", 0.5), ("tis_mask_bound", 0.9), ("tis_mask_bound", math.nan),
        ("dual_clip_c", 1.0), ("dual_clip_c", math.inf),
    ],
)
def test_config_validation_names_the_field(field, value):
    cfg = dataclasses.replace(LossConfig(), **{field: value})
    with pytest.raises(ValueError, match=rf"^{field}: "):
        cfg.validate()
    logp, old, adv, mask = two_sequences()
    with pytest.raises(ValueError, match=rf"^{field}: "):  # policy_loss validates its config
        policy_loss(logp, old, adv, mask, cfg)


def test_every_config_field_has_a_docstring():
    import ast
    import inspect

    from miles_k3.trainer import losses

    body = next(n for n in ast.parse(inspect.getsource(losses)).body
                if isinstance(n, ast.ClassDef) and n.name == "LossConfig").body
    documented = {a.target.id for a, doc in itertools.pairwise(body)
                  if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}
    assert documented == {f.name for f in dataclasses.fields(LossConfig)}
    LossConfig().validate()


def test_input_validation_names_the_argument():
    logp, old, adv, mask = two_sequences()
    cfg = LossConfig()
    cases = [
        ({"old_logp_BT": old[:, :2]}, r"^old_logp_BT: must have shape \(2, 3\), got \(2, 2\)"),
        ({"adv_B": adv[:1]}, r"^adv_B: must have shape \(2,\)"),
        ({"adv_B": torch.tensor([1, 2])}, r"^adv_B: must be a floating dtype"),
        ({"logp_BT": logp[0]}, r"^logp_BT: must have 2-D"),
        ({"logp_BT": torch.zeros(2, 3, dtype=torch.int64)}, r"^logp_BT: must be a floating dtype"),
        ({"mask_BT": mask.float() * 2}, r"^mask_BT: values must be 0 or 1"),
        ({"mask_BT": mask[:, :2]}, r"^mask_BT: must have shape"),
        ({"cfg": LossConfig(tis="token_truncate")}, r"^rollout_logp_BT: required with cfg.tis=token_truncate"),
        ({"cfg": LossConfig(kl_coef=0.1)}, r"^ref_logp_BT: required with cfg.kl_coef=0.1"),
        ({"cfg": LossConfig(entropy_coef=0.1)}, r"^entropy_BT: required with cfg.entropy_coef=0.1"),
        ({"ref_logp_BT": old[:1]}, r"^ref_logp_BT: must have shape"),
        ({"entropy_BT": torch.ones(2, 3, dtype=torch.int32)}, r"^entropy_BT: must be a floating dtype"),
        ({"num_tokens": 0}, r"^num_tokens: must be None or a finite number > 0"),
        ({"num_seqs": -2}, r"^num_seqs: must be None or a finite number > 0"),
        ({"num_tokens": math.nan}, r"^num_tokens: "),
    ]
    base = {"logp_BT": logp, "old_logp_BT": old, "adv_B": adv, "mask_BT": mask, "cfg": cfg}
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            policy_loss(**{**base, **change})
    with pytest.raises(TypeError, match=r"^old_logp_BT: must be a tensor"):
        policy_loss(**{**base, "old_logp_BT": [[0.0] * 3] * 2})


# ----------------------------------------------------------------------------------- logprobs / entropy


def test_token_logprobs_and_entropy_hand_values():
    # logits [0, ln 3]: softmax [0.25, 0.75]; log p = ln 0.25 = -1.3862944, ln 0.75 = -0.2876821
    # entropy -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616 = 0.5623351
    # [0, 0, -inf, -inf]: uniform over 2 -> log p = -ln 2 = -0.6931472, entropy ln 2 (the -inf logits add 0, no NaN)
    logits = torch.tensor([[[0.0, LN(3.0), -math.inf, -math.inf], [0.0, 0.0, -math.inf, -math.inf]]],
                          requires_grad=True)
    tokens = torch.tensor([[1, 0]], dtype=torch.int32)
    assert token_logprobs(logits, tokens).tolist() == [pytest.approx([-0.2876821, -0.6931472], rel=1e-6)]
    ent = token_entropy(logits)
    assert ent.dtype == torch.float32
    assert ent.tolist() == [pytest.approx([0.5623351, 0.6931472], rel=1e-6)]
    ent.sum().backward()
    # dH/dz_v = -p_v (ln p_v + H): position 0: -0.25 (-1.3862944 + 0.5623351) = 0.2059898,
    # -0.75 (-0.2876821 + 0.5623351) = -0.2059898; position 1 (uniform, a maximum) and the -inf logits: 0
    assert logits.grad[0].tolist() == [pytest.approx([0.2059898, -0.2059898, 0, 0], abs=1e-6),
                                       pytest.approx([0, 0, 0, 0], abs=1e-7)]


def test_one_pass_logprob_and_entropy_gradients_add_up_hand_values():
    # logits [0, ln 3], target 1: p = [0.25, 0.75]. d logp / dz = onehot - p = [-0.25, 0.25];
    # dH/dz = -p (ln p + H) = [0.2059898, -0.2059898] (test above); loss logp + H: [-0.0440102, 0.0440102]
    logits = torch.tensor([[[0.0, LN(3.0)]]], requires_grad=True)
    lp, ent = token_logprobs_and_entropy(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(-0.2876821, rel=1e-6) and ent.item() == pytest.approx(0.5623351, rel=1e-6)
    (lp + ent).sum().backward()
    assert logits.grad[0, 0].tolist() == pytest.approx([-0.0440102, 0.0440102], abs=1e-6)
    lp_only, none = token_logprobs_and_entropy(logits.detach(), torch.tensor([[1]]), with_entropy=False)
    assert none is None and lp_only.item() == lp.item()


def test_chunked_logprobs_and_entropy_equal_the_unchunked_values():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 600, 50, generator=g) * 3).to(torch.bfloat16).requires_grad_()  # 3 chunks of 256
    tokens = torch.randint(0, 50, (2, 600), generator=g)
    w_lp, w_ent = torch.randn(2, 600, generator=g), torch.randn(2, 600, generator=g)
    lp, ent = token_logprobs(logits, tokens), token_entropy(logits)
    assert lp.dtype == ent.dtype == torch.float32
    (lp * w_lp + ent * w_ent).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref_logp = torch.log_softmax(logits.float(), -1)  # the whole [B, T, V] float32 reference
    ref_lp = ref_logp.gather(-1, tokens[..., None])[..., 0]
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.allclose(grad.float(), logits.grad.float(), atol=1e-2, rtol=1e-2)
    one = token_logprobs(logits.detach().float(), tokens, chunk_size=600)  # one chunk
    assert torch.allclose(token_logprobs(logits.detach().float(), tokens), one, atol=1e-6)


def test_logprobs_and_entropy_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 5), generator=g)
    assert token_logprobs(logits, tokens).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda z: token_entropy(z, chunk_size=2), (logits,))


def test_logits_validation():
    logits = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match=r"^tokens_BT: must have shape \(1, 2\)"):
        token_logprobs(logits, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"^tokens_BT: must be an integer dtype"):
        token_logprobs(logits, torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"^logits_BTV: must be a floating 3-D tensor"):
        token_entropy(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"^chunk_size: must be an int >= 1"):
        token_entropy(logits, chunk_size=0)


# ------------------------------------------------------------------------------------- registered policy losses

CONST = 0.5
CALLS: list[tuple[int, ...]] = []  # the [B, T] shape of each call of the test loss


@losses.register_policy_loss("_test_const")
def const_loss(x: losses.PolicyInputs):
    """L_it = CONST * (1 + logp_it - old_logp_it): CONST per token where logp = old, and d L_it / d logp_it = CONST,
    so the aggregated loss is CONST times the token count over the denominator, its gradient CONST over it."""
    CALLS.append(tuple(x.mask_BT.shape))
    loss_BT = CONST * (1.0 + x.logp_BT - x.old_logp_BT)
    return loss_BT, {"train/test_const": x.token_mean(loss_BT.detach())}


def test_builtin_policy_losses_are_registered():
    names = losses.policy_loss_names()
    assert {"token_clip", "sequence_clip"} <= set(names) and names == sorted(names)
    assert LossConfig().policy == "token_clip"
    with pytest.raises(ValueError, match="policy loss 'token_clip' is already registered"):
        losses.register_policy_loss("token_clip")(const_loss)
    losses.register_policy_loss("_test_const")(const_loss)  # the same function again (its module imported twice): fine


@pytest.mark.parametrize(("aggregation", "totals", "loss", "grad"), [
    ("token_mean", {}, CONST, CONST / 5),  # 5 tokens x CONST / 5 tokens
    ("token_mean", {"num_tokens": 10}, CONST / 2, CONST / 10),  # the step's 10 tokens
    ("seq_sum_norm", {}, 5 * CONST / (2 * 4), CONST / 8),  # 5 x CONST / (2 rows x seq_sum_norm_len 4)
    ("seq_mean", {"num_seqs": 4}, 2 * CONST / 4, None),  # (CONST + CONST) / 4 rows; row i: CONST / (n_i x 4)
])
def test_a_policy_loss_registered_by_a_test_is_selected_from_config_and_called(aggregation, totals, loss, grad):
    from miles_k3.config import compose_config

    cfg = compose_config("train", ["trainer.loss.policy=_test_const", f"trainer.loss.aggregation={aggregation}",
                                   "trainer.loss.seq_sum_norm_len=4"]).trainer.loss
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    CALLS.clear()
    value, metrics = policy_loss(logp, logp.detach(), torch.tensor([1.0, -2.0]), mask, cfg, **totals)
    assert CALLS == [(2, 3)]
    assert value.item() == pytest.approx(loss, rel=1e-12) and metrics["train/pg_loss"] == value.item()
    assert metrics == {"train/test_const": pytest.approx(CONST), "train/pg_loss": value.item()}
    value.backward()
    want = [[grad] * 3, [grad, grad, 0.0]] if grad is not None else [[CONST / 12] * 3, [CONST / 8, CONST / 8, 0.0]]
    assert logp.grad.tolist() == [pytest.approx(row, rel=1e-12) for row in want]


def test_the_trainer_calls_the_policy_loss_the_config_selects():
    # one update on k3_tiny: 3 samples with 2 + 3 + 4 = 9 response tokens in one micro-batch, token_mean; the old
    # log-probs are recomputed by the same model, so logp = old and the loss is CONST x 9 / 9
    from miles_k3.config import compose_config
    from miles_k3.model import K3Config, K3ForCausalLM
    from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
    from miles_k3.trainer.batch import Sample
    from miles_k3.trainer.optim import OptimConfig, build_optimizer, build_scheduler
    from miles_k3.trainer.step import train_step

    cfg = compose_config("train", ["trainer.loss.policy=_test_const"]).trainer
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"))
    model.requires_grad_(False)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    params = lora_parameters(model)
    opt = build_optimizer(params, OptimConfig(lr=1e-2))
    samples = [Sample([5, 6, 7], list(range(10, 12 + i)), advantage=1.0) for i in range(3)]
    CALLS.clear()
    m = train_step(model, samples, cfg, opt, build_scheduler(opt, OptimConfig(lr=1e-2)), params, pad_id=0,
                   device=torch.device("cpu"))
    assert len(CALLS) == 1 and CALLS[0][0] == 3
    assert m["train/skipped"] == 0.0 and m["train/num_tokens"] == 9
    assert m["train/loss"] == pytest.approx(CONST, rel=1e-6) and m["train/test_const"] == pytest.approx(CONST, rel=1e-6)


def test_a_registered_policy_loss_gets_tis_and_penalties_from_policy_loss():
    # TIS token_truncate: weight min(exp(old - rollout), 2) = exp(0.25) on every token; KL k1 of logp - ref = 0.1
    cfg = LossConfig(policy="_test_const", tis="token_truncate", kl_coef=0.5, kl_estimator="k1")
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, metrics = policy_loss(old.clone(), old, torch.ones(1), torch.ones(1, 2), cfg, rollout_logp_BT=old - 0.25,
                                ref_logp_BT=old - 0.1)
    assert metrics["train/pg_loss"] == pytest.approx(CONST * math.exp(0.25), rel=1e-12)
    assert loss.item() == pytest.approx(CONST * math.exp(0.25) + 0.5 * 0.1, rel=1e-12)
    assert metrics["train/tis_weight_mean"] == pytest.approx(math.exp(0.25), rel=1e-12)


def test_an_unknown_policy_loss_fails_at_config_validation_listing_the_registered_ones():
    from miles_k3.config import ConfigFieldError, compose_config

    with pytest.raises(ConfigFieldError, match=r"^trainer\.loss\.policy: 'nope' is not a registered policy "
                                               r"loss; registered: (.*, )?_test_const, (.*, )?sequence_clip, token_clip"):
        compose_config("train", ["trainer.loss.policy=nope"])


def test_a_policy_loss_of_the_wrong_shape_is_refused_naming_it():
    @losses.register_policy_loss("_test_scalar")
    def scalar_loss(x: losses.PolicyInputs):
        return x.logp_BT.sum(), {}

    logp, old, adv, mask = two_sequences()
    with pytest.raises(ValueError, match=r"^policy loss '_test_scalar' returned a per-token loss of shape \(\); it "
                                         r"must return \[B, T\] = \(2, 3\)"):
        policy_loss(logp, old, adv, mask, LossConfig(policy="_test_scalar"))
