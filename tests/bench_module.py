"""The tests' one way to import a script of `benchmarks/` (a folder of scripts, not a package) as a module."""
import importlib.util
import sys

from repo_helpers import REPO

BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py, executed as the module `name` (its `__main__` block does not run); benchmarks/ goes on
    sys.path, as running a script puts it there (the scripts import `record`)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
