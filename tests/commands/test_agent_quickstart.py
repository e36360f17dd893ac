"""The agent quickstart (`recipe=agent_quickstart`): guess-the-number problems with a held-out split
(`data.source=guess`, evals/guess.py), the k3_nano_guess base SFT'd on transcripts of an imperfect guessing policy
(`transcripts=guess_passes` / `guess_noisy_bisect` / `guess_random`, miles_k3/sft.py), episode-level evals
(trainer/episode_eval.py), and a shortened run of the recipe whose held-out success must rise (see MIN_GAIN)."""
import json

import pytest

from miles_k3.config import compose_config, to_typed
from miles_k3.envs.env import EnvConfig, build_env
from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.harness import EvalConfig
from miles_k3.evals.problems import DatasetError, Problem
from miles_k3.model.build import ModelConfig, build_tokenizer
from miles_k3.rollout.api import EngineCapabilities
from miles_k3.sft_examples import guess_transcript
from miles_k3.trainer.episode_eval import evaluate_episodes
from miles_k3.trainer.episodes import Episode, first_prompt, run_turns
from miles_k3.trainer.rollouts import RolloutConfig

GUESS_BASE = "builtin:k3_nano_guess"


def _pairs(split, size, seed=0, distinct=True, **task_args):
    cfg = DatasetConfig(source="guess", split=split, size=size, seed=seed, distinct=distinct, task_args=task_args)
    return [(p.problem, p.answer) for p in load_problems(cfg)]


# ---- the data source ---------------------------------------------------------------------------------------------
def test_guess_rows_are_the_env_prompt_and_the_secret():
    rows = _pairs("train", 50, min_n=8, max_n=8, distinct=False)
    assert {q for q, _ in rows} == {"Guess my number from 1 to 8:"}
    assert {int(a) for _, a in rows} <= set(range(1, 9))
    assert _pairs("train", 20, seed=3, distinct=False) == _pairs("train", 20, seed=3, distinct=False)  # seeded
    assert _pairs("train", 20, seed=3, distinct=False) != _pairs("train", 20, seed=4, distinct=False)


def test_held_out_split_is_disjoint_from_every_training_draw():
    """The ranges 1..8 .. 1..12 hold 8 + 9 + 10 + 11 + 12 = 50 (range, secret) pairs. Every range is in one split
    only (a held-out prompt never appears in training), the two splits' distinct pairs are disjoint and together
    make all 50, a pair more of either split does not exist, and 20 seeds' worth of training draws never produce a
    held-out prompt."""
    args = {"min_n": 8, "max_n": 12}
    everything = {(f"Guess my number from 1 to {n}:", str(s)) for n in range(8, 13) for s in range(1, n + 1)}
    assert len(everything) == 50
    test = None
    for k in range(1, 51):
        try:
            test = set(_pairs("test", k, **args))
        except DatasetError:
            break
    k_test = len(test)
    train = set(_pairs("train", 50 - k_test, **args))
    assert train.isdisjoint(test) and train | test == everything
    test_prompts, train_prompts = {q for q, _ in test}, {q for q, _ in train}
    assert test_prompts and train_prompts and test_prompts.isdisjoint(train_prompts)
    for q in test_prompts:  # a held-out range's every secret is held out
        assert {a for p, a in test if p == q} == {str(s) for s in range(1, int(q.split()[-1][:-1]) + 1)}
    with pytest.raises(DatasetError, match="distinct"):
        _pairs("train", 51 - k_test, **args)
    for seed in range(20):
        assert {q for q, _ in _pairs("train", 200, seed=seed, distinct=False, **args)}.isdisjoint(test_prompts)


def test_bad_guess_source_args_fail_clearly():
    with pytest.raises(DatasetError, match="takes min_n, max_n, not max"):
        _pairs("train", 5, max=10)
    with pytest.raises(DatasetError, match="1 <= min_n <= max_n"):
        _pairs("train", 5, min_n=9, max_n=8)
    with pytest.raises(DatasetError, match="integer"):
        _pairs("train", 5, min_n="8")
    with pytest.raises(DatasetError, match="splits train, test"):
        _pairs("validation", 5)


