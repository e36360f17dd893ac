"""rollout/route_log.py: the engine's host log of decode-step routes, on hand-made rows."""
import pytest
import torch

from miles_k3.rollout.route_log import RouteLog


def _rows(*values):
    """Rows [len(values), 2 layers, 1 expert]: row v holds (v, -v)."""
    return torch.tensor([[[v], [-v]] for v in values], dtype=torch.int16)


def test_rows_come_back_by_index_across_blocks():
    log = RouteLog(block_rows=3)
    assert log.append(_rows(10, 11)) == 0
    assert log.append(_rows(20, 21, 22, 23)) == 2  # fills block 0, then all of block 1
    assert log.append(_rows(30)) == 6  # block 2
    assert len(log.blocks) == 3 and log.num_rows == 7
    assert torch.equal(log.gather([1, 3, 6]), _rows(11, 21, 30))  # rows from three blocks, in order
    assert torch.equal(log.gather([4, 5]), _rows(22, 23))
    got = log.gather([0])
    got[0, 0, 0] = 99  # a copy: the log keeps its rows
    assert torch.equal(log.gather([0]), _rows(10))


def test_bad_rows_and_indices_are_refused_and_clear_forgets():
    log = RouteLog(block_rows=4)
    log.append(_rows(1, 2))
    with pytest.raises(ValueError, match=r"rows of shape \(3, 1\)"):
        log.append(torch.zeros(1, 3, 1, dtype=torch.int16))
    with pytest.raises(IndexError, match="rows 0..2 asked, the log holds 2"):
        log.gather([0, 2])
    with pytest.raises(ValueError, match="gather of no rows"):
        log.gather([])
    log.clear()
    assert log.num_rows == 0 and log.blocks == []
    assert log.append(_rows(5)) == 0
    with pytest.raises(ValueError, match="block_rows"):
        RouteLog(block_rows=0)
