"""rollout.mode=partial on the trainer side (`miles_k3.trainer.partial`) against a scripted engine: each problem's
text lists its samples' response lengths ("5,4": sample 0 ends after 5 tokens, sample 1 after 4); every `run` tick
adds one token to every unfinished sample of every queued group, recorded with the engine's weight version. Each
test states what a hand run of the staleness policy gives, step by step. The loss under mixed versions (decoupled
PPO: the ratio against the proximal policy, the TIS weight against the engine's) is hand-worked too."""
import copy
import math
import re
from types import SimpleNamespace

import pytest
import torch

from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.rollout.api import EngineCapabilities
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.losses import LossConfig, policy_loss
from miles_k3.trainer.partial import PartialRollouts
from miles_k3.trainer.rollouts import PartialConfig, RolloutConfig
from miles_k3.trainer.staleness import check_versions, length_bias


class Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class Stream:
    def __init__(self, problems):
        self.problems, self.drawn = problems, 0

    def take(self, k):
        out = [(self.drawn + i, self.problems[self.drawn + i]) for i in range(k)]
        self.drawn += k
        return out

    def state(self):
        return {"drawn": self.drawn}

    def load_state(self, state):
        self.drawn = state["drawn"]


class ScriptedEngine:
    """submit / run / cancel / queue_state / load_queue_state of the native engine's queue (`engine.queue`),
    scripted (see the module docstring): the double is its own queue; `version` is the weight version a push
    would set."""

    capabilities = EngineCapabilities(partial_queue=True)

    def __init__(self):
        self.version, self.next_gid, self.waiting, self.params = 0, 0, [], {}
        self.queue = self

    def submit(self, input_ids, sampling_params, n, lora=None, return_routed_experts=False):
        gids = []
        for ids, sp in zip(input_ids, sampling_params):
            lens = [int(x) for x in "".join(map(chr, ids)).split(",")]
            self.waiting.append({"group": self.next_gid, "samples": [{"len": lens[j], "out": [], "versions": []}
                                                                    for j in range(n)]})
            self.params[self.next_gid] = sp
            gids.append(self.next_gid)
            self.next_gid += 1
        return gids

    def run(self, finished_groups=None, must_finish=(), until=None, on_finished=None):
        """`until` is checked before the first tick and after each; `on_finished` gets each group as it finishes
        (a group it submits gets its first token in the next tick), else the finished groups are returned."""
        done = []
        self.retracted = SimpleNamespace(requests=0, tokens=0, bytes=0)

        def satisfied():
            if until is not None:
                return until()
            ids = {g for g, _ in done}
            return finished_groups is not None and len(done) >= finished_groups and set(must_finish) <= ids

        while self.waiting and not satisfied():
            for g in list(self.waiting):
                for s in g["samples"]:
                    if len(s["out"]) < s["len"]:
                        s["out"].append(ord("x"))
                        s["versions"].append(self.version)
                if all(len(s["out"]) == s["len"] for s in g["samples"]):
                    self.waiting.remove(g)
                    finished = (g["group"], [self._record(s) for s in g["samples"]])
                    if on_finished is not None:
                        on_finished(*finished)
                    else:
                        done.append(finished)
        begun = [len(s["out"]) for g in self.waiting for s in g["samples"] if s["out"]]
        self.retracted = SimpleNamespace(requests=len(begun), tokens=sum(begun), bytes=0)
        return done

    def _record(self, s):
        return {"output_ids": list(s["out"]),
                "meta_info": {"finish_reason": {"type": "length"}, "weight_version": max(s["versions"]),
                              "weight_versions": sorted(set(s["versions"])),
                              "output_token_logprobs": [(-0.5, t) for t in s["out"]],
                              "output_token_weight_versions": list(s["versions"])}}

    def cancel(self, gids):
        self.waiting = [g for g in self.waiting if g["group"] not in gids]

    def queue_state(self):
        return {"requests": [{"group": g["group"], "output": list(s["out"])} for g in self.waiting
                             for s in g["samples"]], "scripted": copy.deepcopy((self.waiting, self.next_gid))}

    def load_queue_state(self, state):
        self.waiting, self.next_gid = copy.deepcopy(state["scripted"])


