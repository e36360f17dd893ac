"""One engine of a rollout fleet (rollout.mode=fleet): the class a Ray actor runs (`rollout.fleet.EngineFleet`
wraps it with `ray.remote`; this module imports Ray only inside the call that fetches an adapter).

An engine builds its own copy of the frozen base from the run's model config (the checkpoint its node reads from
disk, or the random init of the run's seed: the trainer's base, bit for bit) and a native `RolloutEngine` over it,
then plays the calls the trainer sends: a call is a batch of groups (each a prompt and its sampling seed, played
as `group_size` forks), sampled in one `generate` under the adapter version the call names. Ray runs an actor's
calls one at a time, in the order they were sent, so every group of a call is sampled under one version and
every token of it records that version.

Adapters: `load` copies a pushed version in place into the engine's adapter buffers (the engine's
`update_weights_from_tensor`; the first version registers them) and acknowledges it with (version, checksum), the
checksum read back from the buffers (`adapter_checksum`); a call returns the same pair for the adapter it sampled
under. When the actor's process dies Ray starts it again and runs `__init__` again: the base from disk, and no
adapter; every call carries its version and where the tensors are in Ray's object store, so the new process loads
the version it must sample under before its first call.

A build that fails (a bad checkpoint path) is kept and raised by `ready`, so the trainer stops with the engine's
own error instead of Ray's wrapper. `Fault`s are for chaos tests: the engine kills its own process (SIGKILL) at a
chosen point of its first life (a restarted engine runs clean).
"""
from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass

import torch

log = logging.getLogger("miles_k3.rollout")
FAULT_POINTS = ("load", "decode")


@dataclass(frozen=True)
class Fault:
    """The engine SIGKILLs its own process the `nth` time (counting from 1, in its first life) it reaches `point`:
    "load", as it starts copying a pushed adapter version into its buffers; "decode", in the middle of a call,
    once its engine has run a decode step of it."""

    point: str
    nth: int = 1

    def __post_init__(self) -> None:
        if self.point not in FAULT_POINTS:
            raise ValueError(f"Fault.point: '{self.point}' is not one of {', '.join(FAULT_POINTS)}")


def adapter_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of an adapter's tensors (by name, in name order: the name, dtype, shape and bytes of each), what the
    trainer pushed and what an engine holds after loading it (read back from its buffers)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _restarted() -> bool:
    """Whether Ray restarted this actor (a later life of it); False outside Ray."""
    try:
        import ray

        with warnings.catch_warnings():  # Ray 2.60's property reads its deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not in a Ray actor
        return False


def build_engine_of_run(cfg, device: str, threads: int):
    """The native engine of the run config `cfg` on `device`, over a base of its own: the model config's checkpoint
    (or random init of cfg.seed) with the run's kernels, dtype and LoRA config, `threads` torch threads."""
    from miles_k3.model.build import build_model, build_tokenizer
    from miles_k3.model.kernel_config import apply_kernels
    from miles_k3.parallel.mesh import SINGLE
    from miles_k3.rollout.factory import build_engine
    from miles_k3.utils.runtime import resolve_dtype, set_threads

    warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)
    set_threads(threads)
    torch.manual_seed(cfg.seed)
    dev = torch.device(device)
    apply_kernels(cfg.kernels, dev)
    tokenizer, stop_ids = build_tokenizer(cfg.model)
    model = build_model(cfg.model, dev, resolve_dtype(cfg.model.dtype, dev), SINGLE, cfg.lora, cfg.seed)
    return build_engine(cfg, model, tokenizer, stop_ids, lora=cfg.lora)


class FleetEngine:
    """A fleet engine (see the module docstring). `cfg`: the run config (model, lora, kernels, engine, seed);
    `index`: its place in the fleet (logs); `faults`: chaos points of its first life."""

    def __init__(self, cfg, index: int, device: str = "cpu", threads: int = 1, faults: tuple[Fault, ...] = ()):
        self.cfg, self.index = cfg, index
        self.restarted = _restarted()
        self.faults = () if self.restarted else tuple(faults)
        self.reached = {p: 0 for p in FAULT_POINTS}
        self.version: int | None = None  # the adapter version its buffers hold (None: none loaded yet)
        self.checksum = ""
        self.error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            self.engine = build_engine_of_run(cfg, device, threads)
        except Exception as e:  # noqa: BLE001 - raised by ready(): the trainer stops with it
            self.error = e
        self.build_s = time.perf_counter() - t0

    def ready(self) -> dict:
        """The engine's pid, whether it is a restarted life and its build's seconds; raises the build's error."""
        if self.error is not None:
            raise self.error
        return {"index": self.index, "pid": os.getpid(), "restarted": self.restarted, "build_s": self.build_s}

    def load(self, tensors: dict[str, torch.Tensor], version: int) -> tuple[int, str]:
        """Load adapter `version` (its tensors: Ray resolved them from the object store) in place; (version,
        checksum of the buffers). A version it holds already is not copied again."""
        if self.version != version:
            self._load(tensors, version)
        return self.version, self.checksum

    def play(self, call: dict, where: list, version: int) -> dict:
        """Play `call` ({"prompts": token ids of each group's prompt, "params": each group's sampling parameters,
        "n": samples per group}) under adapter `version`, loading it first from `where[0]` (its object reference)
        when the buffers hold another. Returns {"records": each group's n engine records, "version", "checksum",
        "pid"}."""
        if self.version != version:
            import ray

            self._load(ray.get(where[0]), version)
        self._reach("decode")
        outs = self.engine.generate(input_ids=call["prompts"], sampling_params=call["params"], n=call["n"],
                                    return_logprob=True, lora=_policy())
        bad = next((o for o in outs if "error" in o), None)
        if bad is not None:
            raise RuntimeError(f"rollout.fleet: engine {self.index} rejected a request: {bad['error']}")
        n = call["n"]
        return {"records": [outs[k * n:(k + 1) * n] for k in range(len(call["prompts"]))], "version": self.version,
                "checksum": self.checksum, "pid": os.getpid()}

    def _load(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self._reach("load")
        name = _policy()
        if self.version is None:  # the first version registers the buffers, then every load copies in place
            self.engine.load_lora_adapter_from_tensors(name, tensors, self.cfg.lora)
            self.engine.weight_version = version
        else:
            self.engine.update_weights_from_tensor(tensors, lora_name=name, weight_version=version)
        self.version = version
        self.checksum = adapter_checksum(self.engine.adapters.buffers(name))

    def _reach(self, point: str) -> None:
        """Count `point`; a fault due there kills the process (at once for load; for decode, from a thread once the
        engine has decoded a step of the call being played)."""
        self.reached[point] += 1
        if not any(f.point == point and f.nth == self.reached[point] for f in self.faults):
            return
        log.warning("rollout.fleet: engine %d kills itself (chaos fault at %s #%d)", self.index, point,
                    self.reached[point])
        if point == "load":
            os.kill(os.getpid(), signal.SIGKILL)
        start = self.engine.timing["decode_steps"]

        def kill_when_decoding() -> None:
            while self.engine.timing["decode_steps"] <= start:
                time.sleep(0.0005)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_when_decoding, daemon=True).start()


def _policy() -> str:
    from miles_k3.rollout.factory import POLICY

    return POLICY
