"""Test-only graders for the grading-pool tests, in a module of their own so that a spawned worker can import it.

The pool's worker imports the module that registered its grader (`graders.grader_module`); conftest.py puts
every test folder on sys.path (tests/evals/ among them) and spawn hands sys.path to the child, so
`import grader_helpers` works there too. Nothing outside the tests imports this module, so these graders never
exist in a real run.
"""
from __future__ import annotations

import os
import time

from miles_k3.evals.graders import MAX_RESPONSE_CHARS, GoldError, Grade, register_grader

SCRIPT = "_test_script"


@register_grader(SCRIPT)
def grade_script(response: str, gold: str, *, channel: str = "auto", max_chars: int = MAX_RESPONSE_CHARS) -> Grade:
    """The response is a command: "sleep:S" sleeps S seconds, "exit" ends the process (code 3), "raise" raises,
    "gold" raises GoldError, "not-a-grade" returns 42, "pid" reports the worker's pid; anything else scores
    1.0 if it equals the gold. The reason is always the response (or the pid), so tests can check the order."""
    if response.startswith("sleep:"):
        time.sleep(float(response[len("sleep:"):]))
    elif response == "exit":
        os._exit(3)
    elif response == "raise":
        raise RuntimeError("boom")
    elif response == "gold":
        raise GoldError(f"gold {gold!r} is unusable (test)")
    elif response == "not-a-grade":
        return 42  # type: ignore[return-value]
    elif response == "pid":
        return Grade(1.0, str(os.getpid()))
    return Grade(1.0 if response == gold else 0.0, response)