def odd_length(responses, golds):
    return [RewardResult(float(len(r) % 2), False, {}) for r in responses]


LENGTHS = ["1,1", "2,1", "5,4", "1,2", "3,3", "4,4", "1,1", "1,1"]


def _pool(policy, max_staleness, engine=None, lengths=LENGTHS, refill=False):
    cfg = RolloutConfig(prompts_per_step=2, group_size=2, template="plain", mode="partial",
                        partial=PartialConfig(inflight_groups=3, max_staleness=max_staleness, policy=policy,
                                              refill=refill))
    cfg.validate()
    problems = [Problem(f"p{i}", text, "0") for i, text in enumerate(lengths)]
    return PartialRollouts(engine or ScriptedEngine(), Tok(), Stream(problems), odd_length, cfg, "policy")


def _lengths(samples):
    return [len(s.response_ids) for s in samples]


def test_wait_holds_the_step_until_the_group_at_the_bound_finishes():
    """max_staleness 1, wait. Step 1 (v0): p0, p1, p2 queued; two ticks finish p0 and p1; p2 has 2 tokens each.
    Step 2 (v1): p3, p4 queued behind p2, which is at the bound. Tick 3: p3's sample 0 ends; tick 4: p3 ends (2
    groups needed, but p2 must finish); tick 5: p2 ends, and p4 with it. p2's samples: 2 tokens of v0, then v1."""
    pool = _pool("wait", 1)
    s1, m1 = pool.collect(0)
    assert _lengths(s1) == [1, 1, 2, 1] and m1["rollout/staleness_max"] == 0.0
    assert list(pool.groups) == [2] and m1["rollout/groups_inflight"] == 1.0
    assert (m1["rollout/retracted_requests"], m1["rollout/reprefill_tokens"]) == (2.0, 4.0)  # p2's, 2 tokens each
    pool.engine.version = 1  # the push
    s2, m2 = pool.collect(1)
    assert _lengths(s2) == [1, 2, 5, 4, 3, 3]
    assert [s.token_versions for s in s2[2:4]] == [[0, 0, 1, 1, 1], [0, 0, 1, 1]]
    assert [s.group for s in s2] == [0, 0, 1, 1, 2, 2]
    assert [s.advantage > 0 for s in s2] == [True, False, True, False, False, False]  # p4: 3 and 3, flat
    assert m2["rollout/staleness_mean"] == pytest.approx(1 / 3) and m2["rollout/staleness_max"] == 1.0
    assert m2["rollout/staleness_frac_0"] == pytest.approx(2 / 3)
    assert m2["rollout/offpolicy_token_frac"] == pytest.approx(4 / 18)
    assert m2["rollout/groups_carried"] == 1.0 and m2["rollout/groups_inflight"] == 0.0
    assert m2["rollout/retracted_requests"] == 0.0
    assert (m2["rollout/trained_len_mean"], m2["rollout/trained_len_p90"]) == (3.0, 5.0)
    check_versions(s2, 1, pool.cfg)


