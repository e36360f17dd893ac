"""A fleet of rollout engines as Ray actors (rollout.mode=fleet): start them, push adapter versions to them, send
them calls and hand back what comes back, surviving an engine's death. Ray's own machinery only: actors
(`fleet_actor.FleetEngine`, restarted by Ray up to `max_restarts` times), the object store (`ray.put` of each
adapter version, once), and `ray.wait` over the calls in flight. Ray is imported inside the methods: it is an
optional extra.

What the calls mean (groups, versions, the staleness bound) is the caller's (`trainer.fleet.FleetRollouts`); here
a call is an id, a payload and the adapter version it samples under, and `wait` returns, for each call that
ended, its result, or None when it was lost with its engine: the caller queues its work again. An engine that
dies costs the calls it held (the one decoding, and those queued behind it on that actor); Ray starts it again
(its base from disk), and it takes calls again once it answers `ready`, loading the current adapter with its
first call. Engines that are not coming back (restarts used up, or not back within `start_timeout_s`) leave the
fleet; the run stops when none is left. An engine whose build fails (at the start or at a restart: a bad
checkpoint path) stops the run with its own error, not a retry loop.

Every acknowledgement is checked: an engine's `load` and every call's result carry (version, checksum of the
adapter buffers it sampled with), which must equal the checksum of what was pushed as that version.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from miles_k3.rollout.fleet_actor import Fault, FleetEngine, adapter_checksum

log = logging.getLogger("miles_k3.rollout")
REJOIN_POLL_S = 0.5
"""How often an engine that died is asked whether Ray has started it again."""


@dataclass
class FleetSpec:
    """What the fleet is: `engines` actors of `cpus` CPUs and `gpus` GPUs each (fractions allowed), restarted by Ray
    up to `max_restarts` times each; `start_timeout_s`: how long the engines may take to start (or to come back
    after a death) before the fleet gives up on them."""

    engines: int
    cpus: float
    gpus: float
    max_restarts: int
    start_timeout_s: float


@dataclass
class _Engine:
    handle: object
    up: bool = True  # answers calls (False: died, restarting)
    gone: bool = False  # left the fleet for good
    down_since: float = 0.0
    pending: int = 0  # calls sent and not ended
    lives: int = 1


@dataclass(frozen=True)
class _Sent:
    """What an object reference in flight is: a "call", a "load" or a "ready" question, to engine `engine` in its
    `life` (as the fleet counts them: a death is counted once, by the first loss of the life it happened in)."""

    what: str
    engine: int
    life: int
    call: int = -1
    version: int = -1


@dataclass
class _Counts:
    failovers: int = 0  # engine deaths seen
    lost_calls: int = 0
    pushes: int = 0
    push_bytes: int = 0


@dataclass
class _Pushed:
    ref: object
    checksum: str
    acks: set = field(default_factory=set)  # engines that acknowledged it


class EngineFleet:
    """The engines of `spec` building the base of the run config `cfg` (see the module docstring). `faults`:
    chaos faults by engine index (tests)."""

    def __init__(self, cfg, spec: FleetSpec, faults: dict[int, tuple[Fault, ...]] | None = None):
        self.cfg, self.spec, self.faults = cfg, spec, faults or {}
        self.engines: list[_Engine] = []
        self.counts = _Counts()
        self.pushed: dict[int, _Pushed] = {}  # adapter version -> its object and checksum
        self.version: int | None = None  # the newest version pushed
        self._refs: dict[object, _Sent] = {}  # what is in flight, by object reference
        self._owns_ray = False

    # ---- start and stop -----------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        """Start the engines (Ray started first, ray.init's default cluster, when this process has none) and wait
        until each has built its base: their `ready` answers. An engine's build error is raised as itself; a
        cluster that cannot place them within start_timeout_s is a RuntimeError naming what they asked for."""
        import ray

        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)
            self._owns_ray = True
        s = self.spec
        actor = ray.remote(FleetEngine).options(num_cpus=s.cpus, num_gpus=s.gpus, max_restarts=s.max_restarts,
                                                max_task_retries=0)
        device, threads = ("cuda" if s.gpus > 0 else "cpu"), max(1, int(s.cpus))
        self.engines = [_Engine(actor.remote(self.cfg, i, device, threads, tuple(self.faults.get(i, ()))))
                        for i in range(s.engines)]
        refs = [e.handle.ready.remote() for e in self.engines]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=s.start_timeout_s)
        ready = []
        for i, ref in enumerate(refs):
            try:
                if ref not in done:
                    raise TimeoutError
                ready.append(ray.get(ref))
            except TimeoutError:
                self.close()
                raise RuntimeError(f"rollout.fleet: {s.engines} engines x {{CPU: {s.cpus:g}, GPU: {s.gpus:g}}} did "
                                   f"not start within rollout.fleet.start_timeout_s={s.start_timeout_s:g} (the "
                                   f"cluster has {_resources(ray.cluster_resources())}); lower "
                                   "rollout.fleet.engines or rollout.fleet.cpus_per_engine, or give the cluster "
                                   "more") from None
            except ray.exceptions.RayTaskError as e:
                log.error("rollout.fleet: engine %d failed to build its base; the run stops", i)
                self.close()
                raise _cause(e) from None
        log.info("rollout.fleet: %d engines up (%s)", len(ready), ", ".join(
            f"engine {r['index']} pid {r['pid']}, base built in {r['build_s']:.1f} s" for r in ready))
        return ready

    def close(self) -> None:
        """Stop the engines (and Ray, when `start` started it)."""
        import ray

        for e in self.engines:
            ray.kill(e.handle, no_restart=True)
        self.engines, self._refs, self.pushed = [], {}, {}
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    # ---- adapters ---------------------------------------------------------------------------------------
    def push(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put adapter `version` into the object store once and have every engine load it in place (after the
        calls it holds: Ray runs an actor's calls in order); the acknowledgements are checked as they come."""
        import ray

        host = {n: t.detach().to("cpu") for n, t in tensors.items()}
        self.pushed[version] = _Pushed(ray.put(host), adapter_checksum(host))
        self.version = version
        self.counts.pushes += 1
        self.counts.push_bytes += sum(t.numel() * t.element_size() for t in host.values())
        for i, e in enumerate(self.engines):
            if not e.gone:
                self._refs[e.handle.load.remote(self.pushed[version].ref, version)] = _Sent("load", i, e.lives,
                                                                                             version=version)

    def forget(self, keep: set[int]) -> None:
        """Drop the pushed versions other than `keep` and the newest (no call in flight samples under them)."""
        for v in [v for v in self.pushed if v not in keep and v != self.version]:
            del self.pushed[v]

    # ---- calls ----------------------------------------------------------------------------------------
    def send(self, call_id: int, payload: dict, version: int) -> int:
        """Send a call to the engine with the fewest calls pending (among those up; if none is, one restarting:
        Ray holds the call until it is back); the engine's index."""
        live = [i for i, e in enumerate(self.engines) if not e.gone]
        if not live:
            raise RuntimeError("rollout.fleet: no engine left (each died more than rollout.fleet.max_restarts "
                               "times, or did not come back within rollout.fleet.start_timeout_s)")
        up = [i for i in live if self.engines[i].up] or live
        i = min(up, key=lambda k: (self.engines[k].pending, k))
        e = self.engines[i]
        ref = e.handle.play.remote(payload, [self.pushed[version].ref], version)
        self._refs[ref] = _Sent("call", i, e.lives, call_id, version)
        e.pending += 1
        return i

    @property
    def calls_in_flight(self) -> int:
        return sum(1 for k in self._refs.values() if k.what == "call")

    def wait(self, block: bool = True) -> list[tuple[int, dict | None]]:
        """The calls that ended: (call id, result), or (call id, None) for a call lost with its engine; `block`:
        until one has (else only those that have by now). Acknowledgements, deaths and engines coming back are
        handled here, everything that has ended by the time it returns."""
        import ray

        while True:
            self._check_down()
            if not self._refs:
                return []
            refs = list(self._refs)
            done, _ = ray.wait(refs, num_returns=1, timeout=REJOIN_POLL_S if block else 0)
            if done:
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            ended = [out for ref in done if (out := self._handle(ref)) is not None]
            if ended or not block:
                return ended

    def _handle(self, ref) -> tuple[int, dict | None] | None:
        import ray

        sent = self._refs.pop(ref)
        if sent.what == "call":
            self.engines[sent.engine].pending -= 1
        try:
            value = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            return self._lost(sent, e)
        except ray.exceptions.RayTaskError as e:  # the engine's own error (a bad request, a failed build)
            raise _cause(e) from None
        if sent.what == "ready":
            self._back(sent.engine, value)
            return None
        got = (value["version"], value["checksum"]) if sent.what == "call" else tuple(value)
        self._check_ack(sent.engine, sent.version, got)
        return (sent.call, value) if sent.what == "call" else None

    def _check_ack(self, i: int, version: int, got: tuple[int, str]) -> None:
        want = self.pushed.get(version)
        if got[0] != version or (want is not None and got[1] != want.checksum):
            raise RuntimeError(f"rollout.fleet: engine {i} acknowledged adapter version {got[0]} with checksum "
                               f"{got[1][:16]}, but version {version} was pushed with checksum "
                               f"{want.checksum[:16] if want else '?'}: its buffers do not hold what was pushed")
        if want is not None:
            want.acks.add(i)

    # ---- deaths and restarts ------------------------------------------------------------------------------
    def _lost(self, sent: _Sent, error: Exception) -> tuple[int, None] | None:
        """What an engine's death cost: a call (returned, for the caller to queue again) or an acknowledgement. The
        first loss of a life counts a failover and starts asking the engine whether Ray has brought it back; a loss
        sent to an earlier life, or while the engine was down, counts nothing more."""
        import ray

        i, e = sent.engine, self.engines[sent.engine]
        if sent.what == "ready":
            if isinstance(error, ray.exceptions.ActorDiedError):
                self._leave(i, error)
            return None
        if e.up and sent.life == e.lives:
            e.up, e.down_since = False, time.monotonic()
            self.counts.failovers += 1
            log.warning("rollout.fleet: engine %d died (%s); its calls go back to the queue", i,
                        str(error).splitlines()[0][:200])
        if sent.what == "call":
            self.counts.lost_calls += 1
            return sent.call, None
        return None

    def _check_down(self) -> None:
        """Ask each engine that died whether it is back (one `ready` in flight at a time); give up on one that is
        not back within start_timeout_s."""
        for i, e in enumerate(self.engines):
            if e.up or e.gone:
                continue
            if time.monotonic() - e.down_since > self.spec.start_timeout_s:
                self._leave(i, TimeoutError(f"not back within rollout.fleet.start_timeout_s="
                                            f"{self.spec.start_timeout_s:g}"))
            elif not any(k.what == "ready" and k.engine == i for k in self._refs.values()):
                self._refs[e.handle.ready.remote()] = _Sent("ready", i, e.lives)

    def _back(self, i: int, info: dict) -> None:
        e = self.engines[i]
        e.up, e.lives = True, e.lives + 1
        log.info("rollout.fleet: engine %d is back (pid %d, base rebuilt in %.1f s, %.1f s after it died)", i,
                 info["pid"], info["build_s"], time.monotonic() - e.down_since)

    def _leave(self, i: int, error: BaseException) -> None:
        import ray

        if isinstance(error, ray.exceptions.RayActorError) and getattr(error, "actor_init_failed", False):
            raise RuntimeError(f"rollout.fleet: engine {i} failed to start again: {error}") from None
        self.engines[i].gone = True
        log.warning("rollout.fleet: engine %d left the fleet (%s); %d left", i, str(error).splitlines()[0][:200],
                    sum(not e.gone for e in self.engines))
        if all(e.gone for e in self.engines):
            raise RuntimeError(f"rollout.fleet: no engine left; the last one: {error}")

    @property
    def alive(self) -> int:
        return sum(e.up and not e.gone for e in self.engines)


def _cause(error) -> BaseException:
    """The exception an actor raised (Ray's RayTaskError wraps it)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _resources(r: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(r.items()) if k in ("CPU", "GPU")) + "}"
