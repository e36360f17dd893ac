"""The log-prob parity check of a push into SGLang (`miles_k3.weight_sync.sglang`) on the CPU, against the
recorded-interface double of sglang.Engine (`tests/sglang_double.py`, NOT SGLang): the probe, the rule on
hand-worked values, pushes refused for a dropped, mis-scaled or failing adapter with the served version kept, and the
verify schedule (every_n, inconclusive checks)."""
import pytest
import torch
from lora_helpers import hf_policy
from sglang_helpers import LORA, double_engine, peft_of, policy, set_lora_b, trainer_logprobs

from miles_k3.model.lora import lora_parameters
from miles_k3.rollout.sglang_config import SGLangConfig
from miles_k3.weight_sync.push import SyncError
from miles_k3.weight_sync.sglang import Parity, SGLangChannel

PROBE = [256, 49, 53, 45, 52, 51, 61, 49, 50]


def _channel(qwen3_dir, std=0.05, engine_kw=None, **cfg):
    """(trainer, engine, channel): the trainer's policy with random B of std `std`, an engine over the double's own
    copy (another adapter until the trainer's is loaded), and a channel configured by SGLangConfig(**cfg)."""
    trainer = hf_policy(qwen3_dir, LORA, seed=0, std=std)
    engine = double_engine(model=policy(qwen3_dir, seed=1), **(engine_kw or {}))
    engine.load_lora_adapter_from_tensors("policy", peft_of(trainer), LORA)
    cfg = SGLangConfig(**({"verify_push": "every", "parity_tolerance": 1e-3} | cfg))
    return trainer, engine, SGLangChannel(engine, "policy", cfg, probe_ids=PROBE,
                                          trainer_logprobs=lambda ids: trainer_logprobs(trainer, ids),
                                          trainer_base_logprobs=lambda ids: trainer_logprobs(trainer, ids, False))


def test_push_is_verified_by_logprob_parity(qwen3_dir):
    trainer, engine, channel = _channel(qwen3_dir)
    with torch.no_grad():
        for p in lora_parameters(trainer).values():
            p.add_(0.01)  # an optimizer step
    report = channel.push(peft_of(trainer), version=1)
    assert report.parity is not None and report.parity.gap < 1e-5  # same fp32 math on both sides
    assert engine.serving("policy") == "policy@v1" and report.metrics()["sync/parity_logprob_abs_diff"] < 1e-5
    # a push whose tensors do not act as the trainer's (here: layouts swapped) is refused and never served
    bad = peft_of(trainer)
    a_key = next(k for k in bad if k.endswith("q_proj.lora_B.weight"))
    bad[a_key] = bad[a_key].flip(0)
    with pytest.raises(SyncError, match="differ from the trainer's by .* nats/token"):
        channel.push(bad, version=2)
    assert engine.serving("policy") == "policy@v1" and "policy@v2" not in engine.engine.adapters
    assert engine.weight_version == 1


def test_failed_or_bad_pushes_leave_the_served_version(qwen3_dir):
    trainer, engine, channel = _channel(qwen3_dir, verify_push="every_n", engine_kw={"fail_load": "@v3"})
    assert channel.push(peft_of(trainer), version=1).parity.inconclusive is False
    checks = len(engine.engine.calls_of("generate"))
    channel.push(peft_of(trainer), version=2)  # verify_every=10 after a conclusive check: no probe
    assert len(engine.engine.calls_of("generate")) == checks
    with pytest.raises(SyncError, match=r"failed in sglang: RuntimeError: sglang load_lora_adapter_from_tensors\(policy@v3\) "
                       "failed: simulated load failure"):
        channel.push(peft_of(trainer), version=3)
    nan = peft_of(trainer)
    key = next(iter(nan))
    nan[key] = torch.full_like(nan[key], float("nan"))
    with pytest.raises(SyncError, match="non-finite") as err:
        channel.push(nan, version=4)
    assert err.value.tensor == key
    with pytest.raises(SyncError, match="versions only move forward"):
        channel.push(peft_of(trainer), version=2)
    assert engine.serving("policy") == "policy@v2" and sorted(engine.engine.adapters) == ["policy@v2"]


