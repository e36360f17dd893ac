"""The reasoning recipe's parts on the CPU: worked sums (`evals/worked.py`), their grader and template, the recipe's
refusals, and the SFT pieces its base needs (teacher-forced held-out figures, micro-batched gradients, quantize)."""
import json

import pytest
import torch
from torch import nn

from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.graders import get_grader
from miles_k3.evals.problems import DatasetError
from miles_k3.evals.templates import render_prompt
from miles_k3.evals.worked import generate_rows, question, solution
from miles_k3.trainer.batch import Sample


def test_a_problem_and_its_worked_solution_by_hand():
    terms = [48, 27, -93, 15]
    assert question(terms) == "a+b+c+d with a=48, b=27, c=-93, d=15"
    assert solution(terms) == "a=48\n48 + b=27 = 75\n75 + c=-93 = -18\n-18 + d=15 = -3\nAnswer: -3"
    assert solution([-5, -7]) == "a=-5\n-5 + b=-7 = -12\nAnswer: -12"
    assert question(terms, "chain") == "48 + 27 - 93 + 15"
    assert solution(terms, "chain") == "= 75 - 93 + 15\n= -18 + 15\n= -3\nAnswer: -3"
    assert solution([-5, -7], "chain") == "= -12\nAnswer: -12"  # a negative first term keeps its own sign
    assert render_prompt("worked", question(terms, "chain")) == "Compute step by step: 48 + 27 - 93 + 15\n"


def test_rows_are_reproducible_and_the_splits_disjoint():
    args = {"min_terms": 2, "max_terms": 3, "min_value": 1, "max_value": 9, "form": "chain"}
    train = generate_rows("train", 300, 0, args)
    assert train == generate_rows("train", 300, 0, args)
    test = generate_rows("test", 40, 0, args)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for r in train[:50]:
        terms = [int(t) for t in r["question"].replace("- ", "-").replace("+ ", "").split()]
        assert r["answer"] == str(sum(terms)) and r["terms"] == len(terms) and 2 <= len(terms) <= 3
        assert r["solution"].endswith(f"Answer: {sum(terms)}") and r["solution"].count("\n") == len(terms) - 1


def test_the_default_lengths_are_reasoning_lengths():
    """8-16 terms of 1-49 (the defaults), one token per byte with the small tokenizer. Bounds by hand, with a running
    total |total| <= 16 x 49 = 784 of 1-4 bytes and a term of 1-3 ("-49"). Named (the default): "a=v" (3-4 bytes),
    then n-1 lines "total + x=v = total" of 1+3+2+1+3+1 = 11 to 4+3+2+3+3+4 = 19 bytes, n newlines and "Answer: N";
    a mean near 4 + 11 x 15.5 + 12 + 11 ~ 200 (12 terms, lines of ~15.5 bytes). Chain: n-1 lines "= " + a chain of
    n-1, n-2, ..., 1 numbers, the first 1-4 bytes and each later one " + v" 4-5 bytes."""
    lengths = [len(r["solution"]) for r in generate_rows("train", 500, 0, {})]
    shortest = 3 + 11 * 7 + 8 + len("Answer: 8")  # 8 terms, one-digit
    longest = 4 + 19 * 15 + 16 + len("Answer: -784")  # 16 terms, widest
    assert (shortest, longest) == (97, 317)
    assert shortest <= min(lengths) and max(lengths) <= longest and 150 <= sum(lengths) / len(lengths) <= 260
    lengths = [len(r["solution"]) for r in generate_rows("train", 500, 0, {"form": "chain"})]
    shortest = sum(2 + 1 + 4 * (k - 1) for k in range(1, 8)) + 7 + len("Answer: 8")
    longest = sum(2 + 4 + 5 * (k - 1) for k in range(1, 16)) + 15 + len("Answer: -784")
    assert (shortest, longest) == (121, 642)
    assert shortest <= min(lengths) and max(lengths) <= longest and 250 <= sum(lengths) / len(lengths) <= 450


