"""Where the tests are: the repository root (`REPO`) for tests that read its files, and the test folders
(`TEST_DIRS`) for code that imports a test module or helper by name.

tests/ mirrors the packages (tests/model/ tests miles_k3/model/, tests/rollout/ tests rollout/, ...;
tests/commands/ the commands and whole-project checks, tests/benchmarks/ the benchmark scripts) and its folders
hold no __init__.py: a test module imports under its file name, unique across the folders, and the shared
helpers here import as `import lora_helpers`. conftest.py puts every folder on sys.path, so that a module imports
by name from any folder as it did when tests/ was flat, spawned processes included (spawn hands sys.path to the
child: the grading pool's workers, the ranks of `dist_helpers.run_ranks`); a fresh `python -c` inherits only the
environment, so it gets `pythonpath()`.
"""
from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TEST_DIRS: tuple[Path, ...] = (TESTS, *sorted(
    p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__")) and any(p.glob("*.py"))))


def pythonpath() -> str:
    """PYTHONPATH for a subprocess that imports test modules or helpers by name: every test folder, then the
    caller's own PYTHONPATH (empty if unset, as before)."""
    return os.pathsep.join([*map(str, TEST_DIRS), os.environ.get("PYTHONPATH", "")])