def test_refill_queues_a_group_as_each_one_finishes_and_keeps_the_pool_full():
    """max_staleness 1, wait, refill. Step 1 (v0): p0, p1, p2 queued. Tick 1: p0 ends, p3 is queued (v0); tick 2:
    p1 ends, p4 is queued (v0), p3's sample 0 ends: 2 groups, the run stops with p2 (2 tokens each), p3 (1, 1) and
    p4 (none) in flight, 3 groups as at the start. Step 2 (v1): all three are at the bound, nothing is topped up.
    Tick 3: p3 ends (its sample 1: a v0 token, then a v1 one), p5 is queued (v1); tick 4: p2's sample 1 ends; tick 5:
    p2 ends (p6 queued), p4 ends (p7 queued) and every due group has: p5 is left with 2 tokens each, p6, p7 none.
    Without refill step 1 leaves p2 alone in flight and step 2 queues p3, p4 under v1 (the test above)."""
    pool = _pool("wait", 1, refill=True)
    s1, m1 = pool.collect(0)
    assert _lengths(s1) == [1, 1, 2, 1] and list(pool.groups) == [2, 3, 4]
    assert (m1["rollout/groups_refilled"], m1["rollout/groups_inflight"]) == (2.0, 3.0)
    assert [g.queued_at for g in pool.groups.values()] == [0, 0, 0]
    pool.engine.version = 1
    s2, m2 = pool.collect(1)
    assert _lengths(s2) == [1, 2, 5, 4, 3, 3] and [s.group for s in s2] == [0, 0, 1, 1, 2, 2]
    assert [s.token_versions for s in s2[:4]] == [[0], [0, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1]]
    assert s2[4].token_versions == [1, 1, 1]  # p4, queued under v0, began under v1: staleness 0
    assert (m2["rollout/groups_refilled"], m2["rollout/groups_inflight"]) == (3.0, 3.0)
    assert m2["rollout/staleness_max"] == 1.0 and m2["rollout/staleness_frac_0"] == pytest.approx(2 / 6)
    assert list(pool.groups) == [5, 6, 7] and [g.queued_at for g in pool.groups.values()] == [1, 1, 1]
    assert [len(s["out"]) for g in pool.engine.waiting for s in g["samples"]] == [2, 2, 0, 0, 0, 0]
    check_versions(s2, 1, pool.cfg)


def test_without_refill_no_group_is_queued_during_the_run():
    _, m = _pool("wait", 1).collect(0)
    assert m["rollout/groups_refilled"] == 0.0


def test_wait_with_no_staleness_is_synchronous():
    """max_staleness 0, wait: every group queued in a step must finish in it, so nothing is carried."""
    pool = _pool("wait", 0)
    samples, m = pool.collect(0)
    assert _lengths(samples) == [1, 1, 2, 1, 5, 4] and not pool.groups and m["rollout/staleness_max"] == 0.0


def test_drop_cancels_a_group_past_the_bound_and_queues_its_prompt_again_with_fresh_seeds():
    """max_staleness 0, drop. Step 2 (v1): p2 (2 tokens of v0 each) can no longer be on-policy: cancelled and queued
    again first (draw 2, retry 1), then p3, p4; p3 ends after 2 ticks, p4 after 3, p2 has 3 tokens each. Step 3 (v2):
    p2 is past the bound again: dropped a second time (retry 2), queued before p5 ("4,4") and p6 ("1,1"); p6 ends at
    tick 1 and p5 at tick 4, p2 (5 and 4 tokens to go) with 4 each. Seeds (rollout.seed 0, group_size 2): draw d's
    group samples with 2d, its retry r with 2d + r * 1,000,000,000,039."""
    pool = _pool("drop", 0)
    pool.collect(0)
    pool.engine.version = 1
    samples, m = pool.collect(1)
    assert _lengths(samples) == [1, 2, 3, 3] and all(s.token_versions == [1] * len(s.response_ids) for s in samples)
    # the drop's length bias: finished 1, 2, 3, 3 (mean 2.25), dropped p2's 2, 2 so far: mean of all 13 / 6 - 2.25
    # = -1 / 12; each dropped 2 is longer than 1 and shorter than 3, 3: (1 - 2) * 2 / 8 = -0.25
    assert m["rollout/groups_dropped"] == 1.0
    assert (m["rollout/drop_len_bias"], m["rollout/drop_len_rank"]) == (pytest.approx(-1 / 12), -0.25)
    assert (m["rollout/groups_dropped_again"], m["rollout/groups_retried"], m["rollout/drops_max"]) == (0, 0, 1)
    assert m["rollout/offpolicy_token_frac"] == 0.0
    check_versions(samples, 1, pool.cfg)
    saved = pool.state()
    assert [(g["draw"], g["retry"]) for g in saved["groups"]] == [(2, 1)]
    seeds = {gid: sp["sampling_seed"] for gid, sp in pool.engine.params.items()}
    assert [seeds[gid] for gid in range(6)] == [0, 2, 4, 1_000_000_000_043, 6, 8]  # gid 3: p2's retry 1
    resumed = _pool("drop", 0, ScriptedEngine())
    resumed.load_state(saved)
    for p in (pool, resumed):
        p.engine.version = 2
        samples, m = p.collect(2)
        assert _lengths(samples) == [1, 1, 4, 4]  # p6, then p5
        assert (m["rollout/groups_dropped"], m["rollout/groups_dropped_again"], m["rollout/drops_max"]) == (1, 1, 2)
        assert [(g.draw, g.retry) for g in p.groups.values()] == [(2, 2)]
        assert p.engine.params[6]["sampling_seed"] == 4 + 2 * 1_000_000_000_039  # p2's retry 2, resumed or not
    old = copy.deepcopy(saved)  # a checkpoint of before retries were counted: retry 0
    del old["groups"][0]["retry"]
    before = _pool("drop", 0, ScriptedEngine())
    before.load_state(old)
    assert [g.retry for g in before.groups.values()] == [0]


