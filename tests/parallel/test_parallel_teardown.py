"""Leaving the process group (`parallel.mesh.leave_process_group`: `end_ranks` of eval and SFT, `shutdown` of
training, the spawn harness's teardown) on 2 gloo ranks: no rank returns before every rank has arrived, and gloo's
worker threads are joined before the function returns (`destroy_process_group` alone leaves them running into the
interpreter's exit, where a worker still dropping its last collective's tensors aborts the process)."""
import os
import time

import pytest
import torch
from dist_helpers import DEVICE_TYPE, run_ranks

pytestmark = pytest.mark.slow
LATE_S = 1.0  # rank 1 reaches the teardown this much later than rank 0


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _leave_rank(rank: int) -> dict:
    """Rank 0 leaves by training's `shutdown(ctx)` (its context held to the end), rank 1, LATE_S later, by
    `end_ranks()` (eval's and SFT's: no context left)."""
    import torch.distributed as dist

    from miles_k3.model.ranks import end_ranks
    from miles_k3.parallel.config import ParallelConfig
    from miles_k3.parallel.mesh import init_parallel, shutdown

    before = _threads()
    ctx = init_parallel(ParallelConfig(tp=2), DEVICE_TYPE)
    started = _threads()
    t = torch.full((3,), float(rank + 1))  # tensors of Python's: gloo's workers decref them after each collective
    dist.all_reduce(t, group=ctx.tp_group)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(LATE_S)
        arrived = time.time()
        del ctx  # nothing keeps the groups
        end_ranks()
    else:
        arrived = time.time()
        shutdown(ctx)
    return {"sum": t.tolist(), "before": before, "started": started, "after": _threads(), "arrived": arrived,
            "left": time.time(), "initialized": dist.is_initialized()}


@pytest.mark.skipif(DEVICE_TYPE != "cpu", reason="counts gloo's threads")
def test_leaving_waits_for_every_rank_and_joins_the_groups_threads():
    ranks = run_ranks(2, _leave_rank)
    assert [r["sum"] for r in ranks] == [[6.0] * 3] * 2  # (1 + 2) summed over the TP group, then over the world
    assert not any(r["initialized"] for r in ranks)
    # rank 0 arrived LATE_S before rank 1 and left only after rank 1 had arrived (the barrier)
    assert ranks[1]["arrived"] - ranks[0]["arrived"] >= 0.5 * LATE_S
    assert ranks[0]["left"] >= ranks[1]["arrived"]
    assert all(r["started"] > r["before"] for r in ranks)  # the groups started threads (gloo's workers, its loop)
    assert ranks[1]["after"] == ranks[1]["before"], ranks[1]  # all joined: none left for the interpreter's exit
