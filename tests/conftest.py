"""Fixtures shared by the test files."""
import pytest
from kernel_testing import results_of


@pytest.fixture(scope="module")
def interpreter_results(request) -> dict[str, str]:
    """The test module's INTERPRETER_CASES run once under the Triton interpreter: {case: "ok" or the error}."""
    return results_of(str(request.path))
