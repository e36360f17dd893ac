"""The host rows of the rollout engine's decode-step routes (`return_routed_experts`), kept once per step.

A decode step's routes are `[B, L, K]` (one row per request of the step, `miles_k3.model.routing`). Kept per request
(a view of the step's row, appended to the request's list, all concatenated at its end), they cost Python work per
request per step. `RouteLog.append` instead copies the step's rows into fixed blocks of host rows and returns the
index of its first row; a request keeps the integer index of its row (`keep_step`, the engine's call per decode
step), and `gather` reads a request's rows back in one index per block they span. The log lives while `generate`
calls are in flight (`clear` when none is).

Rows on CUDA are copied without a host wait: into pinned host blocks with `non_blocking` copies queued on the
current stream behind the step that wrote them (a CUDA graph's static routes are overwritten only by the next
replay, queued after the copy), and one CUDA event marks the newest copy. Whatever reads host rows first waits for
it (`wait`: `gather`, `clear`, and a request's `routed`), so the decode step never waits for its own graph to finish
before the sampler is launched. `to_host` does the same for a prefill's routes. On the CPU the copies are plain.
"""
from __future__ import annotations

import torch

BLOCK_ROWS = 8192  # rows per host block (k3: 2,944 B a row, 24 MB a block)


class RouteLog:
    """Rows of decode-step routes in append order, in host blocks of `block_rows` rows."""

    def __init__(self, block_rows: int | None = None):
        block_rows = BLOCK_ROWS if block_rows is None else block_rows
        if block_rows < 1:
            raise ValueError(f"block_rows: must be >= 1, got {block_rows}")
        self.block_rows = block_rows
        self.blocks: list[torch.Tensor] = []
        self.num_rows = 0
        self._event = None  # a CUDA event recorded after the newest queued copy to the host
        self._pending = False  # copies queued since the last wait

    def to_host(self, rows: torch.Tensor) -> torch.Tensor:
        """A host copy of `rows`: on CUDA queued into pinned memory (read it only after `wait`), else `rows.cpu()`."""
        if not rows.is_cuda:
            return rows.cpu()
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        self._mark()
        return host

    def wait(self) -> None:
        """Block until every copy queued by `append` / `to_host` has landed in host memory."""
        if self._pending:
            self._event.synchronize()
            self._pending = False

    def _mark(self) -> None:
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()
        self._pending = True

    def append(self, rows_BLK: torch.Tensor) -> int:
        """Copy `rows_BLK` ([B, L, K], host or CUDA: queued) in; returns the index of its first row (row b is that
        + b)."""
        if self.blocks and (self.blocks[0].shape[1:] != rows_BLK.shape[1:] or self.blocks[0].dtype != rows_BLK.dtype):
            raise ValueError(f"route log: rows of shape {tuple(rows_BLK.shape[1:])} {rows_BLK.dtype}, the log holds "
                             f"{tuple(self.blocks[0].shape[1:])} {self.blocks[0].dtype}")
        first, done = self.num_rows, 0
        while done < rows_BLK.shape[0]:
            block, offset = divmod(self.num_rows, self.block_rows)
            if block == len(self.blocks):
                self.blocks.append(torch.empty(self.block_rows, *rows_BLK.shape[1:], dtype=rows_BLK.dtype,
                                               pin_memory=rows_BLK.is_cuda))
            n = min(rows_BLK.shape[0] - done, self.block_rows - offset)
            self.blocks[block][offset:offset + n].copy_(rows_BLK[done:done + n], non_blocking=True)
            done += n
            self.num_rows += n
        if rows_BLK.is_cuda:
            self._mark()
        return first

    def keep_step(self, reqs: list, routes_BLK: torch.Tensor) -> None:
        """A decode step's routes [B, L, K] (device) of the engine's requests `reqs` (row b: reqs[b]): each recording
        request's, at the position it processed (the step's rows copied in once, on CUDA without waiting for them; a
        request keeps its row's index)."""
        first = None
        for b, r in enumerate(reqs):
            if not r.record:
                continue
            pos = len(r.prompt) + len(r.output) - 1
            if pos != r.num_routed:  # not the next position: add_routes keeps first routes or says what is missing
                r.add_routes(pos, self.to_host(routes_BLK[b:b + 1]), self)
                continue
            if first is None:
                first = self.append(routes_BLK)
            r.log_rows.append(first + b)
            r.num_routed += 1

    def gather(self, index: list[int]) -> torch.Tensor:
        """The rows at `index` (ascending, as a request's steps are; not empty), [len(index), L, K], a copy."""
        if not index:
            raise ValueError("route log: gather of no rows")
        self.wait()
        if index[0] < 0 or index[-1] >= self.num_rows:
            raise IndexError(f"route log: rows {index[0]}..{index[-1]} asked, the log holds {self.num_rows}")
        idx = torch.tensor(index, dtype=torch.long)
        block = index[0] // self.block_rows
        if index[-1] // self.block_rows == block:  # one block (every request of a rollout shorter than a block)
            return self.blocks[block][idx - block * self.block_rows if block else idx]
        blocks, counts = torch.unique_consecutive(idx // self.block_rows, return_counts=True)
        parts, start = [], 0
        for block, count in zip(blocks.tolist(), counts.tolist()):
            parts.append(self.blocks[block][idx[start:start + count] - block * self.block_rows])
            start += count
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def clear(self) -> None:
        """Forget every row (the blocks are freed once their copies have landed)."""
        self.wait()
        self.blocks, self.num_rows = [], 0
