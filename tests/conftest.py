"""Fixtures shared by the test files."""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (what CI runs): two workers on two cores, one thread each
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported; spawned ranks inherit it (more threads only contend)

import sys

import pytest
from kernel_testing import results_of
from repo_helpers import TEST_DIRS
from xdist_order import pytest_xdist_make_scheduler  # noqa: F401 - the hook: the longest files go first

# tests/ mirrors the packages in folders without __init__.py (repo_helpers.py): each folder on sys.path, so a test
# module or helper imports by its name from any folder, and in the processes spawned from this one.
sys.path.extend(str(d) for d in TEST_DIRS if str(d) not in sys.path)


@pytest.fixture(scope="module")
def interpreter_results(request) -> dict[str, str]:
    """The test module's INTERPRETER_CASES run once under the Triton interpreter: {case: "ok" or the error}."""
    return results_of(str(request.path))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 directory (hidden 64), the HF model of the SGLang backend tests (test_sglang_backend,
    test_sglang_k3); test files with their own `qwen3_dir` shadow this one."""
    from miles_k3.model.hf import write_tiny_qwen3

    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny", hidden_size=64)


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    """The smallest K3 checkpoint SGLang's K3 kernels serve (`sglang_k3_helpers.servable_raw`), random bf16: the
    model of the K3-on-SGLang tests (test_sglang_k3, test_sglang_k3_entry, test_bench_sglang_k3)."""
    from sglang_k3_helpers import servable_raw

    from miles_k3.init_checkpoint import init_checkpoint
    from miles_k3.model.config import K3Config

    return init_checkpoint(K3Config.from_dict(servable_raw()), tmp_path_factory.mktemp("k3") / "bf16")


@pytest.fixture(scope="session")
def hollow_k3(tmp_path_factory):
    """(directory, seconds to write) of the hollow real K3 (`miles_k3.model.hollow`: the published 96-file layout,
    real headers, the payload a hole), written once for the hollow-checkpoint and read-plan tests."""
    import time

    from miles_k3.model.config import K3Config
    from miles_k3.model.hollow import write_hollow_checkpoint

    start = time.perf_counter()
    out = write_hollow_checkpoint(K3Config.from_name("k3"), tmp_path_factory.mktemp("hollow") / "kimi-k3")
    return out, time.perf_counter() - start
