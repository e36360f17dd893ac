"""The rollout engine's two fixed state pools and their sizing: KDA state slots and the paged MLA latent cache.

`KDAStatePool` holds one slot per running request: for every KDA layer the conv window and the fp32 recurrent
state. `PagedLatentCache` holds MLA latents in fixed pages of `page_size` tokens; each request owns a page table
(a Python list of page ids, position s lives in page table[s // Z] at offset s % Z), pages are refcounted so a
GRPO group forked from one prompt shares the prompt's full pages. Both pools allocate their storage once (CUDA
graphs capture the addresses); `release()` frees the storage and `resume()` reallocates the same shapes, at
possibly different addresses, so the engine recaptures its graphs after a resume. `plan_memory` sizes both from
a byte budget. Under tensor parallelism each rank's KDA pool holds its H / tp heads (`tp`), the latent cache is
replicated. Legend: B requests, T new tokens, S latent positions, N pool slots, C = 3 * H * K conv channels,
W conv taps, H heads, K/V head dims, M MLA layers, G pages, Z tokens per page, L = kv_lora_rank + rope dims.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from miles_k3.model.config import K3Config
from miles_k3.model.state import K3State, KDALayerState, MLALayerState

Lens = Sequence[int] | torch.Tensor


# ---- shapes and sizing ---------------------------------------------------------------------------------
def kda_slot_shapes(cfg: K3Config, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per-slot shapes of one KDA layer on one of `tp` tensor-parallel ranks (each holds H / tp heads, as its
    sharded KDA modules do): conv (C, W-1) and recurrent (H / tp, K, V)."""
    lac = cfg.linear_attn_config
    h, k = lac.num_heads // tp, lac.head_dim
    return (3 * h * k, lac.short_conv_kernel_size - 1), (h, k, k)