def test_bad_env_and_sft_settings_fail_clearly():
    with pytest.raises(ValueError, match="'riddle' is not a registered environment"):
        to_typed(compose_config("train", ["recipe=agent_quickstart", "env.name=riddle"]))
    with pytest.raises(ValueError, match=r"transcripts=guess_\* plays env=guess"):
        to_typed(compose_config("sft", ["recipe=guess_base", "env.name=single", "env.max_turns=1"]))
    with pytest.raises(ValueError, match="transcripts: 'bisect' is not one of none, guess_random, guess_noisy_bisect"):
        to_typed(compose_config("sft", ["recipe=guess_base", "transcripts=bisect"]))


# ---- SFT transcripts: token in, token out --------------------------------------------------------------------------
class Scripted:
    """A random.Random stand-in for the transcript policy: randint returns the scripted guesses in turn and records
    the range it was asked for."""

    def __init__(self, guesses):
        self.guesses, self.asked = list(guesses), []

    def randint(self, lo, hi):
        self.asked.append((lo, hi))
        return self.guesses.pop(0)

    def random(self):
        return 0.0  # below any bisect_p > 0: the noisy bisection takes the middle


class ScriptedEngine:
    """Answers call k's request r with `script[k][r]` (token ids, EOS included); records the prompts."""

    max_context = 96
    capabilities = EngineCapabilities()  # it only generates: every turn is prefilled whole

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, input_ids, sampling_params=None, n=1, return_logprob=True, lora=None,
                 return_routed_experts=False):
        k = len(self.calls)
        self.calls.append([list(x) for x in input_ids])
        outs = []
        for i in range(len(input_ids)):
            for j in range(n):
                toks = list(self.script[k][i * n + j])
                meta = {"finish_reason": {"type": "stop", "matched": toks[-1]}, "weight_version": 0,
                        "weight_versions": [0], "output_token_logprobs": [(-0.5, t) for t in toks]}
                outs.append({"output_ids": toks, "meta_info": meta})
        return outs


@pytest.fixture(scope="module")
def tok():
    tokenizer, stops = build_tokenizer(ModelConfig(path=GUESS_BASE))
    return tokenizer, stops[0]


def test_transcript_follows_the_feedback_and_masks_observations(tok):
    tokenizer, eos = tok
    p = Problem("p", "Guess my number from 1 to 8:", "5")
    rng = Scripted([3, 6, 5])
    s = guess_transcript(p, tokenizer, eos, 5, rng)
    assert rng.asked == [(1, 8), (4, 8), (4, 5)]  # after 3 "higher": 4..8; after 6 "lower": 4..5
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)
    assert s.prompt_ids == enc("Guess my number from 1 to 8:")
    assert s.response_ids == enc(" 3") + [eos] + enc(" higher\n") + enc(" 6") + [eos] + enc(" lower\n") + enc(" 5") + [eos]
    assert s.loss_mask == [1, 1, 1] + [0] * 8 + [1, 1, 1] + [0] * 7 + [1, 1, 1]  # byte tokens: " 3" is 2, +eos
    # at max_turns the transcript stops after the last guess, with no observation
    s2 = guess_transcript(p, tokenizer, eos, 2, Scripted([1, 2]))
    assert s2.response_ids == enc(" 1") + [eos] + enc(" higher\n") + enc(" 2") + [eos]


def test_noisy_bisection_transcript_takes_the_middle(tok):
    """bisect_p=1 (and a draw below it every turn): 1..8, secret 5: 4 (middle of 1..8) -> higher, 6 (of 5..8) ->
    lower, 5 (of 5..5) found."""
    tokenizer, eos = tok
    s = guess_transcript(Problem("p", "Guess my number from 1 to 8:", "5"), tokenizer, eos, 5, Scripted([]), 1.0)
    assert tokenizer.decode(s.response_ids, skip_special_tokens=True) == " 4 higher\n 6 lower\n 5"


class Draws(Scripted):
    """Scripted guesses and scripted random() draws."""

    def __init__(self, guesses, draws):
        super().__init__(guesses)
        self.draws = list(draws)

    def random(self):
        return self.draws.pop(0)


