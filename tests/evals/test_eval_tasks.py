"""Generated problems (`data.source=reasoning_gym:<name>`), the `integer` grader and reward, the `equation`
template and the eval summary's answer_rate."""
import pytest

from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.graders import GoldError, get_grader
from miles_k3.evals.metrics import SampleOutcome, summarize
from miles_k3.evals.problems import DatasetError
from miles_k3.evals.rewards import RewardConfig, build_reward
from miles_k3.evals.tasks import TEST_BUCKETS, in_split
from miles_k3.evals.templates import render_prompt

pytest.importorskip("reasoning_gym")
ARGS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def _chain_sum(split="train", size=400, seed=0, **kw):
    return load_problems(DatasetConfig(source="reasoning_gym:chain_sum", split=split, size=size, seed=seed,
                                       task_args=dict(ARGS), problem_field="metadata.expression", **kw))


def test_generated_problems_are_right_reproducible_and_split_disjointly():
    train, again = _chain_sum(), _chain_sum()
    assert train == again and len(train) == 400 and len({p.problem for p in train}) == 400
    for p in train[:50]:  # the gold is the expression's value (reasoning-gym's own answer)
        terms = p.problem.replace("- ", "-").replace("+ ", "").split()
        assert int(p.answer) == sum(int(t) for t in terms), p
    test = _chain_sum("test", size=200, seed=7)
    assert not {p.problem for p in train} & {p.problem for p in test}
    assert all(in_split(f"State the final answer to the following arithmetic problem: {p.problem} =", "test")
               for p in test)  # the split is by the question text's hash bucket
    assert len({p.id for p in train + test}) == 600
    share = sum(in_split(f"q{i}", "test") for i in range(4000)) / 4000
    assert abs(share - 1 / TEST_BUCKETS) < 0.02


def test_the_question_is_the_default_problem_text():
    p = load_problems(DatasetConfig(source="reasoning_gym:chain_sum", size=3, task_args=dict(ARGS)))[0]
    assert p.problem.startswith("State the final answer to the following arithmetic problem:")


@pytest.mark.slow
@pytest.mark.parametrize("kw, message", [
    ({"task_args": {"bogus": 1}}, "unexpected keyword argument 'bogus'"),
    ({"task_args": {"min_terms": 5, "max_terms": 2}}, "max_terms must be >= min_terms"),
    ({"split": "validation"}, "splits train, test"),
    ({"size": 10_000, "task_args": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
     "distinct problems"),
])
def test_generator_errors_name_the_setting(kw, message):
    cfg = {"source": "reasoning_gym:chain_sum", "size": 10, **kw}
    with pytest.raises(DatasetError, match=message):
        load_problems(DatasetConfig(**cfg))


def test_unknown_generator_and_empty_name():
    with pytest.raises(DatasetError, match="'nope' not registered"):
        load_problems(DatasetConfig(source="reasoning_gym:nope", size=3))
    with pytest.raises(ValueError, match="^source: name the generator"):
        DatasetConfig(source="reasoning_gym:").validate()
    with pytest.raises(ValueError, match="^size: "):
        DatasetConfig(source="reasoning_gym:chain_sum", size=0).validate()


@pytest.mark.parametrize("response, score, how", [
    ("114", 1.0, "integer"), (" 114\n", 1.0, "integer"), ("+114", 1.0, "integer"), ("0114", 1.0, "integer"),
    ("-114", 0.0, "integer"), ("115", 0.0, "integer"), ("114.0", 0.0, "none"), ("x114", 0.0, "none"),
    ("114 apples", 0.0, "none"), ("", 0.0, "none"), ("1" * 100, 0.0, "none"), ("\\boxed{114}", 0.0, "none"),
])
def test_integer_grader(response, score, how):
    g = get_grader("integer")(response, "114")
    assert (g.score, g.how) == (score, how), g
    assert (g.normalized is not None) == (how == "integer")


def test_integer_grader_negative_gold_and_bad_gold():
    assert get_grader("integer")("-37", "-37").score == 1.0
    for gold in ("3.5", "", "abc", None):
        with pytest.raises(GoldError, match="not an integer"):
            get_grader("integer")("3", gold)


def test_integer_reward_through_the_pool():
    reward = build_reward(RewardConfig(name="integer"))
    try:
        out = reward(["-103", "12", "twelve"], ["-103", "13", "12"])
    finally:
        reward.close()
    assert [r.score for r in out] == [1.0, 0.0, 0.0] and [r.correct for r in out] == [True, False, False]


def test_equation_template():
    assert render_prompt("equation", "15 - 43 - 75") == "15-43-75="
    assert render_prompt("equation", " 4 +\t5 ") == "4+5="


def test_answer_rate_counts_well_formed_answers():
    outcomes = {"a": [SampleOutcome(1.0, "3", False, 2), SampleOutcome(0.0, None, False, 5)],
                "b": [SampleOutcome(0.0, "4", False, 2), SampleOutcome(0.0, "5", True, 9)]}
    assert summarize(outcomes)["answer_rate"] == 0.75


def test_distinct_false_keeps_the_generators_distribution():
    natural = _chain_sum(size=2000, distinct=False)
    distinct = _chain_sum(size=2000)
    assert len({p.id for p in natural}) == 2000 and len({p.problem for p in natural}) < 2000  # repeats kept
    # a set of distinct problems over-represents the rarer two-digit, three-term problems
    def long_share(ps):
        return sum(len(p.problem.split()) == 5 for p in ps) / len(ps)
    assert long_share(distinct) > long_share(natural)
    test = _chain_sum("test", size=300, seed=3, distinct=False)
    assert not {p.problem for p in natural} & {p.problem for p in test}  # the split holds without distinct