def test_both_forms_draw_the_same_problems_and_the_same_split():
    """The form changes the text only: the same seed draws the same terms and the same held-out problems."""
    args = {"min_terms": 2, "max_terms": 4, "min_value": 1, "max_value": 9}
    for split in ("train", "test"):
        named = generate_rows(split, 50, 3, args)
        chain = generate_rows(split, 50, 3, args | {"form": "chain"})
        assert [(r["id"], r["answer"], r["terms"]) for r in named] == [(r["id"], r["answer"], r["terms"]) for r in chain]
        for n, c in zip(named, chain):
            values = [int(v.split("=")[1]) for v in n["question"].split(" with ")[1].split(", ")]
            assert question(values, "chain") == c["question"] and solution(values) == n["solution"]


@pytest.mark.parametrize("args, message", [
    ({"terms": 3}, "takes min_terms, max_terms, min_value, max_value, form, not terms"),
    ({"form": "tree"}, "data.task_args.form: 'tree' is not one of named, chain"),
    ({"max_terms": 27}, "data.task_args.max_terms: the named form has 26 letters, got 27"),
    ({"min_terms": 1}, "need 2 <= min_terms <= max_terms"),
    ({"min_value": 5, "max_value": 4}, "need 1 <= min_value <= max_value"),
])
def test_bad_task_args_name_the_setting(args, message):
    with pytest.raises(DatasetError, match=message):
        load_problems(DatasetConfig(source="worked_sum", size=3, task_args=args))


def test_sft_trains_on_the_solution_and_the_reward_grades_the_answer():
    cfg = DatasetConfig(source="worked_sum", size=2, seed=0, task_args={"min_terms": 2, "max_terms": 2})
    graded = load_problems(cfg)
    worked = load_problems(DatasetConfig(**{**cfg.__dict__, "answer_field": "solution"}))
    assert [p.problem for p in graded] == [p.problem for p in worked]
    grade = get_grader("answer_integer")
    for g, w in zip(graded, worked):
        assert w.answer.startswith("a=") and grade(w.answer, g.answer).score == 1.0


@pytest.mark.parametrize("response, gold, score, reason", [
    ("48 + 27 = 75\nAnswer: 75", "75", 1.0, "correct"),
    ("48 + 27 = 75\nAnswer: -1234", "-1234", 1.0, "correct"),  # any sign and size (aime: out of range)
    ("48 + 27 = 76\nAnswer: 76", "75", 0.0, "wrong answer 76 (gold 75)"),
    ("48 + 27 = 75", "75", 0.0, "no final answer"),
    ("Answer: seventy", "75", 0.0, "not an integer: 'seventy'"),
    ("so \\boxed{12}", "12", 1.0, "correct"),
])
def test_answer_integer_grades_the_final_line(response, gold, score, reason):
    g = get_grader("answer_integer")(response, gold)
    assert (g.score, g.reason) == (score, reason)
    if gold == "-1234":
        assert get_grader("aime")(response, gold).reason == "out of range: -1234 is not in 0..999"


# ---- the recipe's refusals ------------------------------------------------------------------------------------
def _validate(*overrides):
    from miles_k3.config import compose_config

    return compose_config("train", ["recipe=k3_m2_reasoning", *overrides])


def test_the_recipe_refuses_the_cpu_pointing_to_the_quickstart():
    with pytest.raises(ValueError, match=r"device: this recipe \(requires.device=cuda\) is sized for a CUDA GPU "
                                         r"\(device=cpu\); on a CPU, run the quickstart instead: python -m "
                                         r"miles_k3.train"):
        _validate("device=cpu", "model.path=/some/base")


def test_the_recipe_refuses_to_start_without_its_base_and_prints_the_sft_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"model.path: this recipe trains from a base you build first; build it "
                                         r"with\n  python -m miles_k3.sft recipe=reasoning_base run_dir="):
        _validate()


def test_the_recipe_refuses_a_context_below_prompt_plus_response(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens: 720 leaves no room for the prompt in "
                                         r"engine.max_context=700"):
        _validate("model.path=/some/base", "engine.max_context=700")