def test_passing_transcript_loses_the_turns_it_passes(tok):
    """pass_p 0.4, bisect_p 0.5, 1..8, secret 5. Turn 1: draw 0.3 < 0.4: pass. Turn 2: 0.7 (no pass), 0.2 < 0.5:
    the middle of 1..8, 4 -> higher. Turn 3: 0.5, 0.9 (no bisection): a random one of 5..8, scripted 6 -> lower.
    Turn 4: 0.1: pass. Turn 5: 0.6, 0.3: the middle of 5..5, found. A pass is the text " pass", trained on (mask 1);
    the environment's " not a number" is not."""
    tokenizer, eos = tok
    rng = Draws([6], [0.3, 0.7, 0.2, 0.5, 0.9, 0.1, 0.6, 0.3])
    s = guess_transcript(Problem("p", "Guess my number from 1 to 8:", "5"), tokenizer, eos, 5, rng, 0.5, 0.4)
    assert tokenizer.decode(s.response_ids, skip_special_tokens=True) == \
        " pass not a number\n 4 higher\n 6 lower\n pass not a number\n 5"
    assert rng.asked == [(5, 8)] and rng.draws == []
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)
    assert s.response_ids[:len(enc(" pass")) + 1 + len(enc(" not a number\n"))] == \
        enc(" pass") + [eos] + enc(" not a number\n")
    assert s.loss_mask[:6 + 14] == [1] * 6 + [0] * 14  # " pass" is 5 byte tokens + eos; the observation 14 bytes


def test_guess_env_counts_repeated_wrong_guesses():
    """Secret 5 of 1..8: 3 (higher), 3 again (a repeat), x (invalid, not a repeat), 6 (lower), 3 (a repeat), 5
    (found): repeats 2 in all, invalid 1."""
    env = build_env(EnvConfig(name="guess", max_turns=9))()
    env.reset(Problem("p", "Guess my number from 1 to 8:", "5"), None)
    infos = [env.step(t) for t in (" 3", " 3", " x", " 6", " 3")]
    assert [r.observation for r in infos] == [" higher\n", " higher\n", " not a number\n", " lower\n", " higher\n"]
    assert sum(r.info.get("repeats", 0.0) for r in infos) == 2 and [r.info for r in infos][1] == {"repeats": 1.0}
    assert sum(r.info.get("invalid", 0.0) for r in infos) == 1
    last = env.step(" 5")
    assert (last.done, last.reward) == (True, 1.0)


def test_transcript_tokens_equal_the_episode_of_the_same_guesses(tok):
    """The same guesses played by the engine through trainer/episodes.py give the same ids and loss mask."""
    tokenizer, eos = tok
    p = Problem("p", "Guess my number from 1 to 20:", "13")
    guesses = [10, 15, 12, 13]
    s = guess_transcript(p, tokenizer, eos, 5, Scripted(list(guesses)))
    cfg = EnvConfig(name="guess", max_turns=5)
    env = build_env(cfg)()
    prompt = tokenizer.encode(first_prompt(env, p, 0, 0, "plain", tokenizer), add_special_tokens=False)
    turns = [[tokenizer.encode(f" {g}", add_special_tokens=False) + [eos]] for g in guesses]
    engine = ScriptedEngine(turns[1:])
    ep = Episode(env, prompt, 0)
    ep.add_turn(ScriptedEngine(turns[:1]).generate([prompt])[0])
    run_turns(engine, tokenizer, [ep], RolloutConfig(max_new_tokens=6, template="plain"), cfg, None, False)
    assert (ep.prompt, ep.ids, ep.mask) == (s.prompt_ids, s.response_ids, s.loss_mask)
    assert ep.end == "done" and ep.reward == 1.0


