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
    "test_quickstart.py": 259,
    "test_quickstart_partial.py": 201,
    "test_parallel_loop.py": 201,
    "test_console.py": 100,
    "test_ray_launch.py": 77,
    "test_restart.py": 69,
    "test_fleet.py": 69,
    "test_user_errors.py": 68,
    "test_agent_quickstart.py": 66,
    "test_read_plan.py": 49,
    "test_fused_train_model.py": 40,
    "test_routing_replay.py": 38,
    "test_train_loop.py": 34,
    "test_sharded_eval_sft.py": 33,
    "test_model.py": 33,
    "test_trainer_step.py": 30,
    "test_recipes.py": 30,
    "test_sharded_load_memory.py": 25,
    "test_parallel_ep.py": 25,
    "test_eval_harness.py": 22,
    "test_partial_episodes.py": 22,
    "test_partial_loop.py": 22,
    "test_sft.py": 20,
    "test_parallel_base.py": 19,
    "test_engine.py": 19,
}
"""Seconds of each test file (by name: test files' names are unique, whatever folder holds them) in a CI-like run
(`pytest -n 2 --dist loadfile` on a quiet 2-core machine, both workers busy; 2026-12-06; test_ray_launch.py and
test_partial_episodes.py from a later quiet run, after their changes; test_fused_train_model.py and
test_partial_loop.py, after its refill test, alone on the dev machine, 2026-12-07), the files of 18 s or more.
A new long file belongs here, or it runs wherever xdist's order puts it."""


def longest_first(workqueue: dict) -> None:
    """Move the files of LONGEST_FILES in `workqueue` (an OrderedDict of file path -> its tests) to its front,
    longest first; the other files keep their order after them."""
    listed = sorted((LONGEST_FILES[path.rsplit("/", 1)[-1]], -i, path) for i, path in enumerate(workqueue)
                    if path.rsplit("/", 1)[-1] in LONGEST_FILES)  # equal times: in the queue's order
    for _, _, path in listed:  # each moves to the front: the longest goes last, so it ends first
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
