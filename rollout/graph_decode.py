"""One decode step over the engine's pools with static shapes, captured as a CUDA graph per (batch, context)
bucket.

A step reads every input from one fixed buffer (token ids, KDA slots, lengths, MLA block tables) and runs
`model.step` under `sync_free_experts()` (no host syncs anywhere) on pooled states
that are updated in place: each request's KDA rows (fla's kernel reads and writes the slot rows directly) and
its MLA pages (the new latent is written into its page, then the paged kernel attends over the page bucket). A batch of B requests runs in the smallest bucket >= B; padding rows point
at a scratch slot and a scratch page that no request owns. Decode on CUDA is
launch-bound in eager mode (thousands of small kernels per step); replaying a graph launches them at once.
On CPU (or with `capture=False`) the same static step runs eagerly: that is how it is tested without a GPU.
Every step records each MoE layer's top-k ids (`miles_k3.model.routing`): a captured graph also stacks them into
one int16 [B, MoE layers, top_k] buffer (two small kernels inside the graph, no eager launch), so each replay
leaves the step's routes at one fixed address, read only when the engine asks (`last_routes`,
return_routed_experts: the engine queues their copy to the host behind the replay, `rollout/route_log.py`).
Graphs capture addresses: the LoRA buffers never move (adapters are copied into them), and when the pools are
released the engine drops the graphs (`release_graphs`) and builds a new decoder over the resumed pools; graphs
are captured again on their next use.

Legend: B bucket rows, P pages per row (the page bucket), Z tokens per page, L latent width, V vocabulary.
"""
from __future__ import annotations

import torch

from miles_k3.model.experts import sync_free_experts
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.mla import paged_rows
from miles_k3.model.routing import Recorder, recording
from miles_k3.model.state import K3State, KDALayerState, MLALayerState
from miles_k3.rollout.memory import KDAStatePool, PagedLatentCache

