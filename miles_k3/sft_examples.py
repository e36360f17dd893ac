"""SFT's training examples from problems: a prompt as the RL rollouts tokenize it plus the gold answer and eos
(`encode_example`, `encode_batch`), or, with `transcripts=guess_*`, a multi-turn transcript of the guess
environment played by an imperfect policy (`guess_transcript`). `encode_examples` picks by the config."""
from __future__ import annotations

import random
import re

from miles_k3.envs.env import Guess
from miles_k3.evals.problems import DatasetError, Problem
from miles_k3.evals.templates import render_prompt
from miles_k3.trainer.batch import Sample


def encode_example(problem: Problem, template: str, tokenizer, eos_id: int) -> Sample:
    """One training example: prompt ids as the RL rollouts tokenize them (the template's text, no special
    tokens added), target ids = the gold answer's tokens + eos."""
    return encode_batch([problem], template, tokenizer, eos_id)[0]


def encode_batch(problems: list[Problem], template: str, tokenizer, eos_id: int) -> list[Sample]:
    """`encode_example` of every problem, the texts tokenized in two batched calls (a fast tokenizer spreads them
    over the host's cores: `benchmarks/bench_sft_encode.py`). The ids are the same as one `tokenizer.encode` per
    text."""
    if not problems:
        return []
    prompts = tokenizer([render_prompt(template, p.problem, tokenizer) for p in problems],
                        add_special_tokens=False)["input_ids"]
    targets = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    for p, ids in zip(problems, prompts):
        if not ids:
            raise DatasetError(f"problem {p.id}: its prompt under template '{template}' is empty; a target "
                               "needs a prompt token before it (fix the data, or use another template)")
    return [Sample(list(prompt), list(target) + [eos_id]) for prompt, target in zip(prompts, targets)]


_RANGE = re.compile(r"from (-?\d+) to (-?\d+)")
NOISY_BISECT_P = 0.5
"""transcripts=guess_noisy_bisect and guess_passes: the share of turns that guess the middle of the allowed numbers."""
PASS_P = 0.4
"""transcripts=guess_passes: the share of turns that pass (" pass": no number, a lost turn)."""
GUESS_TRANSCRIPTS = {"guess_random": (0.0, 0.0), "guess_noisy_bisect": (NOISY_BISECT_P, 0.0),
                     "guess_passes": (NOISY_BISECT_P, PASS_P)}
"""transcripts=NAME -> (bisect_p, pass_p) of `guess_transcript`."""
PASS_TEXT = " pass"


def guess_transcript(problem: Problem, tokenizer, eos_id: int, max_turns: int, rng: random.Random,
                     bisect_p: float = 0.0, pass_p: float = 0.0) -> Sample:
    """One multi-turn example of env=guess played by an imperfect policy: each turn guesses uniformly at random
    among the numbers the feedback so far allows (the range is read from the problem text, "from 1 to 16"), or,
    with probability `bisect_p`, their middle ((lo + hi) // 2: a noisy bisection), until the environment says found
    or `max_turns` turns are played. With probability `pass_p` a turn instead passes (" pass": no number, so the
    environment answers " not a number" and the turn is lost, as a malformed action is). Token in / token out,
    as `trainer.episodes` builds an episode: the prompt is the environment's reset text; each turn is the guess's text (" 7") + eos, loss mask
    1; each observation is the environment's own text (" higher\n"), tokenized on its own and appended as ids,
    loss mask 0; no observation after the last turn."""
    env = Guess()
    prompt = tokenizer.encode(env.reset(problem, rng), add_special_tokens=False)
    m = _RANGE.search(problem.problem)
    if m is None:
        raise DatasetError(f"problem {problem.id}: transcripts=guess_random reads the range from the problem text "
                           f"('from 1 to 16'), got {problem.problem!r}")
    lo, hi = int(m.group(1)), int(m.group(2))
    ids: list[int] = []
    mask: list[int] = []
    for turn in range(1, max_turns + 1):
        guess = None
        if pass_p and rng.random() < pass_p:
            text = PASS_TEXT
        else:
            if lo > hi:
                guess = lo
            elif bisect_p and rng.random() < bisect_p:
                guess = (lo + hi) // 2
            else:
                guess = rng.randint(lo, hi)
            text = f" {guess}"
        turn_ids = tokenizer.encode(text, add_special_tokens=False) + [eos_id]
        ids += turn_ids
        mask += [1] * len(turn_ids)
        res = env.step(text)
        if res.done or turn == max_turns:
            break
        obs = tokenizer.encode(res.observation, add_special_tokens=False)
        ids += obs
        mask += [0] * len(obs)
        if res.observation.strip() == "higher":
            lo = guess + 1
        elif res.observation.strip() == "lower":
            hi = guess - 1
    return Sample(prompt, ids, loss_mask=mask)


def encode_examples(problems: list[Problem], cfg, tokenizer, eos_id: int) -> dict[int, Sample]:
    """Every problem's training example, by id(problem): `encode_example` (transcripts=none), or a transcript of
    the environment (`guess_transcript`, seeded by cfg.seed and the problem's id)."""
    if cfg.transcripts in GUESS_TRANSCRIPTS:
        bisect_p, pass_p = GUESS_TRANSCRIPTS[cfg.transcripts]
        return {id(p): guess_transcript(p, tokenizer, eos_id, cfg.env.max_turns, random.Random(f"{cfg.seed}:{p.id}"),
                                        bisect_p, pass_p) for p in problems}
    return {id(p): s for p, s in zip(problems, encode_batch(problems, cfg.template, tokenizer, eos_id))}
