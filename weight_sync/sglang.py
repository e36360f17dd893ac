"""The channel into an SGLang engine (`rollout.backend=sglang`): the trainer's LoRA tensors are loaded as a new
adapter version (`SGLangEngine.stage_adapter`: SGLang's load_lora_adapter_from_tensors under `policy@v<N>`), checked,
then served (`commit_adapter`; the old version is unloaded once drained).

SGLang cannot read adapter weights back, so a push is verified by logprob parity: the staged version's prompt
log-probs of a fixed probe (token ids) are compared with the trainer's own log-probs of the same ids with the same
adapter (`trainer_logprobs`), and a mean absolute difference above `tolerance` (nats/token) refuses the push: the
staged version is unloaded and the engine keeps serving the previous one (SyncError). `verify` says when:
never, first (the first push of this channel) or every push. Any error while loading is a SyncError too, with
nothing served from the failed push.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from miles_k3.weight_sync.protocol import PushReport, SyncError, sync_devices


class SGLangChannel:
    """`push(tensors, version)` into `engine` (an SGLangEngine) as adapter `adapter`."""

    transport = "sglang"

    def __init__(self, engine, adapter: str, verify: str = "first", tolerance: float = 0.05,
                 probe_ids: list[int] | None = None,
                 trainer_logprobs: Callable[[list[int]], list[float]] | None = None):
        if engine.serving(adapter) is None:
            raise ValueError(f"adapter '{adapter}' is not loaded in the sglang engine; load it first")
        if verify != "never" and (not probe_ids or len(probe_ids) < 2 or trainer_logprobs is None):
            raise ValueError("a verified sglang push needs probe_ids (>= 2 token ids) and trainer_logprobs")
        self.engine, self.adapter, self.verify, self.tolerance = engine, adapter, verify, tolerance
        self.probe_ids, self.trainer_logprobs = probe_ids, trainer_logprobs
        self.pushes = 0

    def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """Serve `tensors` (the trainer's adapter parameters by name) as `version`. Raises SyncError (the engine
        keeps serving its previous version) when loading fails or the parity check does not pass."""
        devices = {t.device for t in tensors.values()} or {torch.device("cpu")}
        sync_devices(devices)
        t0 = time.perf_counter()
        if version <= self.engine.weight_version:
            raise SyncError(f"push of version {version} refused: versions only move forward (the engine serves "
                            f"{self.engine.weight_version})")
        try:
            staged = self.engine.stage_adapter(self.adapter, tensors, version)
        except ValueError as e:
            raise SyncError(f"push of version {version} refused: {e}",
                            next((n for n in tensors if n in str(e)), None)) from None
        except Exception as e:  # SGLang's own failure to load: nothing was served
            raise SyncError(f"push of version {version} failed in sglang: {type(e).__name__}: {e}") from e
        load_s = time.perf_counter() - t0
        parity = None
        if self.verify == "every" or (self.verify == "first" and self.pushes == 0):
            try:
                parity = self._parity(staged)
            except Exception as e:
                self.engine.discard_adapter(staged)
                raise SyncError(f"push of version {version} refused: the parity probe failed ({type(e).__name__}: "
                                f"{e}); the engine keeps serving version {self.engine.weight_version}") from e
            if parity > self.tolerance:
                self.engine.discard_adapter(staged)
                raise SyncError(f"push of version {version} refused: the engine's log-probs differ from the trainer's "
                                f"by {parity:.4g} nats/token on the probe (> sglang.parity_tolerance="
                                f"{self.tolerance}); the adapter did not arrive as trained (names, layout or "
                                "scaling), the engine keeps serving version "
                                f"{self.engine.weight_version}")
        self.engine.commit_adapter(self.adapter, staged)
        self.pushes += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return SGLangPushReport(version, self.transport, nbytes, time.perf_counter() - t0, len(tensors), 1, None,
                                load_seconds=load_s, parity=parity)

    def _parity(self, staged: str) -> float:
        """Mean |trainer - engine| log-prob over the probe with the staged adapter."""
        engine = self.engine.prompt_logprobs(self.probe_ids, staged)
        trainer = self.trainer_logprobs(self.probe_ids)
        if len(engine) != len(trainer):
            raise SyncError(f"parity probe: {len(engine)} engine log-probs vs {len(trainer)} of the trainer")
        return sum(abs(a - b) for a, b in zip(engine, trainer)) / len(engine)

    def close(self) -> None:
        """Nothing to release: the engine is the run's and is shut down with it."""


@dataclass
class SGLangPushReport(PushReport):
    """A PushReport with the adapter load time and the parity check's result (None when not checked)."""

    load_seconds: float = 0.0
    parity: float | None = None

    def metrics(self) -> dict[str, float]:
        m = super().metrics() | {"sync/load_seconds": self.load_seconds}
        if self.parity is not None:
            m["sync/parity_logprob_abs_diff"] = self.parity
        return m
