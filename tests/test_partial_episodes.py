"""Multi-turn episodes in rollout.mode=partial (`PartialRollouts` with env=guess) on the real engine (k3_tiny, fp32,
CPU): a turn that finishes is handed to its environment within the engine's run and the episode's next turn joins
the queue; a step trains on the groups whose episodes have all ended, the others carry across the push (their tokens
spanning weight versions, every token's version recorded); the pool saved after a step and loaded into a fresh
engine continues exactly (environments rebuilt by replaying their turns); `drop` cancels a late group's turns and
sessions."""
import io

import pytest
import torch

from miles_k3.envs.env import EnvConfig, build_env
from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.model.tokenizer import small_tokenizer
from miles_k3.rollout.engine import EngineConfig, RolloutEngine
from miles_k3.trainer.partial import PartialRollouts, check_versions
from miles_k3.trainer.rollouts import PartialConfig, PromptStream, RolloutConfig

LORA = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "w1"])
TOK = small_tokenizer(512)
NEW = 4  # tokens per turn at most; a quarter of the vocabulary stops a turn, so turns and episodes vary in length
STOPS = list(range(0, 512, 4))
PROBLEMS = [Problem(f"g{i}", f"Guess my number from 1 to 9: #{i}", str(1 + i % 9)) for i in range(12)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval().requires_grad_(False)
    apply_lora(m, LORA)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_parameters(m).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _engine(model) -> RolloutEngine:
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=4 * 2**20, max_context=96, page_size=4,
                                               prefill_chunk=8, decode="eager", eos_token_ids=STOPS), lora=LORA)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    return engine


def _pool(engine, policy="wait", inflight=4):
    cfg = RolloutConfig(prompts_per_step=2, group_size=2, template="plain", mode="partial", max_new_tokens=NEW,
                        dynamic_sampling=False,
                        partial=PartialConfig(inflight_groups=inflight, max_staleness=1, policy=policy))
    cfg.validate()
    env_cfg = EnvConfig(name="guess", max_turns=3)
    return PartialRollouts(engine, TOK, PromptStream(PROBLEMS, 0), lambda r, g: [
        RewardResult(0.0, False, {}) for _ in r], cfg, "policy", env=(build_env(env_cfg), env_cfg))


def _push(engine, model, version):
    g = torch.Generator().manual_seed(version)
    engine.update_weights_from_tensor({k: v + torch.randn(v.shape, generator=g) * 0.1
                                       for k, v in lora_state_dict(model).items()}, lora_name="policy")


def _key(s):
    return (s.prompt_ids, s.response_ids, s.loss_mask, s.token_versions, s.rollout_logprobs, s.reward)


def _turn_starts(s):
    return [i for i, m in enumerate(s.loss_mask) if m and (i == 0 or not s.loss_mask[i - 1])]


def test_episodes_carry_across_pushes_and_resume_exactly(model):
    engine = _engine(model)
    pool = _pool(engine)
    steps, saved = [], None
    for version in range(3):
        if version:
            _push(engine, model, version)
        samples, m = pool.collect(version)
        check_versions(samples, version, pool.cfg)
        steps.append((samples, m))
        if version == 0:
            buf = io.BytesIO()
            torch.save(pool.state(), buf)
            saved = buf.getvalue()
    every = [s for samples, _ in steps for s in samples]
    assert all(len(samples) >= 4 and len(samples) % 2 == 0 for samples, _ in steps)  # >= 2 groups of 2 episodes
    for s in every:  # token in, token out: turns of 1 .. NEW sampled tokens, each but the last ended by a stop id
        starts = _turn_starts(s)
        assert 1 <= len(starts) <= 3 and s.loss_mask[0] == 1
        for a, b in zip(starts, starts[1:] + [len(s.loss_mask) + 1]):
            turn = s.response_ids[a:a + sum(s.loss_mask[a:b])]
            assert 1 <= len(turn) <= NEW and all(t not in STOPS for t in turn[:-1])
    spanning = [s for s in every if len(set(s.token_versions)) > 1]
    assert spanning and sum(m["rollout/groups_carried"] for _, m in steps[1:]) > 0
    assert any(m["env/turns_mean"] > 1 for _, m in steps)

    # the pool saved after step 1, loaded into a fresh engine (its first weights, then the same pushes)
    fresh = _engine(model)
    again = _pool(fresh)
    again.load_state(torch.load(io.BytesIO(saved), weights_only=True))
    for version in (1, 2):
        _push(fresh, model, version)
        samples, m = again.collect(version)
        assert [_key(s) for s in samples] == [_key(s) for s in steps[version][0]]
        assert m["rollout/staleness_mean"] == steps[version][1]["rollout/staleness_mean"]


def test_drop_cancels_a_late_groups_turns_and_sessions(model):
    """policy drop, max_staleness 1, 8 groups in flight for a step of 2: a group still in flight two pushes after it
    was queued is past the bound; its turns and engine sessions are cancelled (nothing of it stays queued or
    parked), and no trained token is older than the bound."""
    engine = _engine(model)
    pool = _pool(engine, policy="drop", inflight=8)
    dropped = 0
    for version in range(5):
        if version:
            _push(engine, model, version)
        samples, m = pool.collect(version)
        check_versions(samples, version, pool.cfg)
        dropped += m["rollout/groups_dropped"]
        assert all(version - min(s.token_versions) <= 1 for s in samples)
    queued = set(engine.queued_groups())
    assert {k for k, _ in pool.turns.values()} <= set(pool.groups) and set(pool.turns) <= queued
    assert engine.runner.sessions.num_parked == 0
    assert dropped > 0