def latent_width(cfg: K3Config) -> int:
    """L: values cached per token per MLA layer."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def slot_bytes(cfg: K3Config, dtype: torch.dtype, tp: int = 1) -> int:
    """One request's KDA state over all KDA layers on one of `tp` ranks: recurrent fp32
    (= `KDAAttention.state_bytes_per_request(tp)` of the full module) plus the conv window in `dtype`."""
    (c, w1), (h, k, v) = kda_slot_shapes(cfg, tp)
    per_layer = h * k * v * 4 + c * w1 * dtype.itemsize
    return len(cfg.kda_layer_ids) * per_layer


def page_bytes(cfg: K3Config, page_size: int, dtype: torch.dtype) -> int:
    """One page over all MLA layers: page_size x `MLAAttention.cache_bytes_per_token(dtype.itemsize)` x M."""
    return len(cfg.mla_layer_ids) * page_size * latent_width(cfg) * dtype.itemsize


@dataclass(frozen=True)
class MemoryPlan:
    """Pool sizes for a byte budget. Rule: every one of `num_slots` requests can hold `max_context` tokens at
    once, so each slot is paired with ceil(max_context / page_size) pages (forks never need more: a child holds
    at most as many pages as its length needs, shared or not)."""

    num_slots: int
    """KDA state slots = the maximum number of running requests."""
    num_pages: int
    """MLA latent pages = num_slots * pages_per_request."""
    page_size: int
    """Tokens per page (Z)."""
    max_context: int
    """Tokens (prompt + completion) one request may reach."""
    pages_per_request: int
    """ceil(max_context / page_size)."""
    bytes_per_slot: int
    """KDA state of one request over all KDA layers (recurrent fp32 + conv window in the pool dtype)."""
    bytes_per_page: int
    """One page over all MLA layers."""
    total_bytes: int
    """num_slots * bytes_per_slot + num_pages * bytes_per_page (<= the budget)."""

    def summary(self) -> dict:
        """Figures under `mem/` keys, model_info style (one flat JSON-able dict)."""
        return {f"mem/{k}": v for k, v in asdict(self).items()}


def plan_memory(cfg: K3Config, budget_bytes: int, page_size: int, max_context: int,
                dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> MemoryPlan:
    """num_slots = budget // (bytes_per_slot + pages_per_request * bytes_per_page), per rank of `tp` tensor-parallel
    ranks (KDA heads split, MLA latents replicated); raises ValueError naming the shortfall when not even one
    request of `max_context` tokens fits."""
    if page_size <= 0 or max_context <= 0:
        raise ValueError(f"page_size ({page_size}) and max_context ({max_context}) must be positive")
    per_slot, per_page = slot_bytes(cfg, dtype, tp), page_bytes(cfg, page_size, dtype)
    pages = -(-max_context // page_size)
    per_request = per_slot + pages * per_page
    num_slots = budget_bytes // per_request
    if num_slots < 1:
        raise ValueError(f"memory budget {budget_bytes:,} B is below one request of max_context={max_context} "
                         f"tokens ({per_request:,} B: KDA state {per_slot:,} B + {pages} pages x {per_page:,} B); "
                         "raise the budget or lower max_context")
    return MemoryPlan(num_slots, num_slots * pages, page_size, max_context, pages, per_slot, per_page,
                      num_slots * per_request)


# ---- storage release / resume (shared by both pools) ------------------------------------------------------
def _release(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.untyped_storage().resize_(0)


def _resume(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.untyped_storage().resize_(t.numel() * t.element_size())
        t.zero_()


class _Releasable:
    """release()/resume() over `self._tensors()`; `_forget()` drops all requests."""

    released = False

    def release(self) -> None:
        """Free the storage (tensor objects stay; their storage is empty) and drop every request."""
        self._forget()
        _release(self._tensors())
        self.released = True

    def resume(self) -> None:
        """Reallocate the same shapes, zeroed and empty of requests. Addresses may differ: recapture graphs."""
        if self.released:
            _resume(self._tensors())
            self.released = False

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(f"{type(self).__name__} is released; call resume() first")


# ---- KDA state slots ----------------------------------------------------------------------------------------
class KDAStatePool(_Releasable):
    """Per KDA layer (model order): conv_NCW [N, C, W-1] in `dtype` and recurrent_NHKV [N, H, K, V] fp32, with
    H the heads of one of `tp` tensor-parallel ranks."""

    def __init__(self, cfg: K3Config, num_slots: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, tp: int = 1):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        (c, w1), (h, k, v) = kda_slot_shapes(cfg, tp)
        self.num_slots = num_slots
        n_layers = len(cfg.kda_layer_ids)
        self.conv_NCW = [torch.zeros(num_slots, c, w1, device=device, dtype=dtype) for _ in range(n_layers)]
        self.recurrent_NHKV = [torch.zeros(num_slots, h, k, v, device=device, dtype=torch.float32)
                               for _ in range(n_layers)]
        self._forget()

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.conv_NCW, *self.recurrent_NHKV]

    def _forget(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))  # a stack: slot 0 first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A zeroed slot (the state before a request's first token), or None when all are taken."""
        slots = self.alloc_many(1)
        return None if slots is None else slots[0]

    def alloc_many(self, n: int) -> list[int] | None:
        """n zeroed slots (one reset for all of them), or None (nothing taken) when fewer are free."""
        return self._take(n, zero=True)

    def _take(self, n: int, zero: bool) -> list[int] | None:
        self._check_live()
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        self._used.update(slots)
        if zero and slots:
            self.reset(torch.tensor(slots, device=self.conv_NCW[0].device))
        return slots

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"KDA slot {slot} is not allocated (double free?)")
        self._used.remove(slot)
        self._free.append(slot)

    def fork(self, src_slot: int, n: int) -> list[int] | None:
        """n new slots holding copies of `src_slot`'s state; None (nothing taken) if fewer than n are free."""
        if src_slot not in self._used:
            raise ValueError(f"KDA slot {src_slot} is not allocated; cannot fork it")
        slots = self._take(n, zero=False)  # overwritten with the source's state below
        if slots:
            idx = torch.tensor(slots, device=self.conv_NCW[0].device)
            for t in self._tensors():
                t[idx] = t[src_slot: src_slot + 1].clone()  # a source row may not alias its targets
        return slots

    def read(self, slots: torch.Tensor) -> list[KDALayerState]:
        """Gathered copies [B, ...] per KDA layer. `slots` [B] int64 on the pool's device (the engine's own)."""
        self._check_live()
        return [KDALayerState(c.index_select(0, slots), r.index_select(0, slots))
                for c, r in zip(self.conv_NCW, self.recurrent_NHKV)]

    def write(self, slots: torch.Tensor, states: Sequence[KDALayerState]) -> None:
        """Scatter per-layer states [B, ...] into distinct `slots` [B] (cast to the pool dtypes)."""
        self._check_live()
        assert len(states) == len(self.conv_NCW), (len(states), len(self.conv_NCW))
        for c, r, st in zip(self.conv_NCW, self.recurrent_NHKV, states):
            c.index_copy_(0, slots, st.conv_BCW.to(c.dtype))
            r.index_copy_(0, slots, st.recurrent_BHKV.to(r.dtype))

    def reset(self, slots: torch.Tensor) -> None:
        """Zero `slots` [B] in every layer."""
        self._check_live()
        for t in self._tensors():
            t.index_fill_(0, slots, 0)


