"""The engine side of a push (`Receiver`), shared by every transport that moves bytes (ipc, dist).

A transport calls `begin(version, manifest)`, then writes each chunk either with `write(offset, data_u8)` or by
filling `chunk_view(offset, nbytes)` itself (e.g. a broadcast straight into staging) and calling
`mark_received`, then `commit(version, checksums)`. Chunks arrive in payload order. The staging buffer is
allocated once (grown only when a larger push arrives) on the engine's device. See `protocol` for the checks.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from miles_k3.weight_sync.protocol import (
    ALIGN,
    CHECKSUM_ALGOS,
    Manifest,
    SyncError,
    payload_checksums,
    readback_matches,
)

log = logging.getLogger("miles_k3.weight_sync")


@dataclass
class _Txn:
    version: int
    manifest: Manifest
    received: int = 0
    started: float = 0.0


class Receiver:
    """Stages, verifies and applies pushes into one adapter of a RolloutEngine (`engine.adapters` buffers and
    `engine.update_weights_from_tensor`). `last_error` holds the reason of the last refused or aborted push."""

    def __init__(self, engine, adapter: str, readback: bool = False):
        self.engine, self.adapter, self.readback = engine, adapter, readback
        self.expected = {n: (tuple(t.shape), t.dtype) for n, t in engine.adapters.buffers(adapter).items()}
        self.device = next(iter(engine.adapters.buffers(adapter).values())).device
        self._staging: torch.Tensor | None = None
        self._txn: _Txn | None = None
        self.last_error: str | None = None
        self._checked: Manifest | None = None  # the last manifest that passed _check_manifest
        self._view_key: tuple | None = None
        self._view_cache: dict[str, torch.Tensor] = {}

    # ---- transaction -------------------------------------------------------------------------------------
    def begin(self, version: int, manifest: Manifest) -> None:
        """Open a push of `version`; refuses (SyncError naming the tensor) a manifest that does not match the
        adapter's buffers, or a version that does not move forward. An open push is aborted first."""
        if self._txn is not None:
            self.abort(f"version {self._txn.version} superseded by a new push before its commit")
        try:
            self._check_version(version)
            if manifest != self._checked:  # a trainer pushes one layout over and over: check it once
                self._check_manifest(manifest)
                self._checked = manifest
        except SyncError as e:
            self.last_error = str(e)
            raise
        if self._staging is None or self._staging.numel() < manifest.total_bytes:
            self._staging = self._view_cache = self._view_key = None  # free the old staging first
            try:
                self._staging = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
            except RuntimeError as e:  # out of memory: refuse this push, keep serving
                self.last_error = f"staging buffer of {manifest.total_bytes} bytes on {self.device}: {e}"
                raise SyncError(f"push of version {version} refused: {self.last_error}") from None
        self._txn = _Txn(version, manifest, 0, time.perf_counter())

    def chunk_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The staging bytes [offset, offset + nbytes) of the open push: chunks must arrive in order."""
        txn = self._need_txn()
        if offset != txn.received or nbytes < 0 or offset + nbytes > txn.manifest.total_bytes:
            raise self._fail(f"chunk [{offset}, {offset + nbytes}) out of order or out of range: "
                             f"{txn.received} of {txn.manifest.total_bytes} payload bytes received so far")
        return self._staging[offset:offset + nbytes]

    def mark_received(self, offset: int, nbytes: int) -> None:
        self.chunk_view(offset, nbytes)  # same checks
        self._txn.received = offset + nbytes

    def write(self, offset: int, data_u8: torch.Tensor) -> None:
        """Copy one chunk (uint8, any device) into staging."""
        self.chunk_view(offset, data_u8.numel()).copy_(data_u8)
        self.mark_received(offset, data_u8.numel())

    def commit(self, version: int, checksums: tuple[str, list[int]] | None) -> dict:
        """Verify the open push (all bytes, per-tensor checksums when given as (algorithm, values), finite values),
        apply it in place and
        set the engine's weight_version. Returns {"version", "bytes", "seconds", "checksum_match",
        "readback_match"}. On any failure raises SyncError; nothing is applied."""
        txn = self._need_txn()
        m = txn.manifest
        if version != txn.version:
            raise self._fail(f"commit of version {version} but the open push is version {txn.version}")
        if txn.received != m.total_bytes:
            missing = next(s.name for s in m.specs if s.offset + s.nbytes > txn.received)
            raise self._fail(f"incomplete push: {txn.received} of {m.total_bytes} payload bytes arrived; "
                             f"tensor {missing} is missing", missing)
        staging = self._staging[:m.total_bytes]
        match = None
        if checksums is not None:
            algo, sums = checksums
            if algo not in CHECKSUM_ALGOS or len(sums) != len(m.specs):
                raise self._fail(f"commit carries {len(sums)} {algo!r} checksums for {len(m.specs)} tensors")
            got = payload_checksums(m, staging, algo)
            bad = [s.name for s, a, b in zip(m.specs, got, sums) if a != b]
            if bad:
                raise self._fail(f"checksum mismatch in tensor {bad[0]} ({len(bad)} tensor(s) differ): the bytes "
                                 f"were corrupted in transit", bad[0])
            match = True
        views = self._views(m, staging)
        try:
            self.engine.update_weights_from_tensor(views, lora_name=self.adapter, weight_version=version)
        except ValueError as e:
            bad = next((n for n in views if n in str(e)), None)
            raise self._fail(f"engine refused the push: {e}", bad) from None
        readback = readback_matches(self.engine.adapters.buffers(self.adapter), views) if self.readback else None
        self._txn = None
        return {"version": version, "bytes": m.total_bytes, "seconds": time.perf_counter() - txn.started,
                "checksum_match": match, "readback_match": readback}

    def abort(self, reason: str) -> None:
        """Drop the open push (if any): the engine keeps its current version."""
        if self._txn is not None:
            log.warning("weight sync: push of version %d aborted: %s", self._txn.version, reason)
        self._txn = None
        self.last_error = reason

    @property
    def open_version(self) -> int | None:
        return None if self._txn is None else self._txn.version

    # ---- checks ------------------------------------------------------------------------------------------
    def _check_version(self, version: int) -> None:
        current = self.engine.weight_version
        if version <= current:
            raise SyncError(f"version {version}: versions only move forward; the engine serves version "
                            f"{current}")

    def _check_manifest(self, m: Manifest) -> None:
        names = [s.name for s in m.specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise SyncError(f"tensor {dup} appears twice in the push", dup)
        unknown = [n for n in names if n not in self.expected]
        if unknown:
            raise SyncError(f"tensor {unknown[0]} is not a buffer of adapter {self.adapter!r} "
                            f"({len(unknown)} unknown); names must be the trainer's lora_parameters() names",
                            unknown[0])
        missing = [n for n in self.expected if n not in set(names)]
        if missing:
            raise SyncError(f"tensor {missing[0]} is missing from the push ({len(missing)} missing): a push "
                            f"carries the whole adapter", missing[0])
        end = 0
        for s in m.specs:
            shape, _ = self.expected[s.name]
            try:
                dtype = s.torch_dtype
            except AttributeError:
                dtype = None
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise SyncError(f"tensor {s.name}: dtype {s.dtype} is not a floating dtype", s.name)
            if s.shape != shape:
                raise SyncError(f"tensor {s.name}: shape {list(s.shape)} but the engine's buffer is "
                                f"{list(shape)}", s.name)
            if s.nbytes != math.prod(s.shape) * dtype.itemsize or s.offset != (end + ALIGN - 1) // ALIGN * ALIGN:
                raise SyncError(f"tensor {s.name}: byte range [{s.offset}, {s.offset + s.nbytes}) is not the next "
                                f"aligned range for {s.dtype} {list(s.shape)} (payloads are packed back to back, "
                                f"as Manifest.of lays them out)", s.name)
            end = s.offset + s.nbytes

    def _views(self, m: Manifest, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """The pushed tensors as views of staging; the same view objects for a repeated layout (so the engine's
        copy recognises them and skips its per-tensor checks)."""
        key = (m, staging.data_ptr())
        if self._view_key != key:
            self._view_key = key
            self._view_cache = {s.name: staging[s.offset:s.offset + s.nbytes].view(s.torch_dtype).view(s.shape)
                                for s in m.specs}
        return self._view_cache

    def _need_txn(self) -> _Txn:
        if self._txn is None:
            raise SyncError("no push is open: begin(version, manifest) first")
        return self._txn

    def _fail(self, message: str, tensor: str | None = None) -> SyncError:
        version = self._txn.version if self._txn is not None else None
        self.abort(message)
        return SyncError(f"push of version {version} refused: {message}", tensor)
