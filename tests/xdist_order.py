"""The order in which `pytest -n 2 --dist loadfile` (CI) hands out the test files: the longest first.

xdist's LoadFileScheduling sends whole files, by default in order of their number of tests, most first
(`--loadscope-reorder`): a file of one 3-minute test went last, and the run ended with one worker idle for minutes
while the other finished it. Here the files of LONGEST_FILES go first, longest first (each worker takes the next
one as it frees up: the longest-processing-time rule), then every other file in xdist's own order; the short files
fill the gaps at the end. Collection, and so the order within each file, is unchanged.
"""
from __future__ import annotations

import pytest

LONGEST_FILES = {
    "tests/commands/test_quickstart.py": 225,
    "tests/commands/test_quickstart_partial.py": 175,
    "tests/parallel/test_parallel_loop.py": 155,
    "tests/commands/test_ray_launch.py": 115,
    "tests/commands/test_console.py": 60,
    "tests/commands/test_restart.py": 60,
    "tests/commands/test_agent_quickstart.py": 50,
    "tests/model/test_read_plan.py": 36,
    "tests/commands/test_user_errors.py": 36,
    "tests/model/test_sharded_load_memory.py": 33,
    "tests/commands/test_train_loop.py": 25,
    "tests/commands/test_sharded_eval_sft.py": 24,
    "tests/model/test_model.py": 24,
    "tests/model/test_routing_replay.py": 23,
    "tests/parallel/test_parallel_ep.py": 20,
}
"""Seconds of each file's tests in a CI-like run (`pytest -n 2 --dist loadfile` on a quiet 2-core machine, both
workers busy): the files of 20 s or more. A new long file belongs here, or it runs whenever xdist's order puts it."""


def longest_first(workqueue: dict) -> None:
    """Move the files of LONGEST_FILES in `workqueue` (an OrderedDict of file -> its tests) to its front, longest
    first; the other files keep their order after them."""
    for path in sorted(LONGEST_FILES, key=LONGEST_FILES.__getitem__):  # each moves to the front: the longest last
        if path in workqueue:
            workqueue.move_to_end(path, last=False)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`: xdist's scheduler with its queue of files reordered once, before the first file is sent
    (when every worker's collection is in); other modes: xdist's own (None)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFilesFirst(LoadFileScheduling):
        ordered = False

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:
                longest_first(self.workqueue)
                self.ordered = True
            super()._assign_work_unit(node)

    return LongestFilesFirst(config, log)
