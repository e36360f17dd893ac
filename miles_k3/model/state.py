"""Per-request inference state that the full-sequence forward can return and the stateful step consumes.

A reference layout (contiguous, one row per request): the rollout engine keeps the same contents in its own
pools (KDA state slots, paged MLA latents). Legend: B requests, C = 3 * KDA projection width (q|k|v channels),
W conv taps, H heads, K/V head dims, S latent positions (capacity >= seq_lens), L = kv_lora_rank + rope dims.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KDALayerState:
    """conv_BCW: the last W-1 pre-conv q|k|v projections (activation dtype); recurrent_BHKV: S, fp32.

    Pooled form (the rollout engine's decode): with `slots_B` set, the two tensors are whole pools [N, ...] and
    request b owns row slots_B[b]; a decode step reads and updates those rows in place (no gathered copies).
    """

    conv_BCW: torch.Tensor
    recurrent_BHKV: torch.Tensor
    slots_B: torch.Tensor | None = None


@dataclass
class MLALayerState:
    """latent_BSL: [normalised c (kv_lora_rank) | k_r (rope dims)] per past token; rows past seq_lens are junk.

    Paged form (the rollout engine's decode): with `table_BT` set, latent_BSL is the layer's whole page pool
    [G, Z, L] and position j of request b is row j % Z of page table_BT[b, j // Z]; a decode step writes the
    new latent into its page in place and attends over the pages (`kernels/paged_mla.py`). `rows_B` (the pool row
    of each request's new position, table_BT[b, seq_lens // Z] * Z + seq_lens % Z) and `attend_B` (seq_lens + 1)
    may come precomputed: the same for every MLA layer of a step, so the engine computes them once per step.
    """

    latent_BSL: torch.Tensor
    table_BT: torch.Tensor | None = None
    rows_B: torch.Tensor | None = None
    attend_B: torch.Tensor | None = None


@dataclass
class K3State:
    """The whole model's state: tokens consumed per request and one entry per decoder layer."""

    seq_lens: torch.Tensor  # [B] int64
    layers: list[KDALayerState | MLALayerState]