def test_a_dropped_prompt_that_finishes_is_counted_as_retried():
    """max_staleness 0, drop, prompts "1,1", "1,1", "3,3", "4,4", "4,4". Step 1 (v0): p0, p1 end at tick 1, p2 has
    1 token each. Step 2 (v1): p2 dropped and queued again (retry 1) before p3, p4; it ends at tick 3, p3 and p4 at
    tick 4: three groups trained, p2's a retry."""
    pool = _pool("drop", 0, lengths=["1,1", "1,1", "3,3", "4,4", "4,4"])
    pool.collect(0)
    pool.engine.version = 1
    samples, m = pool.collect(1)
    assert _lengths(samples) == [3, 3, 4, 4, 4, 4]
    assert (m["rollout/groups_dropped"], m["rollout/groups_dropped_again"]) == (1, 0)
    assert (m["rollout/groups_retried"], m["rollout/drops_max"]) == (1, 1)


@pytest.mark.parametrize("finished, dropped, want", [
    ([2, 4, 6, 8], [], (0.0, 0.0)),  # no drop
    # blind to length: the dropped mean 5 is the finished one; 3 beats 1 of 4 and loses to 3, 7 beats 3 and loses to 1
    ([2, 4, 6, 8], [3, 7], (0.0, 0.0)),
    # the longest dropped: all 10 samples would average (20 + 19) / 6 = 6.5 against 5; every pair +1
    ([2, 4, 6, 8], [9, 10], (1.5, 1.0)),
    ([2, 4, 6, 8], [4, 4], (-1 / 3, -0.25)),  # ties count 0: (1 - 2) per dropped sample, over 8 pairs
])
def test_the_length_bias_reads_zero_for_a_drop_blind_to_length(finished, dropped, want):
    bias, rank = length_bias(finished, dropped)
    assert (bias, rank) == (pytest.approx(want[0]), pytest.approx(want[1]))


def test_the_length_bias_of_random_drops_averages_zero():
    """Groups of 8 lengths from one distribution, one group in 4 dropped at random (its full lengths), 2,000 steps:
    both measures average ~0 (the share of dropped groups whose longest sample reaches the p90, the old metric,
    reads ~1 - 0.9^8 = 57% here); dropping each step's longest group instead reads clearly > 0."""
    import random

    rng = random.Random(0)
    neutral, longest = [], []
    for _ in range(2000):
        groups = [[rng.randint(1, 100) for _ in range(8)] for _ in range(4)]
        k = rng.randrange(4)
        neutral.append(length_bias([n for i, g in enumerate(groups) if i != k for n in g], groups[k]))
        k = max(range(4), key=lambda i: sum(groups[i]))
        longest.append(length_bias([n for i, g in enumerate(groups) if i != k for n in g], groups[k]))
    mean = [(sum(b for b, _ in runs) / 2000, sum(r for _, r in runs) / 2000) for runs in (neutral, longest)]
    (bias, rank), (long_bias, long_rank) = mean
    assert abs(bias) < 0.5 and abs(rank) < 0.02  # tokens (lengths 1-100, mean 50.5); pairs
    assert long_bias > 2.5 and long_rank > 0.2