# ---- the SFT pieces -----------------------------------------------------------------------------------------
class _CountUp(nn.Module):
    """Predicts token t + 1 after token t (logits one-hot on it): a hand-checkable teacher-forced model."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.config = type("C", (), {"vocab_size": vocab})()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids_BT, seq_lens=None):
        logits = torch.nn.functional.one_hot((input_ids_BT + 1) % self.config.vocab_size, self.config.vocab_size)
        return type("Out", (), {"logits": logits.float() + self.w})()


def test_heldout_figures_count_exact_solutions_and_tokens_by_hand():
    from miles_k3.sft import heldout_figures

    examples = [Sample([1, 2, 3], [4, 5]),      # both targets are t + 1: exact
                Sample([1, 2], [3, 7, 8]),      # 3 right, 7 wrong (model says 4), 8 right (after 7)
                Sample([5], [6])]               # exact
    out = heldout_figures(_CountUp(), examples, pad_id=0, device=torch.device("cpu"), batch_size=2)
    assert out == {"sft/heldout_exact": pytest.approx(2 / 3), "sft/heldout_token": pytest.approx(5 / 6)}


def test_micro_batched_gradients_add_up_to_the_whole_batchs():
    from miles_k3.model.build import ModelConfig, build_model
    from miles_k3.sft import sft_backward

    grads = []
    for micro in (0, 20):  # one batch; several micro-batches of <= 20 padded tokens
        model = build_model(ModelConfig(name="k3_nano", experts="bf16", dtype="fp32"), torch.device("cpu"),
                            torch.float32, seed=0)
        model.requires_grad_(True)
        g = torch.Generator().manual_seed(0)
        examples = [Sample(torch.randint(1, 250, (4 + i,), generator=g).tolist(),
                           torch.randint(1, 250, (3 + 2 * i,), generator=g).tolist()) for i in range(4)]
        loss, tokens = sft_backward(model, examples, 0, torch.device("cpu"), micro, checkpointing=micro > 0)
        grads.append((loss, tokens, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, t0, g0), (l1, t1, g1) = grads
    assert l1 == pytest.approx(l0, rel=1e-5) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-6), n
    assert t0 == t1 == 6 + 9 + 12 + 15  # the step's tokens (each example's prompt + response - 1), however cut


# ---- the base stops where it is deliberately imperfect --------------------------------------------------------
def _sft(tmp_path, *overrides):
    from miles_k3.config import compose_config

    return compose_config("sft", ["model=k3_nano", "device=cpu", "threads=1", f"run_dir={tmp_path / 'run'}",
                                  "data.source=worked_sum", "data.answer_field=solution", "data.size=16",
                                  "+data.task_args.min_terms=2", "+data.task_args.max_terms=3", "+data.task_args.max_value=9",
                                  "template=worked", "batch_size=2", "heldout_every=1", "heldout_size=4",
                                  "log_every=1", *overrides])


def test_sft_stops_at_the_first_heldout_measurement_reaching_stop_at_heldout_exact(tmp_path, monkeypatch):
    from miles_k3 import sft

    measured = iter([0.0, 0.25, 0.5, 0.75, 1.0])  # scripted held-out exact shares, one per step
    monkeypatch.setattr(sft, "heldout_figures", lambda *a, **k: {"sft/heldout_exact": next(measured),
                                                                 "sft/heldout_token": 0.9})
    result = sft.train_sft(_sft(tmp_path, "steps=5", "stop_at_heldout_exact=0.5"))
    assert len(result.losses) == 3  # steps 1 and 2 measured 0 and 0.25; step 3 reached 0.5 and stopped
    assert (tmp_path / "run/model/config.json").is_file()  # saved as at the last step
    exact = [json.loads(x).get("sft/heldout_exact") for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [e for e in exact if e is not None] == [0.0, 0.25, 0.5]


@pytest.mark.parametrize("overrides, message", [
    (("stop_at_heldout_exact=1.5",), r"stop_at_heldout_exact: a share in \[0, 1\] \(0: off\), got 1.5"),
    (("stop_at_heldout_exact=0.5", "heldout_every=0"),
     "stop_at_heldout_exact: needs the held-out figures; set heldout_every"),
])
def test_stop_at_heldout_exact_refuses_what_cannot_work(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _sft(tmp_path, *overrides)
