"""CI's scheduling (`pytest -n 2 --dist loadfile`, tests/xdist_order.py): the longest files are handed out first,
the others after them in xdist's order (most tests first), every test exactly once and each file whole."""
from types import SimpleNamespace

import pytest

pytest.importorskip("xdist")
from xdist_order import LONGEST_FILES, pytest_xdist_make_scheduler


class _Worker:
    """What the scheduler sees of a worker: it is sent test indices (into its collection) and may be shut down."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


class _Quiet:
    """xdist's log of its decisions (`log.loadscopesched(...)`), silenced."""

    def __getattr__(self, name: str):
        return self

    def __call__(self, *args) -> None:
        return None


def _scheduler(dist: str = "loadfile"):
    values = {"dist": dist, "tx": ["2*popen"]}
    config = SimpleNamespace(getvalue=values.__getitem__, option=SimpleNamespace(loadscopereorder=True))
    return pytest_xdist_make_scheduler(config=config, log=_Quiet())


# 3 quick files of many tests, then 2 long files of one test each and a long one of 4 (collection order; all three
# in LONGEST_FILES, test_quickstart.py the longest, then test_quickstart_partial.py, then test_ray_launch.py)
COLLECTION = ([f"tests/test_a.py::t{i}" for i in range(6)] + [f"tests/test_b.py::t{i}" for i in range(5)]
              + [f"tests/test_c.py::t{i}" for i in range(3)] + ["tests/commands/test_quickstart_partial.py::t0"]
              + ["tests/commands/test_ray_launch.py::t0"]
              + [f"tests/commands/test_quickstart.py::t{i}" for i in range(4)])


def _files(worker: _Worker) -> list[str]:
    """The files `worker` was sent, in order."""
    files: list[str] = []
    for i in worker.sent:
        path = COLLECTION[i].split("::")[0]
        if not files or files[-1] != path:
            files.append(path)
    return files


def _finish(sched, worker: _Worker) -> None:
    """`worker` runs what it was sent; the scheduler hands it more."""
    for i in list(worker.sent):
        sched.mark_test_complete(worker, i)


def test_the_longest_files_are_sent_first_then_the_rest_in_xdists_order():
    sched = _scheduler()
    one, two = _Worker("gw0"), _Worker("gw1")
    for w in (one, two):
        sched.add_node(w)
        sched.add_node_collection(w, COLLECTION)
    sched.schedule()
    # gw0: the longest (4 tests: no second file yet); gw1: the next, of one test, so at once the third too (xdist
    # tops a worker up when 2 or fewer of its tests are pending)
    assert _files(one) == ["tests/commands/test_quickstart.py"]
    assert _files(two) == ["tests/commands/test_quickstart_partial.py", "tests/commands/test_ray_launch.py"]
    while sched.workqueue or any(sched._pending_of(sched.assigned_work[w]) for w in (one, two)):
        _finish(sched, one)
        _finish(sched, two)
    assert sorted(one.sent + two.sent) == list(range(len(COLLECTION)))  # every test once
    assert not set(_files(one)) & set(_files(two))  # each file on one worker, whole


def test_the_quick_files_keep_xdists_order_most_tests_first():
    sched = _scheduler()
    one, two = _Worker("gw0"), _Worker("gw1")
    for w in (one, two):
        sched.add_node(w)
        sched.add_node_collection(w, COLLECTION)
    sched.schedule()
    _finish(sched, two)  # gw1 finishes its two long files first: it takes the next files in the queue
    assert _files(two)[2:] == ["tests/test_a.py"]  # 6 tests: pending > 2, one file at a time
    _finish(sched, two)
    _finish(sched, two)
    assert _files(two)[2:] == ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]


@pytest.mark.parametrize("dist", ["load", "loadscope", "worksteal"])
def test_other_modes_keep_xdists_scheduler(dist):
    assert _scheduler(dist) is None


def test_every_listed_file_exists():
    """A file renamed without its entry would silently lose its place at the front."""
    from repo_helpers import REPO

    names = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    assert set(LONGEST_FILES) <= names, sorted(set(LONGEST_FILES) - names)
