"""The routes of MoE forwards: recorded (the rollout engine, for every token it processes) and replayed (the
trainer's forward over a sample uses the engine's expert ids: rollout routing replay, "R3").

Routes are `[N, L, K]` expert ids (N tokens of a forward, flattened B * T; L MoE layers in layer order,
`LatentMoE.moe_index`; K experts per token), int16 on the host (K3: 896 experts). A sample's routes cover the
tokens the trainer's forward reads: prompt + response minus the last response token, P + R - 1 positions, the
tokens the engine processed (prefill: the prompt but its last token; one decode step per token after that).

`recording(model)`: within the block every MoE forward of `model` stores its own top-k ids (all N tokens, gathered
over tp under tensor parallelism); `Recorder.routes()` stacks them. `replaying(model, ids_NLK)`: every MoE forward
takes its layer's ids from ids_NLK instead of its own top-k (under tp/ep each rank its share of the tokens; a token
whose ids are -1, a padding position, keeps its own top-k); the
gate weights are computed from the forward's own router scores at those ids, so gradients reach the router's
sigmoid as in the published R3; the forward's own top-k is recorded beside them (`Recorder.routes()`), which is
how a mismatch is measured. The state lives on the MoE modules for the block (activation checkpointing
recomputes layers during backward: keep the block open across backward) and each layer looks its ids up by its
index, so recomputation in any order replays the same ids.
"""
from __future__ import annotations

import contextlib

import torch

ROUTE_DTYPE = torch.int16  # expert ids < 32,768


def moe_layers(model) -> list:
    """The model's LatentMoE modules in layer order (index = `moe_index`), found once per model (a recorded
    decode step would otherwise walk every module of the model)."""
    cached = model.__dict__.get("_moe_layers")
    if cached is None:
        from miles_k3.model.moe import LatentMoE
        cached = sorted((m for m in model.modules() if isinstance(m, LatentMoE)), key=lambda m: m.moe_index)
        model.__dict__["_moe_layers"] = cached
    return cached


class Recorder:
    """Each MoE layer's top-k ids of the last forward, by `moe_index` ([N, K] on the device)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.ids: dict[int, torch.Tensor] = {}

    def record(self, index: int, ids_NK: torch.Tensor) -> None:
        self.ids[index] = ids_NK

    def routes(self) -> torch.Tensor:
        """[N, L, K] (device, int16): every layer's ids; raises if a layer has not run."""
        missing = [i for i in range(self.num_layers) if i not in self.ids]
        if missing:
            raise RuntimeError(f"routes: MoE layers {missing} did not run in the recorded forward")
        return torch.stack([self.ids[i] for i in range(self.num_layers)], dim=1).to(ROUTE_DTYPE)


class _Replay:
    """What a MoE layer reads while replaying: ids [N, L, K] (any integer dtype; each layer's column is widened to
    int64 when it is read) of the forward's tokens."""

    def __init__(self, ids_NLK: torch.Tensor):
        self.ids_NLK = ids_NLK

    def ids(self, index: int, num_tokens: int) -> torch.Tensor:
        if self.ids_NLK.shape[0] != num_tokens:
            raise ValueError(f"routing replay: the routes cover {self.ids_NLK.shape[0]} tokens, the forward has "
                             f"{num_tokens}")
        return self.ids_NLK[:, index].long()


@contextlib.contextmanager
def recording(model):
    """Record every MoE layer's own top-k ids during the block; yields the Recorder."""
    layers = moe_layers(model)
    recorder = Recorder(len(layers))
    with _set(layers, recorder, None):
        yield recorder


@contextlib.contextmanager
def replaying(model, ids_NLK: torch.Tensor):
    """Every MoE forward in the block routes its tokens to ids_NLK[:, layer] (tokens in the forward's order: B * T
    flattened); yields the Recorder of the layers' own top-k (for the mismatch)."""
    layers = moe_layers(model)
    if ids_NLK.ndim != 3 or ids_NLK.shape[1] != len(layers):
        raise ValueError(f"routing replay: routes of shape {tuple(ids_NLK.shape)}, the model has {len(layers)} MoE "
                         "layers ([tokens, layers, top_k] expected)")
    recorder = Recorder(len(layers))
    with _set(layers, recorder, _Replay(ids_NLK)):
        yield recorder


@contextlib.contextmanager
def _set(layers: list, recorder: Recorder, replay: _Replay | None):
    if any(m.routing is not None for m in layers):
        raise RuntimeError("routing: this model is already recording or replaying routes")
    for m in layers:
        m.routing = (recorder, replay)
    try:
        yield
    finally:
        for m in layers:
            m.routing = None


def mismatched_tokens(own_NLK: torch.Tensor, ref_NLK: torch.Tensor) -> torch.Tensor:
    """[N] bool: the token's set of experts differs from the reference's in at least one layer (slot order does
    not count)."""
    return (own_NLK.long().sort(-1).values != ref_NLK.long().sort(-1).values).any(-1).any(-1)


def route_bytes_per_token(num_moe_layers: int, top_k: int) -> int:
    """Host bytes one token's recorded routes take (int16 ids)."""
    return num_moe_layers * top_k * torch.tensor([], dtype=ROUTE_DTYPE).element_size()