def test_keep_trains_a_group_past_the_bound_and_reports_it():
    """max_staleness 0, keep. Step 2 (v1): p3, p4 queued behind p2; p3 ends at tick 4, p2 and p4 at tick 5 (p2 first:
    queued first). p2 is 1 version stale: trained, reported over the bound; the check lets keep through."""
    pool = _pool("keep", 0)
    pool.collect(0)
    pool.engine.version = 1
    samples, m = pool.collect(1)
    assert _lengths(samples) == [1, 2, 5, 4, 3, 3]
    assert m["rollout/staleness_frac_over"] == pytest.approx(2 / 6) and m["rollout/staleness_max"] == 1.0
    check_versions(samples, 1, pool.cfg)
    with pytest.raises(RuntimeError, match=r"sample 2 has a token of weight version 0, 1 versions behind .*max_staleness is 0"):
        check_versions(samples, 1, _pool("wait", 0).cfg)


def test_the_pool_state_continues_in_a_fresh_engine_exactly():
    a = _pool("wait", 1)
    a.collect(0)
    state = a.state()
    b = _pool("wait", 1, ScriptedEngine())
    b.load_state(state)  # the prompt cursor too (this replica's: under dp > 1 each replica's differs)
    assert b.stream.drawn == a.stream.drawn == 3
    for pool in (a, b):
        pool.engine.version = 1
    sa, ma = a.collect(1)
    sb, mb = b.collect(1)
    assert [(s.response_ids, s.token_versions, s.reward) for s in sa] == [(s.response_ids, s.token_versions, s.reward)
                                                                          for s in sb]
    assert ma == mb


def test_check_versions_names_the_sample_and_the_rule():
    cfg = _pool("wait", 1).cfg
    ok = Sample([1], [5, 6], token_versions=[2, 3])
    check_versions([ok], 3, cfg)
    with pytest.raises(RuntimeError, match="sample 1 has weight versions for 1 of its 2 tokens"):
        check_versions([ok, Sample([1], [5, 6], token_versions=[3])], 3, cfg)
    with pytest.raises(RuntimeError, match="sample 0 has a token of weight version 4, newer than"):
        check_versions([Sample([1], [5], token_versions=[4])], 3, cfg)
    with pytest.raises(RuntimeError, match="2 versions behind"):
        check_versions([Sample([1], [5, 6], token_versions=[1, 3])], 3, cfg)


def test_a_stale_token_is_ratioed_against_the_proximal_policy_and_weighted_against_the_engine():
    """One sample, advantage 1, two tokens: t1 drawn by the engine under v0 (its log-prob -1.0), t2 under v1 (-0.7).
    The trainer's proximal (step-start) log-probs are -0.5 and -0.7, the current ones equal them (first update).
    Decoupled PPO: ratio = exp(logp - proximal) = 1 on both (no clip), TIS weight min(exp(proximal - engine), 2)
    = (e^0.5, 1). Token-mean loss = -(e^0.5 + 1) / 2, and d loss / d logp = -(e^0.5, 1) / 2. Against the engine's
    log-prob instead, t1's ratio would be e^0.5 = 1.65 > 1.2: clipped, no gradient."""
    cfg = LossConfig(tis="token_truncate", tis_clip=2.0)
    logp = torch.tensor([[-0.5, -0.7]], dtype=torch.float64, requires_grad=True)
    proximal = torch.tensor([[-0.5, -0.7]], dtype=torch.float64)
    engine = torch.tensor([[-1.0, -0.7]], dtype=torch.float64)
    mask, adv = torch.ones(1, 2), torch.ones(1, dtype=torch.float64)
    loss, m = policy_loss(logp, proximal, adv, mask, cfg, rollout_logp_BT=engine)
    loss.backward()
    e = math.exp(0.5)
    assert loss.item() == pytest.approx(-(e + 1) / 2)
    assert logp.grad[0].tolist() == pytest.approx([-e / 2, -0.5])
    assert m["train/clip_frac"] == 0.0 and m["train/tis_weight_mean"] == pytest.approx((e + 1) / 2)
    logp.grad = None
    on_policy, _ = policy_loss(logp, engine, adv, mask, LossConfig())  # the ratio against the behaviour policy
    on_policy.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5])  # t1 clipped at 1 + 0.2: no gradient


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_with_lora_dropout_the_tis_weights_are_the_dropout_free_policy_s(dropout):
    """One update of k3_tiny (LoRA B != 0, so dropout changes the log-probs) on three samples of 2, 3 and 4 tokens
    whose engine log-probs are the policy's own (eval mode: no dropout) minus delta = 0.1, -0.3, 0.2. The TIS weight
    exp(proximal - engine) is then exp(delta) on every token of a sample, with dropout as without:
    tis_weight_mean = (2 e^0.1 + 3 e^-0.3 + 4 e^0.2) / 9 = 1.0353786 and the gap (2 * 0.1 + 3 * 0.3 + 4 * 0.2) / 9
    = 0.2111111. (Taken from the gradient forward's log-probs, dropout 0.5 moves them by ~0.1 nats a token.)"""
    from miles_k3.model import K3Config, K3ForCausalLM
    from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
    from miles_k3.trainer.optim import OptimConfig, build_optimizer, build_scheduler
    from miles_k3.trainer.step import TrainerConfig, sequence_logprobs, train_step

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4")
    model.requires_grad_(False)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=dropout))
    params = lora_parameters(model)
    with torch.no_grad():
        for n, p in params.items():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.train()
    g, samples = torch.Generator().manual_seed(1), []
    for i, delta in enumerate((0.1, -0.3, 0.2)):
        prompt, resp = (torch.randint(1, 250, (n,), generator=g).tolist() for n in (3, 2 + i))
        own = sequence_logprobs(model, prompt + resp)[len(prompt) - 1:]  # eval mode
        samples.append(Sample(prompt, resp, advantage=1.0 - i, rollout_logprobs=[lp - delta for lp in own]))
    opt = build_optimizer(params, OptimConfig(lr=1e-3))
    cfg = TrainerConfig(loss=LossConfig(tis="token_truncate", tis_clip=2.0))
    m = train_step(model, samples, cfg, opt, build_scheduler(opt, OptimConfig(lr=1e-3)), params, 0,
                   torch.device("cpu"))
    assert m["train/tis_weight_mean"] == pytest.approx(1.0353786, rel=1e-5)
    assert m["train/rollout_logprob_abs_diff"] == pytest.approx(0.2111111, rel=1e-5)
    assert model.training  # the eval-mode forward restored the flags


