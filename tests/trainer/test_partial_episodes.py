"""Multi-turn episodes in rollout.mode=partial (`PartialRollouts` with env=guess) on the real engine (k3_tiny, fp32,
CPU): a turn that finishes is handed to its environment within the engine's run and the episode's next turn joins
the queue; a step trains on the groups whose episodes have all ended, the others carry across the push (their tokens
spanning weight versions, every token's version recorded); the pool saved after a step and loaded into a fresh
engine continues exactly (environments rebuilt from the answers they gave, recorded in the checkpoint: no step runs
twice); `drop` cancels a late group's turns and kept states; a step past its deadline is cancelled within the run."""
import io
import threading
import time

import pytest
import torch
from engine_helpers import random_adapter, small_engine

from miles_k3.envs.env import EnvConfig, Guess, build_env
from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, lora_state_dict
from miles_k3.model.tokenizer import small_tokenizer
from miles_k3.rollout.engine import RolloutEngine
from miles_k3.trainer.partial import PartialRollouts
from miles_k3.trainer.rollouts import PartialConfig, PromptStream, RolloutConfig
from miles_k3.trainer.staleness import check_versions

LORA = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "w1"])
TOK = small_tokenizer(512)
NEW = 4  # tokens per turn at most; a quarter of the vocabulary stops a turn, so turns and episodes vary in length
STOPS = list(range(0, 512, 4))
PROBLEMS = [Problem(f"g{i}", f"Guess my number from 1 to 9: #{i}", str(1 + i % 9)) for i in range(12)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval().requires_grad_(False)
    random_adapter(m, LORA, seed=1)
    return m


def _engine(model) -> RolloutEngine:
    engine = small_engine(model, LORA, max_context=96, prefill_chunk=8, decode="eager", eos_token_ids=STOPS)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    return engine


def _pool(engine, policy="wait", inflight=4, factory=None, timeout_s=10.0, lag=0):
    """2 groups of 2 a step, `inflight` in flight; env_lag_steps `lag`. Turns here are 1-4 tokens: at lag >= 1 the
    turns that finish late in a step are applied at its end, and here that ends every group in flight (4 groups
    trained, none carried, at lag 1 to 3): lag 0 keeps episodes in flight across pushes."""
    cfg = RolloutConfig(prompts_per_step=2, group_size=2, template="plain", mode="partial", max_new_tokens=NEW,
                        dynamic_sampling=False, partial=PartialConfig(inflight_groups=inflight, max_staleness=1,
                                                                      policy=policy, env_lag_steps=lag))
    cfg.validate()
    env_cfg = EnvConfig(name="guess", max_turns=3, step_timeout_s=timeout_s)
    return PartialRollouts(engine, TOK, PromptStream(PROBLEMS, 0), lambda r, g: [
        RewardResult(0.0, False, {}) for _ in r], cfg, "policy", env=(factory or build_env(env_cfg), env_cfg))


class Counting(Guess):
    """env=guess whose every step appends a line to a file, as a tool with an effect outside the trainer would: the
    file counts the steps that ran."""

    lock = threading.Lock()

    def __init__(self, path):
        self.path, self.seen = path, []

    def step(self, turn):
        with self.lock, open(self.path, "a") as f:
            f.write("step\n")
        res = super().step(turn)
        self.seen.append((turn, res))
        return res

    def replay(self, turn, result):
        super().replay(turn, result)
        self.seen.append((turn, result))


def _lines(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


def _seen(pool):
    """What each live episode's environment was told (turns and answers) and the guesses it remembers."""
    return {(k, j): (list(ep.env.seen), set(ep.env.guessed)) for k, g in pool.groups.items() if g.episodes
            for j, ep in enumerate(g.episodes) if not ep.end}


def _stepped(pool):
    """The turns of the episodes in the pool (each finished turn was stepped once)."""
    return sum(len(ep.outs) for g in pool.groups.values() if g.episodes for ep in g.episodes)


def _push(engine, model, version):
    g = torch.Generator().manual_seed(version)
    engine.update_weights_from_tensor({k: v + torch.randn(v.shape, generator=g) * 0.1
                                       for k, v in lora_state_dict(model).items()}, lora_name="policy")


def _key(s):
    return (s.prompt_ids, s.response_ids, s.loss_mask, s.token_versions, s.rollout_logprobs, s.reward)


def _turn_starts(s):
    mask = s.loss_mask or [1] * len(s.response_ids)  # a one-turn episode's mask is left implicit
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


@pytest.mark.slow
def test_episodes_carry_across_pushes_and_resume_exactly(model, tmp_path):
    """Three steps; the pool saved after the first, with episodes in flight whose turns were stepped, and resumed in a
    fresh engine gives the same samples. Every environment step appends a line to a file: the uninterrupted run's
    count is its episodes' turns (those trained, and those still in the pool), and the resumed run's steps added to
    those that ran before the save make the same count: the resume replayed the recorded answers and ran no step
    again (it used to step every turn of the episodes in flight once more)."""
    engine = _engine(model)
    pool = _pool(engine, factory=lambda: Counting(tmp_path / "run.log"))
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
            before = _lines(tmp_path / "run.log")
            inflight = sum(len(ep.outs) for g in pool.groups.values() if g.episodes for ep in g.episodes if not ep.end)
            seen = _seen(pool)
    every = [s for samples, _ in steps for s in samples]
    assert all(len(samples) >= 4 and len(samples) % 2 == 0 for samples, _ in steps)  # >= 2 groups of 2 episodes
    for s in every:  # token in, token out: turns of 1 .. NEW sampled tokens, each but the last ended by a stop id
        starts = _turn_starts(s)
        mask = s.loss_mask or [1] * len(s.response_ids)
        assert 1 <= len(starts) <= 3 and starts[0] == 0
        for a, b in zip(starts, starts[1:] + [len(mask) + 1]):
            turn = s.response_ids[a:a + sum(mask[a:b])]
            assert 1 <= len(turn) <= NEW and all(t not in STOPS for t in turn[:-1])
    spanning = [s for s in every if len(set(s.token_versions)) > 1]
    assert spanning and sum(m["rollout/groups_carried"] for _, m in steps[1:]) > 0
    assert any(m["env/turns_mean"] > 1 for _, m in steps)

    total = sum(len(_turn_starts(s)) for s in every) + _stepped(pool)
    assert _lines(tmp_path / "run.log") == total and inflight > 0

    # the pool saved after step 1, loaded into a fresh engine (its first weights, then the same pushes)
    fresh = _engine(model)
    again = _pool(fresh, factory=lambda: Counting(tmp_path / "resumed.log"))
    again.load_state(torch.load(io.BytesIO(saved), weights_only=True))
    assert _lines(tmp_path / "resumed.log") == 0  # the episodes in flight were rebuilt without a step
    assert _seen(again) == seen and any(seen.values())  # each live episode's turns and answers, replayed in order
    for version in (1, 2):
        _push(fresh, model, version)
        samples, m = again.collect(version)
        assert [_key(s) for s in samples] == [_key(s) for s in steps[version][0]]
        assert m["rollout/staleness_mean"] == steps[version][1]["rollout/staleness_mean"]
        assert {k: v for k, v in m.items() if k.startswith("env/")} == \
            {k: v for k, v in steps[version][1].items() if k.startswith("env/")}
    assert before + _lines(tmp_path / "resumed.log") == total


@pytest.mark.slow
def test_drop_cancels_a_late_groups_turns_and_kept_states(model):
    """policy drop, max_staleness 1, 8 groups in flight for a step of 2: a group still in flight two pushes after it
    was queued is past the bound; its turns and kept states are cancelled (nothing of it stays queued or
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
    queued = set(engine.queue.queued_groups())
    assert {k for k, _ in pool.turns.values()} <= set(pool.groups) and set(pool.turns) <= queued
    assert engine.runner.kept_states.num_parked == 0
    assert dropped > 0


CANCELLED: list[int] = []


class Hangs(Guess):
    """env=guess whose second step hangs until it is cancelled, on the problems of even number (CANCELLED: the step
    each cancel came in)."""

    def reset(self, problem, rng):
        self.num_steps, self.stop, self.hangs = 0, threading.Event(), int(problem.id[1:]) % 2 == 0
        return super().reset(problem, rng)

    def step(self, turn):
        self.num_steps += 1
        if self.hangs and self.num_steps == 2:
            self.stop.wait(10.0)
        return super().step(turn)

    def cancel(self):
        CANCELLED.append(self.num_steps)
        self.stop.set()


def test_a_step_past_its_deadline_within_the_engines_run_is_cancelled(model):
    """Partial mode steps an environment within the engine's run: a second step hangs past step_timeout_s 0.2, is
    cancelled, and its episode ends env_timeout, out of the loss and counted in env/timeout_rate; the other episodes
    are scored."""
    CANCELLED.clear()
    pool = _pool(_engine(model), factory=Hangs, timeout_s=0.2)
    samples, m = pool.collect(0)
    out = [s for s in samples if not s.in_loss]
    waiting = [ep for g in pool.groups.values() if g.episodes for ep in g.episodes if ep.end == "env_timeout"]
    assert out and len(CANCELLED) == len(out) + len(waiting) and set(CANCELLED) == {2}
    assert m["env/timeout_rate"] == len(out) / len(samples) and len(out) < len(samples)


class Slow(Guess):
    """env=guess whose step sleeps `SLOW.sleep(problem)` seconds, recording how many decode steps the engine ran
    (`SLOW.engine`'s counter) while it slept."""

    def reset(self, problem, rng):
        self.pause = SLOW["sleep"](problem)
        return super().reset(problem, rng)

    def step(self, turn):
        clock = SLOW["engine"].scheduler.timing
        before = clock.decode_steps
        time.sleep(self.pause)
        SLOW["ran"].append(clock.decode_steps - before)
        return super().step(turn)


SLOW: dict = {}


def _slow_run(model, lag: int, sleep, saved: bytes | None = None, steps: int = 3
              ) -> tuple[list, list[int], list[float], bytes]:
    """`steps` steps (pushes between) of a pool of Slow episodes at env_lag_steps `lag` (`saved`: the last two, from
    the pool state saved after the first): the samples' keys, the decode steps run during each environment step,
    perf/env_wait_s, and the pool's state after the first step."""
    engine = _engine(model)
    SLOW.update(engine=engine, sleep=sleep, ran=[])
    pool = _pool(engine, factory=Slow, lag=lag)
    if saved is not None:
        pool.load_state(torch.load(io.BytesIO(saved), weights_only=True))
    keys, waits = [], []
    for version in range(0 if saved is None else 1, steps):
        if version:
            _push(engine, model, version)
        samples, m = pool.collect(version)
        keys += [_key(s) for s in samples]
        waits.append(m["perf/env_wait_s"])
        if version == 0:
            buf = io.BytesIO()
            torch.save(pool.state(), buf)
            saved = buf.getvalue()
    return keys, SLOW["ran"], waits, saved


def test_the_engine_decodes_while_environments_step_and_their_timing_changes_no_sample(model):
    """rollout.partial.env_lag_steps: at 0 the engine waits for each finished turn's environment step (no decode
    step runs while one sleeps 20 ms); at 4 it decodes on while steps run (up to 4 decode steps during one), and
    the samples are the same whether the steps take 0 ms or 0-40 ms (by problem): a decode step count, not the
    steps' end, decides when each next turn joins the queue; a pool saved after step 1 and resumed in a fresh
    engine (steps of 10 ms) continues with the same samples."""
    keys0, ran0, waits0, _ = _slow_run(model, 0, lambda p: 0.02, steps=1)
    assert ran0 and set(ran0) == {0} and all(w > 0 for w in waits0)
    keys4, _, _, saved = _slow_run(model, 4, lambda p: 0.0)
    slow4, ran_slow, _, _ = _slow_run(model, 4, lambda p: 0.01 * (int(p.id[1:]) % 5))
    assert keys4 == slow4 and len(keys4) >= 12  # >= 2 groups of 2 episodes a step
    assert keys4[:len(keys0)] != keys0  # the lag moves when later turns start
    assert max(ran_slow) <= 4 and sum(ran_slow) > 0
    resumed, _, _, _ = _slow_run(model, 4, lambda p: 0.01, saved=saved)  # from the pool saved after step 1
    assert resumed == keys4[-len(resumed):] and len(resumed) >= 8