# ---- paged MLA latents ---------------------------------------------------------------------------------------
class PagedLatentCache(_Releasable):
    """storage_MGZL [M, G, Z, L]; per request a page table (list of page ids) and a committed length.

    Writes go to reserved capacity (`reserve`) and become visible to `gather` once committed (`advance`).
    Copy-on-write: a page with refcount > 1 is copied to a fresh page before a write touches it; `fork` copies
    the source's partial last page eagerly, so append-only decoding never writes to a shared page.
    """

    def __init__(self, cfg: K3Config, num_pages: int, page_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self.mla_index = {layer_id: i for i, layer_id in enumerate(cfg.mla_layer_ids)}
        shape = (len(cfg.mla_layer_ids), num_pages, page_size, latent_width(cfg))
        self.storage_MGZL = torch.zeros(shape, device=device, dtype=dtype)
        self._forget()

    def _tensors(self) -> list[torch.Tensor]:
        return [self.storage_MGZL]

    def _forget(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._refs = [0] * self.num_pages
        self._tables: dict = {}
        self._lens: dict = {}

    # ---- bookkeeping -----------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def seq_len(self, rid) -> int:
        return self._lens[self._known(rid)]

    def page_table(self, rid) -> list[int]:
        return list(self._tables[self._known(rid)])

    def table_row(self, rid, width: int, fill: int) -> list[int]:
        """The first `width` page ids of `rid`, padded with `fill` (a new list; one per decode row)."""
        table = self._tables[self._known(rid)]
        return table[:width] + [fill] * (width - len(table))

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _known(self, rid):
        if rid not in self._tables:
            raise ValueError(f"unknown request {rid!r}: call new_request first")
        return rid

    def _take(self, n: int) -> list[int] | None:
        self._check_live()
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def new_request(self, rid) -> None:
        self._check_live()
        if rid in self._tables:
            raise ValueError(f"request {rid!r} already exists")
        self._tables[rid], self._lens[rid] = [], 0

    def reserve(self, rid, num_tokens: int) -> bool:
        """Ensure pages for seq_len + num_tokens tokens; False (nothing taken) if not enough are free."""
        table = self._tables[self._known(rid)]
        need = -(-(self._lens[rid] + num_tokens) // self.page_size) - len(table)
        if need <= 0:
            return True  # the common decode step: the last page still has room
        pages = self._take(need)
        if pages is None:
            return False
        table.extend(pages)
        return True

    def advance(self, rid, num_tokens: int) -> None:
        """Commit `num_tokens` written tokens: seq_len += num_tokens (within reserved capacity)."""
        new = self._lens[self._known(rid)] + num_tokens
        if new > len(self._tables[rid]) * self.page_size:
            raise ValueError(f"request {rid!r}: length {new} exceeds its reserved capacity; reserve first")
        self._lens[rid] = new

    def free(self, rid) -> None:
        for page in self._tables.pop(self._known(rid)):
            self._drop(page)
        del self._lens[rid]

    def fork(self, src_rid, child_rids: Sequence) -> bool:
        """Children share the source's full pages (refcount + 1 each) and get a private copy of its partial
        last page; seq_len is inherited. False (nothing changed) if the copies do not fit."""
        n_full, partial = divmod(self._lens[self._known(src_rid)], self.page_size)
        for rid in child_rids:
            if rid in self._tables or list(child_rids).count(rid) > 1:
                raise ValueError(f"fork child {rid!r} already exists or is repeated")
        copies = self._take(len(child_rids) if partial else 0)
        if copies is None:
            return False
        shared = self._tables[src_rid][:n_full]
        for i, rid in enumerate(child_rids):
            for p in shared:
                self._refs[p] += 1
            own = [copies[i]] if partial else []
            if partial:
                self._copy_page(self._tables[src_rid][n_full], copies[i])
            self._tables[rid], self._lens[rid] = shared + own, self._lens[src_rid]
        return True

    def _copy_page(self, src: int, dst: int) -> None:
        self.storage_MGZL[:, dst] = self.storage_MGZL[:, src]

    def _make_private(self, rid, page_pos: int) -> None:
        """Copy-on-write of the request's page_pos-th page if it is shared."""
        table = self._tables[rid]
        if self._refs[table[page_pos]] > 1:
            fresh = self._take(1)
            if fresh is None:
                raise RuntimeError(f"request {rid!r}: no free page for copy-on-write of a shared page")
            self._copy_page(table[page_pos], fresh[0])
            self._drop(table[page_pos])
            table[page_pos] = fresh[0]

    # ---- data -----------------------------------------------------------------------------------------
    def write(self, layer_idx: int, rids: Sequence, start: Lens, latents_BTL: torch.Tensor,
              lens: Lens | None = None) -> None:
        """Write latents_BTL[b, t] at position start[b] + t of request rids[b], for t < lens[b] (default T),
        into MLA layer `layer_idx` (0 .. M-1; `mla_index` maps model layer ids). Positions must be reserved."""
        self._check_live()
        b, t, _ = latents_BTL.shape
        start, lens = _ints(start), _ints(lens) if lens is not None else [t] * b
        for i, rid in enumerate(rids):
            end = start[i] + lens[i]
            if end > len(self._tables[self._known(rid)]) * self.page_size:
                raise ValueError(f"request {rid!r}: writing up to position {end} past its reserved capacity")
            first = start[i] // self.page_size
            for page_pos in range(first, max(first, -(-end // self.page_size))):
                self._make_private(rid, page_pos)
        dest, src = self._write_index(rids, start, lens, t)
        flat = self.storage_MGZL[layer_idx].view(-1, self.storage_MGZL.shape[-1])
        rows = latents_BTL.reshape(b * t, -1).index_select(0, src.to(latents_BTL.device))
        flat.index_copy_(0, dest.to(flat.device), rows.to(flat.dtype))

    def _write_index(self, rids: Sequence, start: list[int], lens: list[int], t: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host int64 (dest, src): rows of storage[m].view(G * Z, L) and of latents.view(B * T, L) for every
        written token, built for the whole batch at once (no per-request tensors)."""
        lens_B = torch.tensor(lens, dtype=torch.long)
        row_N = torch.repeat_interleave(torch.arange(len(rids)), lens_B)
        t_N = torch.arange(int(lens_B.sum())) - torch.repeat_interleave(lens_B.cumsum(0) - lens_B, lens_B)
        pos_N = torch.tensor(start, dtype=torch.long)[row_N] + t_N
        tables = [self._tables[r] for r in rids]
        width = max(map(len, tables), default=0)
        table_BP = torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.long)
        table_BP = table_BP.reshape(len(rids), width)
        dest_N = table_BP[row_N, pos_N // self.page_size] * self.page_size + pos_N % self.page_size
        return dest_N, row_N * t + t_N

    def block_table(self, rids: Sequence, num_pages: int | None = None) -> torch.Tensor:
        """[B, num_pages] int64 page ids (default: the longest table), padded with page 0 (masked by lengths)."""
        tables = [self._tables[self._known(r)] for r in rids]
        width = max((len(t) for t in tables), default=0) if num_pages is None else num_pages
        rows = [t[:width] + [0] * (width - len(t)) for t in tables]  # one host->device copy per call
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), width).to(self.storage_MGZL.device)

    def gather(self, layer_idx: int, rids: Sequence, lens: Lens | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """latent_BSL [B, S_max, L] (copies, in position order) and valid_BS bool, for each request's first
        lens[b] positions (default: its seq_len; may include written but uncommitted positions)."""
        self._check_live()
        lens = [self._lens[self._known(r)] for r in rids] if lens is None else _ints(lens)
        s_max = max(lens, default=0)
        table_BP = self.block_table(rids, -(-s_max // self.page_size))
        pages_BPZL = self.storage_MGZL[layer_idx][table_BP]
        latent_BSL = pages_BPZL.flatten(1, 2)[:, :s_max]
        lens_B = torch.tensor(lens, device=latent_BSL.device)
        valid_BS = torch.arange(s_max, device=latent_BSL.device) < lens_B[:, None]
        return latent_BSL, valid_BS

    def as_mla_state(self, layer_idx: int, rids: Sequence) -> MLALayerState:
        """The layer's committed latents as the model's MLALayerState (rows past seq_len are junk)."""
        return MLALayerState(self.gather(layer_idx, rids)[0])


def _rows_from(latent_BSL: torch.Tensor, start: list[int], t: int) -> torch.Tensor:
    """[B, T, L]: latent_BSL[b, start[b] + t], positions clamped into S (rows past a request's count are junk)."""
    pos_BT = (torch.tensor(start)[:, None] + torch.arange(t)).clamp(max=latent_BSL.shape[1] - 1)
    pos_BTL = pos_BT.to(latent_BSL.device)[..., None].expand(-1, -1, latent_BSL.shape[-1])
    return latent_BSL.gather(1, pos_BTL)


def _ints(x: Lens) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


# ---- the model's K3State from / to the pools (the engine's reference path) ----------------------------------
def pooled_state(cfg: K3Config, kda: KDAStatePool, slots: torch.Tensor, cache: PagedLatentCache,
                 rids: Sequence) -> K3State:
    """The contiguous K3State of requests (kda slots[b], cache rids[b]) at their committed lengths."""
    kda_states = iter(kda.read(slots))
    layers = [cache.as_mla_state(cache.mla_index[i], rids) if cfg.is_mla_layer(i) else next(kda_states)
              for i in range(cfg.num_hidden_layers)]
    lens = torch.tensor([cache.seq_len(r) for r in rids], device=slots.device)
    return K3State(lens, layers)


def store_state(cfg: K3Config, state: K3State, kda: KDAStatePool, slots: torch.Tensor,
                cache: PagedLatentCache, rids: Sequence) -> bool:
    """Write a state returned by the model back: KDA states into `slots`, the latents past each request's
    committed length into its pages, then commit (seq_len = state.seq_lens). False (nothing written) if the
    pages for the new tokens cannot all be reserved."""
    new_lens = _ints(state.seq_lens)
    old = [cache.seq_len(r) for r in rids]
    grown = [r for r, o, n in zip(rids, old, new_lens) if not cache.reserve(r, n - o)]
    if grown:
        return False  # reserve only grows capacity; pages already reserved stay with their requests
    kda.write(slots, [state.layers[i] for i in cfg.kda_layer_ids])
    num_new = [n - o for o, n in zip(old, new_lens)]
    for layer_id, m in cache.mla_index.items():
        cache.write(m, rids, old, _rows_from(state.layers[layer_id].latent_BSL, old, max(num_new)), num_new)
    for r, o, n in zip(rids, old, new_lens):
        cache.advance(r, n - o)
    return True