PARTIAL = ["rollout.mode=partial", "trainer.loss.tis=token_truncate"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.mode=partial", "trainer.loss.tis=none"],  # alone, rollout.mode=partial takes token_truncate (auto)
     "trainer.loss.tis: rollout.mode=partial trains tokens sampled under older adapters"),
    ([*PARTIAL, "trainer.old_logprobs=rollout"], "trainer.old_logprobs: rollout.mode=partial takes the PPO ratio"),
    ([*PARTIAL, "rollout.partial.max_staleness=-1"], "rollout.partial.max_staleness: must be an integer >= 0"),
    ([*PARTIAL, "rollout.partial.env_lag_steps=-1"], "rollout.partial.env_lag_steps: must be an integer >= 0"),
    ([*PARTIAL, "rollout.partial.policy=discard"], "rollout.partial.policy: 'discard' is not one of wait, drop, keep"),
    ([*PARTIAL, "rollout.partial.inflight_groups=31"], ("rollout.partial.inflight_groups=31: fewer than "
                                                        "rollout.prompts_per_step=32")),
    ([*PARTIAL, "rollout.max_sampling_rounds=2"], "rollout.max_sampling_rounds=2: rollout.mode=partial"),
    (["rollout.partial.max_staleness=2"], "rollout.partial: rollout.partial.* is set but rollout.mode=sync"),
    ([*PARTIAL, "rollout.group_size=1"], "rollout.group_size: must be >= 2"),
    ([*PARTIAL, "rollout.max_new_tokens=64"], "rollout.max_new_tokens: 64 leaves no room for the prompt"),
    ([*PARTIAL, "rollout.partial.refill=true", "env=guess"],
     ("rollout.partial.refill: refills the pool of rollout.mode=partial with single-turn episodes (here "
      "rollout.mode=partial, env.max_turns=6)")),
    ([*PARTIAL, "rollout.partial.refill=true", "parallel.dp=2"],
     "rollout.partial.refill: runs in one process for now (here 2 ranks"),
])
def test_partial_settings_that_cannot_work_are_refused_naming_the_field(overrides, message):
    from miles_k3.config import ConfigFieldError, compose_config

    with pytest.raises((ConfigFieldError, ValueError), match=re.escape(message)):
        compose_config("train", overrides)