def test_a_failing_parity_probe_refuses_the_push(qwen3_dir):
    trainer, engine, channel = _channel(qwen3_dir)

    def broken(ids, adapter):
        raise RuntimeError("probe request aborted")

    engine.prompt_logprobs = broken
    with pytest.raises(SyncError, match="the parity probe failed .RuntimeError: probe request aborted."):
        channel.push(peft_of(trainer), version=1)
    assert engine.serving("policy") == "policy@v0" and sorted(engine.engine.adapters) == ["policy@v0"]


def _mean_abs(xs, ys):
    return sum(abs(x - y) for x, y in zip(xs, ys)) / len(xs)


def test_parity_probe_by_hand():
    """completions: prompt, its completion, the next prompt, ... cut at the length (starting over when the prompts
    run out); prompts are taken until they alone would fill it; prompt: the first prompt repeated."""
    from miles_k3.weight_sync.sglang import parity_probe

    asked = []

    def complete(prompts, max_new):
        asked.append((prompts, max_new))
        return [[70 + i] * (2 - i) for i in range(len(prompts))]  # 2, 1 and 0 tokens

    assert parity_probe("completions", 10, [[1, 2, 3], [4, 5], [6]], complete) == [1, 2, 3, 70, 70, 4, 5, 71, 6, 1]
    assert asked == [([[1, 2, 3], [4, 5], [6]], 10)]  # 3 + 2 + 1 < 10: all three, then from the start
    assert parity_probe("completions", 5, [[1, 2, 3], [4, 5], [6]], complete) == [1, 2, 3, 70, 70]
    assert asked[-1] == ([[1, 2, 3], [4, 5]], 5)  # 3 + 2 fill 5: the third prompt is not asked for
    assert parity_probe("prompt", 7, [[1, 2, 3], [4]]) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError, match=r"first training prompt has 3 tokens, >= sglang.probe_tokens=3.*e\.g\. 67"):
        parity_probe("completions", 3, [[1, 2, 3]], complete)
    with pytest.raises(ValueError, match="1 completions for 2 prompts"):
        parity_probe("completions", 5, [[1, 2, 3], [4, 5]], lambda p, n: [[9]])
    with pytest.raises(ValueError, match="sglang.probe: 'rollout' is not one of completions, prompt"):
        parity_probe("rollout", 5, [[1]])