# ---- episode-level evals -------------------------------------------------------------------------------------------
def test_episode_eval_scores_success_turns_and_invalid_turns(tok, tmp_path):
    """Two problems (secrets 3 of 1..4 and 2 of 1..4), two episodes each, max_turns 3:
    p0 e0: 2 -> higher, 3 found (2 turns, success); p0 e1: 1 -> higher, "x" (invalid), 4 -> lower: out of turns;
    p1 e0: 2 found (1 turn); p1 e1: 3 -> lower, 1 -> higher, 2 found (3 turns).
    avg@2 = mean(0.5, 1.0) = 0.75, se = std([0.5, 1], ddof=1) / sqrt(2) = 0.25; turns 2.25 (per problem 2.5, 2);
    invalid turns 1 of 9; answer_rate 3 of 4 (the episode with the invalid turn is not well formed)."""
    tokenizer, eos = tok
    t = lambda x: tokenizer.encode(x, add_special_tokens=False) + [eos]
    problems = [Problem("a", "Guess my number from 1 to 4:", "3"), Problem("b", "Guess my number from 1 to 4:", "2")]
    engine = ScriptedEngine([[t(" 2"), t(" 1"), t(" 2"), t(" 3")],  # the first turns, 2 forks of each problem
                             [t(" 3"), t(" x"), t(" 1")],  # the live episodes: a0, a1, b1
                             [t(" 4"), t(" 2")]])  # a1, b1
    cfg = EvalConfig(samples=2, max_new_tokens=6, template="plain", grader="integer", temperature=1.0)
    env_cfg = EnvConfig(name="guess", max_turns=3)
    r = evaluate_episodes(engine, tokenizer, problems, cfg, (build_env(env_cfg), env_cfg))
    m = r.metrics()
    assert m["eval/avg@2"] == pytest.approx(0.75) and m["eval/avg@2_se"] == pytest.approx(0.25)
    assert m["eval/turns_mean"] == pytest.approx(2.25)
    assert m["eval/invalid_turn_rate"] == pytest.approx(1 / 9) and m["eval/env/invalid"] == pytest.approx(0.25)
    assert m["eval/answer_rate"] == pytest.approx(0.75)
    assert m["eval/end_done_rate"] == pytest.approx(0.75) and m["eval/end_max_turns_rate"] == pytest.approx(0.25)
    assert [rec.turns for rec in r.records] == [2, 3, 1, 3]
    assert r.records[1].response == " 1[EOS] higher\n x[EOS] not a number\n 4[EOS]"  # the tokens, stop tokens too


# ---- the recipe learns -------------------------------------------------------------------------------------------
QUICK = ["steps=20", "trainer.optim.total_steps=40", "eval.every_n_steps=20"]
"""The first 20 of the recipe's 40 steps (its schedule: cosine over 40), evaluated at steps 0 and 20: the measured
runs' own first half."""
MAX_INVALID_RATIO = 0.5
MIN_GAIN = 0.03
"""Measured on 2 shared cores, one thread (benchmarks/results/agent_quickstart_seeds.json; seeds 0, 1, 2 of the
recipe): by step 20 held-out success rose from 14.75% by +8.25, +6.25 and +7.0 points (paired standard errors 2.0,
2.3, 2.2) and the invalid-turn rate fell from 38.6% to 9.7%, 9.2%, 10.3% (ratios 0.25 to 0.27: the bar 0.5 is
above the worst). The bar of 3 points is the smallest seed gain less 1.4 of its standard error, and 1.3 standard
errors above no gain."""


@pytest.mark.slow
def test_shortened_agent_quickstart_raises_held_out_success_and_stops_passing(tmp_path):
    import torch

    from miles_k3.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: more OpenMP threads only contend (~25x slower here)
    try:
        cfg = compose_config("train", ["recipe=agent_quickstart", *QUICK, f"run_dir={tmp_path}/run"])
        s = train(cfg, "").summary
    finally:
        torch.set_num_threads(threads)
    assert (s["accuracy_metric"], s["accuracy_before_step"]) == ("avg@4", 0)
    assert s["accuracy_after"] - s["accuracy_before"] >= MIN_GAIN, s
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/avg@4" in r}
    assert sorted(evals) == [0, 20] and all("eval/turns_mean" in r for r in evals.values())
    assert evals[20]["eval/invalid_turn_rate"] <= MAX_INVALID_RATIO * evals[0]["eval/invalid_turn_rate"], evals


def test_episode_eval_grades_a_final_turn_left_to_the_reward(tok):
    """env=single's one turn is left to the grader (StepResult.reward None): "7" and "8" against the gold 7 score
    1 and 0 under eval.grader=integer: avg@2 0.5, one turn each, both well formed."""
    tokenizer, eos = tok
    t = lambda x: tokenizer.encode(x, add_special_tokens=False) + [eos]
    engine = ScriptedEngine([[t("7"), t("8")]])
    cfg = EvalConfig(samples=2, max_new_tokens=6, template="plain", grader="integer")
    r = evaluate_episodes(engine, tokenizer, [Problem("a", "3+4=", "7")], cfg, (build_env(EnvConfig()), EnvConfig()))
    m = r.metrics()
    assert (m["eval/avg@2"], m["eval/turns_mean"], m["eval/answer_rate"]) == (0.5, 1.0, 1.0)
    assert [rec.score for rec in r.records] == [1.0, 0.0] and [rec.normalized for rec in r.records] == ["7", "8"]
