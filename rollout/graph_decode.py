"""One decode step over the engine's pools with static shapes, captured as a CUDA graph per batch bucket.

A step reads every input from fixed buffers (token ids, KDA slots, MLA block tables, lengths), gathers each
request's KDA state and its pages' latents (fixed capacity: pages_per_request * page_size positions), runs
`model.step(..., fixed_capacity=True)` under `sync_free_experts()` (no host syncs anywhere), and writes the new
KDA states and the new latent straight back into the pools. A batch of B requests runs in the smallest bucket
>= B; padding rows point at a scratch slot and a scratch page that no request owns. Decode on CUDA is
launch-bound in eager mode (thousands of small kernels per step); replaying a graph launches them at once.
On CPU (or with `capture=False`) the same static step runs eagerly: that is how it is tested without a GPU.
Graphs capture addresses: after the pools are released and resumed, or LoRA buffers are rebound, call
`invalidate()` (the engine does) and they are recaptured on next use.

Legend: B bucket rows, P pages per request, Z tokens per page, L latent width, V vocabulary.
"""
from __future__ import annotations

import torch

from miles_k3.model.experts import sync_free_experts
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.state import K3State, KDALayerState, MLALayerState
from miles_k3.rollout.memory import KDAStatePool, PagedLatentCache

PAD_RID = "__graph_decode_pad__"
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class GraphDecoder:
    """decode(ids, slots, rids) -> logits [B, V]; writes the step's states into the pools (not committed:
    the caller advances the cache lengths)."""

    def __init__(self, model: K3ForCausalLM, kda: KDAStatePool, cache: PagedLatentCache, pages_per_request: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, capture: bool | None = None):
        self.model, self.kda, self.cache = model, kda, cache
        self.pages = pages_per_request
        self.buckets = tuple(sorted(b for b in buckets if b <= kda.num_slots)) or (kda.num_slots,)
        self.device = cache.storage_MGZL.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.kda_ids = list(model.config.kda_layer_ids)
        self.mla_ids = list(model.config.mla_layer_ids)
        self._scratch_slot = kda.alloc()
        cache.new_request(PAD_RID)
        if self._scratch_slot is None or not cache.reserve(PAD_RID, 1):
            raise ValueError("graph decode needs one spare KDA slot and one spare latent page for padding rows")
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, dict, torch.Tensor]] = {}

    @property
    def scratch_page(self) -> int:
        return self.cache.page_table(PAD_RID)[0]

    def invalidate(self) -> None:
        """Drop captured graphs (pool storage or bound LoRA buffers moved); recaptured on next use."""
        self._graphs.clear()

    def decode(self, ids: list[int], slots: list[int], rids: list) -> torch.Tensor:
        """Logits [B, V] of one step for requests `rids` (their next position must be reserved)."""
        n = len(ids)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            raise ValueError(f"batch {n} exceeds the largest decode bucket {self.buckets[-1]}")
        graph, bufs, logits = self._graph(bucket)
        pad = bucket - n
        table = self.cache.block_table(rids, self.pages)
        if pad:
            table = torch.cat([table, torch.full((pad, self.pages), self.scratch_page, dtype=torch.long,
                                                 device=table.device)])
        bufs["ids"].copy_(torch.tensor(ids + [0] * pad))
        bufs["slots"].copy_(torch.tensor(slots + [self._scratch_slot] * pad))
        bufs["lens"].copy_(torch.tensor([self.cache.seq_len(r) for r in rids] + [0] * pad))
        bufs["table"].copy_(table)
        if graph is None:
            return self._step(bufs)[:n]
        graph.replay()
        return logits[:n]

    def _graph(self, bucket: int):
        if bucket not in self._graphs:
            bufs = {"ids": torch.zeros(bucket, dtype=torch.long, device=self.device),
                    "slots": torch.full((bucket,), self._scratch_slot, dtype=torch.long, device=self.device),
                    "lens": torch.zeros(bucket, dtype=torch.long, device=self.device),
                    "table": torch.full((bucket, self.pages), self.scratch_page, dtype=torch.long,
                                        device=self.device)}
            if not self.capture:
                self._graphs[bucket] = (None, bufs, None)
            else:
                self._graphs[bucket] = self._capture(bufs)
        return self._graphs[bucket]

    def _capture(self, bufs: dict):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: Triton autotuning and allocator pools settle before capture
                self._step(bufs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._step(bufs)
        return graph, bufs, logits

    @torch.no_grad()
    def _step(self, bufs: dict) -> torch.Tensor:
        """The static step: everything indexed by device tensors, no host syncs."""
        slots, lens, table = bufs["slots"], bufs["lens"], bufs["table"]
        kda_states = [KDALayerState(self.kda.conv_NCW[i][slots], self.kda.recurrent_NHKV[i][slots])
                      for i in range(len(self.kda_ids))]
        storage = self.cache.storage_MGZL
        mla_states = [MLALayerState(storage[m][table].flatten(1, 2)) for m in range(len(self.mla_ids))]
        layers: list = [None] * self.model.config.num_hidden_layers
        for i, layer_id in enumerate(self.kda_ids):
            layers[layer_id] = kda_states[i]
        for m, layer_id in enumerate(self.mla_ids):
            layers[layer_id] = mla_states[m]
        with sync_free_experts():
            out = self.model.step(bufs["ids"], K3State(lens, layers), fixed_capacity=True)
        for i, layer_id in enumerate(self.kda_ids):
            new = out.state.layers[layer_id]
            self.kda.conv_NCW[i].index_copy_(0, slots, new.conv_BCW.to(self.kda.conv_NCW[i].dtype))
            self.kda.recurrent_NHKV[i].index_copy_(0, slots, new.recurrent_BHKV)
        z = self.cache.page_size
        page = table.gather(1, (lens // z)[:, None])[:, 0]
        flat_pos = page * z + lens % z
        rows = torch.arange(lens.shape[0], device=lens.device)
        for m, layer_id in enumerate(self.mla_ids):
            new_BL = out.state.layers[layer_id].latent_BSL[rows, lens]
            storage[m].view(-1, storage.shape[-1]).index_copy_(0, flat_pos, new_BL.to(storage.dtype))
        return out.logits
