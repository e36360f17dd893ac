"""The registries' one rule (`miles_k3.utils.registry`), shared by policy losses, rewards and graders: a name
belongs to one function, judged by its dotted name so that a re-imported module (new objects) may register again."""
import pytest

from miles_k3.utils.registry import check_unclaimed, qualname


def _make():
    def fn():
        return 1
    return fn


def test_a_re_imported_function_is_the_same_one_and_a_different_one_is_refused():
    first, again = _make(), _make()  # two objects, one dotted name: what a module imported twice gives
    assert first is not again and qualname(first) == f"{__name__}._make.<locals>.fn"
    check_unclaimed("reward", "r", None, first)  # a free name
    check_unclaimed("reward", "r", first, again)  # the same function again
    with pytest.raises(ValueError, match=r"^reward 'r' is already registered \(by .*_make.<locals>.fn\); "
                                         r"pick another name$"):
        check_unclaimed("reward", "r", first, _make)