def test_parity_rule_on_hand_worked_values():
    """Four probe tokens, base log-probs b = d; the trainer's adapter moves them by (0.4, -0.4, 0.2, -0.2), so its
    effect is 0.3 nats/token; an engine at half scale moves them by half that."""
    d = [-2.0, -3.0, -1.0, -4.0]
    c = [-1.6, -3.4, -0.8, -4.2]
    half = Parity.of([-1.8, -3.2, -0.9, -4.1], d, c, d, min_effect=0.01)
    assert half.gap == pytest.approx(0.15) and half.base_gap == 0.0 and half.floor == 0.01
    assert half.effect_trainer == pytest.approx(0.3) and half.effect_engine == pytest.approx(0.15)
    assert half.effect_diff == pytest.approx(0.15) and not half.inconclusive
    assert "0.15 (> 0.25 x the trainer's effect)" in half.refusal(tolerance=0.2)  # 0.15 > 0.25 * 0.3
    assert "differ from the trainer's by 0.15 nats/token" in half.refusal(tolerance=0.1)
    faithful = Parity.of([-1.61, -3.39, -0.8, -4.2], d, c, d, min_effect=0.01)
    assert faithful.effect_diff == pytest.approx(0.005) and faithful.refusal(tolerance=0.05) is None
    # the engine and the trainer disagree on the base by 0.1 nats/token: an effect of 0.3 is below the floor
    # (10 x 0.1), so even an engine that drops the adapter (a = b) is served, flagged inconclusive
    b = [-2.1, -2.9, -1.1, -3.9]
    dropped = Parity.of(b, b, c, d, min_effect=0.01)
    assert dropped.base_gap == pytest.approx(0.1) and dropped.floor == pytest.approx(1.0)
    assert dropped.inconclusive and dropped.refusal(tolerance=0.5) is None
    assert dropped.metrics()["sync/parity_inconclusive"] == 1.0
    # a model on which they already differ by 0.45 (a random-init MoE's flipped routes): the gap is judged beyond
    # that; an adapter the engine applies where the trainer's does nothing adds 0.2 to it and is refused
    far = [-2.45, -2.55, -1.45, -3.55]
    same = Parity.of(far, far, d, d, min_effect=0.01)
    assert same.gap == pytest.approx(0.45) and same.base_gap == pytest.approx(0.45) and same.inconclusive
    assert same.refusal(tolerance=0.05) is None
    stray = Parity.of([-2.65, -2.35, -1.65, -3.35], far, d, d, min_effect=0.01)
    assert stray.gap == pytest.approx(0.65) and stray.effect_engine == pytest.approx(0.2)
    assert "by 0.65 nats/token on the probe, 0.2 more than on the base (0.45;" in stray.refusal(tolerance=0.05)
    assert stray.refusal(tolerance=0.25) is None


@pytest.mark.parametrize("scale", [0.0, 0.5, 2.0])
def test_an_adapter_the_engine_drops_or_misscales_is_refused(qwen3_dir, scale):
    """An engine that ignores the pushed adapter (scale 0) or applies it at half / double scale, with an adapter
    whose effect is conclusive (> parity_min_effect) yet so small that |engine - trainer| alone stays under
    parity_tolerance: the effect check refuses the push and the engine keeps serving the previous version."""
    trainer, engine, channel = _channel(qwen3_dir, std=0.0, verify_push="every_n", parity_tolerance=0.05)
    first = channel.push(peft_of(trainer), version=1)  # B = 0: the adapter has no effect to check
    assert first.metrics()["sync/parity_inconclusive"] == 1.0
    engine.engine.adapter_scale = scale  # from here on the engine mis-loads what it is pushed
    set_lora_b(trainer, 0.008)
    effect = _mean_abs(trainer_logprobs(trainer, PROBE), trainer_logprobs(trainer, PROBE, adapter=False))
    assert 0.015 < effect < 0.035, effect  # conclusive; at double scale |a - c| ~ effect < 0.05
    with pytest.raises(SyncError, match=r"push of version 2 refused: the adapter moves the engine's log-probs by "
                       r".* SGLang dropped or mis-scaled the adapter .* keeps serving version 1"):
        channel.push(peft_of(trainer), version=2)  # verified: the last check was inconclusive
    assert engine.serving("policy") == "policy@v1" and engine.weight_version == 1
    assert sorted(engine.engine.adapters) == ["policy@v1"]
    engine.engine.adapter_scale = 1.0  # the fault fixed: the push after a refusal is verified, and passes
    third = channel.push(peft_of(trainer), version=3)
    assert third.parity is not None and not third.parity.inconclusive and engine.serving("policy") == "policy@v3"