PAD_RID = "__graph_decode_pad__"
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class GraphDecoder:
    """decode(ids, slots, rids) -> logits [B, V]; writes the step's states into the pools (not committed:
    the caller advances the cache lengths).

    Graphs are keyed by (batch bucket, page bucket): the page bucket is the smallest power of two (or the
    per-request maximum) covering the longest request of the batch, so a step attends over the pages the batch
    can reach rather than the whole max_context. All graphs share one memory pool (they never run at once)."""

    def __init__(self, model: K3ForCausalLM, kda: KDAStatePool, cache: PagedLatentCache, pages_per_request: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, capture: bool | None = None):
        self.model, self.kda, self.cache = model, kda, cache
        self.pages = pages_per_request
        # every slot but the padding rows' scratch one can hold a running request: the pool's size is the
        # last bucket when it is smaller than the largest one (a 6-request pool decodes 5 or 6 in one step)
        usable = kda.num_slots - 1
        self.buckets = tuple(sorted({b for b in buckets if b < usable} | {min(usable, max(buckets))}))
        self.page_buckets = tuple(sorted({min(2 ** i, pages_per_request)
                                          for i in range(pages_per_request.bit_length() + 1)}))
        self.device = cache.storage_MGZL.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.kda_ids = list(model.config.kda_layer_ids)
        self.mla_ids = list(model.config.mla_layer_ids)
        self._scratch_slot = kda.alloc()
        cache.new_request(PAD_RID)
        if self._scratch_slot is None or not cache.reserve(PAD_RID, 1):
            raise ValueError("graph decode needs one spare KDA slot and one spare latent page for padding rows")
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor, torch.Tensor | None,
                                                  torch.Tensor | None]] = {}
        self._last: Recorder | torch.Tensor | None = None  # the last step's routes (a graph's: its stacked buffer)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def max_batch(self) -> int:
        """The most requests one `decode` call takes (the largest bucket); the engine splits larger batches."""
        return self.buckets[-1]

    @property
    def scratch_page(self) -> int:
        return self.cache.page_table(PAD_RID)[0]

    def release_graphs(self) -> None:
        """Drop every graph and their shared memory pool, returning its blocks to the device (the engine's
        `cuda_graph` memory tag); graphs are captured again, into a new pool, on their next use."""
        self._graphs.clear()
        self._last = None  # a graph's routes buffer: it lives in the pool, and would keep its segment reserved
        if self.capture:
            self._pool = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the pool's blocks are free once no graph holds them
            self._pool = torch.cuda.graph_pool_handle()

    def decode(self, ids: list[int], slots: list[int], rids: list) -> torch.Tensor:
        """Logits [B, V] of one step for requests `rids` (their next position must be reserved)."""
        n = len(ids)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            raise ValueError(f"batch {n} exceeds the largest decode bucket {self.buckets[-1]}")
        lens = [self.cache.seq_len(r) for r in rids]
        need = max(lens, default=0) // self.cache.page_size + 1  # the page holding each new position
        width = next(p for p in self.page_buckets if p >= need)
        graph, packed, logits, routes = self._graph(bucket, width)  # captured on scratch rows before any is set
        scratch = self.scratch_page
        rows = [[i, s, ln, *self.cache.table_row(r, width, scratch)] for i, s, ln, r in zip(ids, slots, lens, rids)]
        rows += [[0, self._scratch_slot, 0] + [scratch] * width] * (bucket - n)
        packed.copy_(torch.tensor(rows, dtype=torch.long))  # one host->device copy per step
        if graph is None:
            logits, self._last = self._step(packed)
            return logits[:n]
        graph.replay()
        self._last = routes
        return logits[:n]

    def last_routes(self, n: int) -> torch.Tensor:
        """The last step's routes of its first n rows: [n, MoE layers, top_k] int16 on the device (a captured
        graph's: a view of its static buffer, which its next replay overwrites)."""
        if self._last is None:
            raise RuntimeError("last_routes: no decode step has run")
        routes = self._last if isinstance(self._last, torch.Tensor) else self._last.routes()
        return routes[:n]

    def _graph(self, bucket: int, width: int):
        key = (bucket, width)
        if key not in self._graphs:
            packed = torch.empty(bucket, 3 + width, dtype=torch.long, device=self.device)
            packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3:] = 0, self._scratch_slot, 0, self.scratch_page
            self._graphs[key] = self._capture(packed) if self.capture else (None, packed, None, None)
        return self._graphs[key]

    def _capture(self, packed: torch.Tensor):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: Triton autotuning and allocator pools settle before capture
                self._step(packed)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, recorder = self._step(packed)
            routes = recorder.routes()  # stacked in the graph: [B, L, K] int16 at a fixed address, no eager kernels
        return graph, packed, logits, routes

    @torch.no_grad()
    def _step(self, packed: torch.Tensor) -> tuple[torch.Tensor, Recorder]:
        """The static step: everything indexed by device tensors, no host syncs. packed [B, 3 + P] int64:
        token id, KDA slot, length (= the new token's position), then the request's first P pages. Returns the
        logits [B, V] and the step's routes (recorded)."""
        ids, slots, lens, table = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3:]
        slots = slots.contiguous()  # once per step: every KDA layer's kernels need unit stride (else each copies)
        kda_states = [KDALayerState(self.kda.conv_NCW[i], self.kda.recurrent_NHKV[i], slots)  # updated in place
                      for i in range(len(self.kda_ids))]
        storage = self.cache.storage_MGZL
        rows, attend = (paged_rows(table, lens, storage.shape[2]), lens + 1) if self.mla_ids else (None, None)
        mla_states = [MLALayerState(storage[m], table, rows, attend)  # paged, in place; rows once for all layers
                      for m in range(len(self.mla_ids))]
        layers: list = [None] * self.model.config.num_hidden_layers
        for i, layer_id in enumerate(self.kda_ids):
            layers[layer_id] = kda_states[i]
        for m, layer_id in enumerate(self.mla_ids):
            layers[layer_id] = mla_states[m]
        with sync_free_experts(), recording(self.model) as recorder:
            out = self.model.step(ids, K3State(lens, layers))
        return out.logits, recorder