def test_sglang_cannot_run_partial_rollouts():
    from miles_k3.config_checks import check_partial

    with pytest.raises(ValueError, match="needs engine.backend=native .*pause_generation is an HTTP-server endpoint"):
        check_partial("partial", "recompute", "token_truncate", "sglang")
    check_partial("partial", "recompute", "token_truncate", "native")
    check_partial("sync", "rollout", "none", "sglang")


def test_a_group_larger_than_the_engines_slots_is_refused_naming_the_fix(caplog):
    import logging

    from miles_k3.launch import check_pool_fits

    cfg = _pool("wait", 1).cfg  # 3 groups of 2 in flight
    with pytest.raises(ValueError, match=r"rollout.group_size=2: the engine has 1 request slots.*memory_budget_bytes"):
        check_pool_fits(cfg, 1)
    with caplog.at_level(logging.INFO, logger="miles_k3.train"):
        check_pool_fits(cfg, 5)
    assert "3 groups in flight per replica, 2 run at once (5 engine slots)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miles_k3.train"):
        check_pool_fits(cfg, 3, dp=2)  # ceil(3 / 2) = 2 groups per replica, 1 at once
    assert "2 groups in flight per replica, 1 run at once (3 engine slots)" in caplog.text


def test_partial_over_replicas_that_do_not_divide_the_step_is_refused():
    from miles_k3.launch import check_replica_share

    cfg = _pool("wait", 1).cfg  # prompts_per_step 2
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step=2: .* among the 4 data-parallel replicas; set it "
                                         r"to a multiple of 4"):
        check_replica_share(cfg, 4)
    check_replica_share(cfg, 2)


def test_replicas_draw_every_dp_th_prompt_and_their_groups_interleave():
    """Replica 1 of 2 draws global draws 1, 3, 5 (its seeds come from them); kept-group counts (3, 1, 2) over three
    replicas number the groups 0..5 by rounds: replica 0 gets 0, 3, 5; replica 1 gets 1; replica 2 gets 2, 4."""
    from miles_k3.parallel.mesh import ParallelContext
    from miles_k3.trainer.partial import PartialRollouts, interleaved_index

    cfg = _pool("wait", 1).cfg
    stream = Stream([Problem(f"p{i}", "1,1", "0") for i in range(20)])
    pool = PartialRollouts(ScriptedEngine(), Tok(), stream, odd_length, cfg, "policy",
                           ctx=ParallelContext(world_size=2, rank=1, dp_size=2, dp_rank=1))
    assert (pool.share, pool.inflight) == (1, 2)  # 2 prompts per step, 3 in flight: 1 and ceil(3 / 2) per replica
    assert [d for d, _ in pool._take(3)] == [1, 3, 5]
    assert [d for d, _ in pool._take(1)] == [7]
    assert [interleaved_index([3, 1, 2], r) for r in range(3)] == [[0, 3, 5], [1], [2, 4]]
    assert interleaved_index([2, 2], 1) == [1, 3]
    assert interleaved_index([0, 2], 1) == [0, 1]


def test_an_episode_saved_before_the_kept_state_rename_resumes_with_its_state_id():
    """A checkpoint written when the engine's kept state was called a session stores an episode's id under
    "session": it loads as the episode's state_id (5 here), as a new checkpoint's "state_id" does."""
    from miles_k3.envs.env import StepResult
    from miles_k3.trainer.episodes import Episode
    from miles_k3.trainer.partial import _episode_from_state, _episode_state

    saved = _episode_state(Episode(None, [1, 2], 7, ids=[3], mask=[1], state_id=5,
                                   steps=[StepResult("again", 0.0, False, {})]))
    assert saved["state_id"] == 5 and "session" not in saved
    old = {("session" if k == "state_id" else k): v for k, v in saved.items()}
    for d in (saved, old):
        ep = _episode_from_state(d, None)
        assert (ep.state_id, ep.prompt, ep.ids, ep.steps[0].observation) == (5, [1, 2], [3], "again")