def test_a_faithful_push_reports_the_adapter_effect(qwen3_dir, tmp_path):
    """The effect metrics of a faithful push against PEFT's own LoRA on transformers' Qwen3 (the adapter saved and
    loaded as a PEFT adapter; disable_adapter for the base): an independent computation of c and d."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_k3.model.adapter import save_adapter

    trainer, engine, channel = _channel(qwen3_dir, std=0.05, verify_push="every_n", parity_tolerance=0.05)
    report = channel.push(peft_of(trainer), version=1)
    save_adapter(trainer, LORA, tmp_path / "adapter", base_model_name_or_path=str(qwen3_dir))
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32),
                                    str(tmp_path / "adapter")).eval()
    ids = torch.tensor([PROBE])

    def logprobs():
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids[:, :-1]).logits.float(), -1)
        return logp[0].gather(-1, ids[0, 1:, None])[:, 0].tolist()

    with_adapter = logprobs()
    with ref.disable_adapter():
        base = logprobs()
    effect = _mean_abs(with_adapter, base)
    m = report.metrics()
    assert effect > 0.05  # well above the floor (parity_min_effect=0.01; the fp32 base gap is ~0)
    assert m["sync/parity_effect_trainer"] == pytest.approx(effect, abs=1e-5)
    assert m["sync/parity_effect_engine"] == pytest.approx(effect, abs=1e-5)
    assert m["sync/parity_effect_diff"] < 1e-5 and m["sync/parity_logprob_abs_diff"] < 1e-5
    assert m["sync/parity_base_abs_diff"] < 1e-5 and m["sync/parity_inconclusive"] == 0.0
    assert engine.serving("policy") == "policy@v1"


def _pushes(channel, trainer, versions):
    """The versions among `versions` whose push was verified (a refused push counts as verified)."""
    verified = []
    for v in versions:
        try:
            if channel.push(peft_of(trainer), version=v).parity is not None:
                verified.append(v)
        except SyncError:
            verified.append(v)
    return verified


def test_verify_every_n_checks_push_1_then_every_nth(qwen3_dir):
    """verify_every=3 with conclusive checks: pushes 1, 4, 7, 10; push 10 is refused (an engine that drops the
    adapter), so push 11 is verified, then 14."""
    trainer, engine, channel = _channel(qwen3_dir, std=0.05, verify_push="every_n", verify_every=3)
    assert _pushes(channel, trainer, range(1, 10)) == [1, 4, 7]
    assert len(engine.engine.calls_of("generate")) == 2 * 3  # each check: the staged version and the base
    engine.engine.adapter_scale = 0.0
    with pytest.raises(SyncError, match="push of version 10 refused"):
        channel.push(peft_of(trainer), version=10)
    engine.engine.adapter_scale = 1.0
    assert _pushes(channel, trainer, range(11, 15)) == [11, 14]
    assert engine.serving("policy") == "policy@v14" and channel.pushes == 13
    quiet = SGLangChannel(engine, "policy", SGLangConfig(verify_push="never"))  # needs no probe
    calls = len(engine.engine.calls_of("generate"))
    assert quiet.push(peft_of(trainer), version=15).parity is None
    assert len(engine.engine.calls_of("generate")) == calls


def test_an_inconclusive_check_makes_the_next_push_verified(qwen3_dir):
    """B = 0 (the first pushes of a run): the adapter changes nothing, so the check cannot decide; pushes are
    verified until a check is conclusive (push 3, once B is non-zero), then every verify_every-th (6)."""
    trainer, engine, channel = _channel(qwen3_dir, std=0.0, verify_push="every_n", verify_every=3,
                                        parity_tolerance=0.05)
    reports = {v: channel.push(peft_of(trainer), version=v) for v in (1, 2)}
    set_lora_b(trainer, 0.05)
    reports |= {v: channel.push(peft_of(trainer), version=v) for v in range(3, 8)}
    checked = {v: r.metrics()["sync/parity_inconclusive"] for v, r in reports.items() if r.parity is not None}
    assert checked == {1: 1.0, 2: 1.0, 3: 0.0, 6: 0.0}
    m = reports[1].metrics()  # B = 0: trainer and engine with the adapter are exactly their bases
    assert m["sync/parity_effect_trainer"] == 0.0 and m["sync/parity_effect_engine"] == 0.0
    assert engine.serving("policy") == "policy@v7"

