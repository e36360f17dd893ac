"""The held-out eval and the training data on one source with other task_args: `train` warns at start, naming the
keys that differ and the overrides that align them (an override of data.task_args alone once made a GPU run
evaluate a longer task than its base had learned: avg@4 0.004 against 0.109 on the trained task)."""
from miles_k3.config import compose_config
from miles_k3.train import eval_task_mismatch


def _mismatch(*overrides):
    return eval_task_mismatch(compose_config("train", list(overrides)))


def test_the_default_and_aligned_overrides_do_not_warn():
    assert _mismatch() is None
    assert _mismatch("data.task_args.max_terms=4", "eval.data.task_args.max_terms=4") is None


def test_a_training_override_alone_is_named_with_the_override_that_aligns_the_eval():
    assert _mismatch("data.task_args.max_terms=4", "data.task_args.min_digits=2") == (
        "eval.data.task_args differ from data.task_args on reasoning_gym:chain_sum (max_terms: 4 vs 3, min_digits: "
        "2 vs 1: training vs eval): the held-out eval measures another task than the one trained; to evaluate the "
        "trained task set eval.data.task_args.max_terms=4 eval.data.task_args.min_digits=2")


def test_an_eval_only_key_is_named_with_its_removal():
    msg = _mismatch("+eval.data.task_args.extra=1")
    assert msg is not None and msg.endswith("set ~eval.data.task_args.extra") and "extra: None vs 1" in msg


def test_no_warning_without_an_eval_or_on_another_source():
    assert _mismatch("data.task_args.max_terms=4", "eval.every_n_steps=0", "eval.at_start=false") is None
    assert _mismatch("data.task_args.max_terms=4", "eval.data.source=reasoning_gym:basic_arithmetic") is None
