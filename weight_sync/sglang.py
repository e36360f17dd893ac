"""The channel into an SGLang engine (`engine.backend=sglang`): the trainer's LoRA tensors are loaded as a new
adapter version (`SGLangEngine.stage_adapter`: SGLang's load_lora_adapter_from_tensors under `policy@v<N>`), checked,
then served (`commit_adapter`; the old version is unloaded once drained). Any error while loading is a SyncError,
with nothing served from the failed push.

SGLang cannot read adapter weights back, so a push is verified by log-probs of a fixed probe (token ids,
`parity_probe`: by default the first training prompts, each with the base policy's own completion), per token:
a = the staged version in SGLang, b = SGLang's base (no adapter), c = the trainer with the adapter, d = the trainer
with the adapter switched off. The adapter's effect is a - b in the engine and c - d in the trainer. Means over the
probe's tokens (nats/token):

    gap = mean|a - c|    base_gap = mean|b - d|    effect = mean|c - d|    effect_diff = mean|(a - b) - (c - d)|

The push is refused (SyncError; the staged version is unloaded and the engine keeps serving the previous one) when
  * gap > base_gap + sglang.parity_tolerance (with the adapter the engine departs from the trainer by more than it
    does on the base: a model on which the two already disagree, e.g. a random-init MoE whose near-tie routes flip,
    base_gap 0.45 nats/token on a random k3_m2, is not refused for that; its checks are inconclusive), or
  * the check is conclusive and effect_diff > EFFECT_RTOL * effect (0.25: the engine's effect is off by more than a
    quarter of the adapter's own). An adapter SGLang drops (a = b) has effect_diff = effect, one at half or double
    scale about effect / 2 or effect, while a faithful one has only float noise, which the floor keeps below it.
The check is conclusive when effect >= max(sglang.parity_min_effect, NOISE_FACTOR * base_gap): the adapter moves
the probe's log-probs clearly more than the engine and the trainer disagree on the base, the float noise
(NOISE_FACTOR = 10: effect_diff of a faithful push measured 1.0-1.6x base_gap with a bf16 model against an
fp32-autocast one, on the CPU, tiny Qwen3s of 2 and 12 layers; at the floor the threshold effect / 4 is 2.5x
base_gap). An inconclusive check (e.g. the first push, when LoRA B is still ~0) serves the push, says so in the
report (sync/parity_inconclusive = 1), and makes the next push verified too.

When (sglang.verify_push): never; every push; or every_n: push 1, and after a conclusive check that passed at push
k, push k + sglang.verify_every (pushes 1, 1 + n, 1 + 2n, ... while every check is conclusive). A push that is
refused or whose check is inconclusive makes the next push verified.

Merged pushes (`SGLangMergedChannel`, sglang.push=merged: a K3 adapter SGLang's K3 LoRA cannot serve): every push
writes, for each adapted linear, W = W0 + s * B @ A computed from the trainer's FROZEN base weight W0 (never
cumulative), in W0's dtype, under its checkpoint name, all in one update_weights_from_tensor call; requests then go
to SGLang's base. The same Parity decides, with a = the engine after the write and b = the engine's base measured
once, before the first write (when it still serves W0). A refused or failed push writes back what the engine served
before (the previous push's merged weights, recomputed from its A / B, which the channel keeps; W0 before any).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_k3.model.k3 import CHECKPOINT_PREFIX
from miles_k3.model.lora import expert_loras, lora_linears
from miles_k3.rollout.api import check_forward
from miles_k3.rollout.sglang_config import PROBE_MODES
from miles_k3.weight_sync.push import PushReport, SyncError, sync_devices

if TYPE_CHECKING:
    from miles_k3.rollout.sglang_config import SGLangConfig

log = logging.getLogger("miles_k3.weight_sync")
EFFECT_RTOL = 0.25  # refuse when the engine's effect differs from the trainer's by more than this part of it
NOISE_FACTOR = 10.0  # a check is conclusive when the trainer's effect is this many times the base gap (or more)
Logprobs = Callable[[list[int]], list[float]]


def _check_forward(engine, version: int) -> None:
    """A push must carry a newer version than the engine serves (`rollout.api.check_forward`): SyncError if not."""
    try:
        check_forward(engine.weight_version, version, strict=True)
    except ValueError as e:
        raise SyncError(f"push of version {version} refused: {e}") from None


@dataclass(frozen=True)
class Parity:
    """One push check's means over the probe (nats/token; see the module docstring for a, b, c, d)."""

    gap: float  # mean|a - c|
    base_gap: float  # mean|b - d|
    effect_trainer: float  # mean|c - d|
    effect_engine: float  # mean|a - b|
    effect_diff: float  # mean|(a - b) - (c - d)|
    floor: float  # the trainer's effect below which the check is inconclusive

    @classmethod
    def of(cls, a: list[float], b: list[float], c: list[float], d: list[float], min_effect: float) -> Parity:
        def mean(xs) -> float:
            return sum(xs) / len(xs)

        base_gap = mean([abs(x - y) for x, y in zip(b, d)])
        return cls(gap=mean([abs(x - y) for x, y in zip(a, c)]), base_gap=base_gap,
                   effect_trainer=mean([abs(x - y) for x, y in zip(c, d)]),
                   effect_engine=mean([abs(x - y) for x, y in zip(a, b)]),
                   effect_diff=mean([abs((w - x) - (y - z)) for w, x, y, z in zip(a, b, c, d)]),
                   floor=max(min_effect, NOISE_FACTOR * base_gap))

    @property
    def inconclusive(self) -> bool:
        return self.effect_trainer < self.floor

    def refusal(self, tolerance: float) -> str | None:
        """Why the push is refused, or None."""
        if self.gap > self.base_gap + tolerance:
            return (f"the engine's log-probs differ from the trainer's by {self.gap:.4g} nats/token on the probe, "
                    f"{self.gap - self.base_gap:.4g} more than on the base ({self.base_gap:.4g}; > "
                    f"sglang.parity_tolerance={tolerance}; "
                    f"the adapter moves the trainer's by {self.effect_trainer:.4g} and the engine's by "
                    f"{self.effect_engine:.4g}); the adapter did not arrive as trained (names, layout or scaling)")
        if not self.inconclusive and self.effect_diff > EFFECT_RTOL * self.effect_trainer:
            return (f"the adapter moves the engine's log-probs by {self.effect_engine:.4g} nats/token and the "
                    f"trainer's by {self.effect_trainer:.4g}: they differ by {self.effect_diff:.4g} (> "
                    f"{EFFECT_RTOL} x the trainer's effect); SGLang dropped or mis-scaled the adapter (target "
                    "modules, lora_alpha / rank scaling, a name it skipped)")
        return None

    def metrics(self) -> dict[str, float]:
        return {"sync/parity_logprob_abs_diff": self.gap, "sync/parity_base_abs_diff": self.base_gap,
                "sync/parity_effect_trainer": self.effect_trainer, "sync/parity_effect_engine": self.effect_engine,
                "sync/parity_effect_diff": self.effect_diff, "sync/parity_inconclusive": float(self.inconclusive)}


def check_probe(mode: str, length: int, prompts: list[list[int]]) -> None:
    """Why `parity_probe(mode, length, prompts)` cannot be built (ValueError), checked before any engine starts."""
    if mode not in PROBE_MODES:
        raise ValueError(f"sglang.probe: '{mode}' is not one of {', '.join(PROBE_MODES)}")
    if not prompts or not prompts[0]:
        raise ValueError("parity probe: no training prompt (or an empty first prompt) to build it from")
    if mode == "completions" and len(prompts[0]) >= length:
        raise ValueError(f"sglang.probe=completions: the first training prompt has {len(prompts[0])} tokens, "
                         f">= sglang.probe_tokens={length}, so the probe would hold none of the policy's own text; "
                         f"set sglang.probe_tokens above it (e.g. {len(prompts[0]) + 64})")


def parity_probe(mode: str, length: int, prompts: list[list[int]],
                 complete: Callable[[list[list[int]], int], list[list[int]]] | None = None) -> list[int]:
    """The probe's `length` token ids from the training prompts `prompts` (token ids, in the data's order), as
    sglang.probe says:
      completions: prompt 0, then its completion, prompt 1, its completion, ... cut at `length` (the pairs start
        over when the prompts run out). `complete(prompts, max_new)` gives the base policy's greedy completion of
        each prompt, at most max_new = `length` tokens: text the policy reads and writes, where the trainer and
        the engine agree as they do on the rollouts.
      prompt: prompt 0 repeated (text the policy never writes: a policy trained far from its base puts little
        probability on it, and bf16 noise there grows with the adapter's effect).
    Prompts are taken until they alone would fill `length` (at most 64)."""
    check_probe(mode, length, prompts)
    if mode == "prompt":
        first = prompts[0]
        return (first * (length // len(first) + 1))[:length]
    used, filled = [], 0
    for ids in prompts[:64]:
        used.append(list(ids))
        filled += len(ids)
        if filled >= length:
            break
    done = complete(used, length) if complete is not None else None
    if done is None or len(done) != len(used):
        raise ValueError(f"parity probe: {0 if done is None else len(done)} completions for {len(used)} prompts")
    pairs = [t for ids, out in zip(used, done) for t in (*ids, *out)]
    return (pairs * (length // len(pairs) + 1))[:length]


class _VerifiedPushes:
    """What both channels share: the probe, the trainer's log-probs and the verification schedule."""

    def __init__(self, engine, adapter: str, cfg: SGLangConfig, probe_ids: list[int] | None,
                 trainer_logprobs: Logprobs | None, trainer_base_logprobs: Logprobs | None):
        cfg.validate()
        if cfg.verify_push != "never" and (not probe_ids or len(probe_ids) < 2 or trainer_logprobs is None
                                           or trainer_base_logprobs is None):
            raise ValueError("a verified sglang push needs probe_ids (>= 2 token ids), trainer_logprobs and "
                             "trainer_base_logprobs")
        self.engine, self.adapter, self.cfg = engine, adapter, cfg
        self.probe_ids, self.trainer_logprobs, self.trainer_base_logprobs = (probe_ids, trainer_logprobs,
                                                                            trainer_base_logprobs)
        self.pushes = 0  # pushes served
        self._skips_left = 0  # pushes to serve unchecked before the next verified one
        self._warned_base = False  # the base-gap warning is logged once

    def _due(self) -> bool:
        """Whether this push is verified (the schedule of the module docstring); counts the skipped ones."""
        if self.cfg.verify_push == "never":
            return False
        if self._skips_left > 0:
            self._skips_left -= 1
            return False
        return True

    def _passed(self, parity: Parity, version: int) -> None:
        """A check that passed: schedule the next one (an inconclusive check makes the next push verified)."""
        if parity.base_gap > self.cfg.parity_tolerance and not self._warned_base:
            self._warned_base = True
            log.warning("sglang and the trainer differ by %.3g nats/token on the probe without the adapter (> "
                        "sglang.parity_tolerance=%s): the rollouts are that far off-policy whatever is pushed (a "
                        "random-init MoE's near-tie routes flip between kernels), and pushes are checked only against "
                        "that difference", parity.base_gap, self.cfg.parity_tolerance)
        if parity.inconclusive:
            log.info("sglang push of version %d served, its check inconclusive: the adapter moves the probe's "
                     "log-probs by %.3g nats/token (< %.3g, the noise floor); the next push is verified too",
                     version, parity.effect_trainer, parity.floor)
        else:
            self._skips_left = (1 if self.cfg.verify_push == "every" else self.cfg.verify_every) - 1

    def _probe(self, engine_rows: dict[str, list[float]]) -> Parity:
        """The Parity of the engine's rows (a, b) and the trainer's (c, d) on the probe."""
        ids = self.probe_ids
        rows = engine_rows | {"trainer": self.trainer_logprobs(ids), "trainer (base)": self.trainer_base_logprobs(ids)}
        bad = {name: len(r) for name, r in rows.items() if len(r) != len(ids) - 1}
        if bad:
            raise SyncError(f"parity probe: {bad} log-probs for a {len(ids)}-token probe (want {len(ids) - 1})")
        return Parity.of(*rows.values(), min_effect=self.cfg.parity_min_effect)

    def close(self) -> None:
        """Nothing to release: the engine is the run's and is shut down with it."""


class SGLangChannel(_VerifiedPushes):
    """`push(tensors, version)` into `engine` (an SGLangEngine) as adapter `adapter`, checked as `cfg` says
    (verify_push, verify_every, parity_tolerance, parity_min_effect). `trainer_logprobs(ids)` and
    `trainer_base_logprobs(ids)` are the trainer's log-probs of ids[1:] with the adapter and with it switched off,
    without dropout."""

    transport = "sglang"

    def __init__(self, engine, adapter: str, cfg: SGLangConfig, probe_ids: list[int] | None = None,
                 trainer_logprobs: Logprobs | None = None, trainer_base_logprobs: Logprobs | None = None):
        if engine.serving(adapter) is None:
            raise ValueError(f"adapter '{adapter}' is not loaded in the sglang engine; load it first")
        super().__init__(engine, adapter, cfg, probe_ids, trainer_logprobs, trainer_base_logprobs)

    def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """Serve `tensors` (the trainer's adapter parameters by name) as `version`. Raises SyncError (the engine
        keeps serving its previous version) when loading fails or the parity check does not pass."""
        devices = {t.device for t in tensors.values()} or {torch.device("cpu")}
        sync_devices(devices)
        t0 = time.perf_counter()
        _check_forward(self.engine, version)
        try:
            staged = self.engine.stage_adapter(self.adapter, tensors, version)
        except ValueError as e:
            raise SyncError(f"push of version {version} refused: {e}",
                            next((n for n in tensors if n in str(e)), None)) from None
        except Exception as e:  # SGLang's own failure to load: nothing was served
            raise SyncError(f"push of version {version} failed in sglang: {type(e).__name__}: {e}") from e
        load_s = time.perf_counter() - t0
        parity = self._check(staged, version) if self._due() else None
        self.engine.commit_adapter(self.adapter, staged)
        self.pushes += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return SGLangPushReport(version, self.transport, nbytes, time.perf_counter() - t0, len(tensors),
                                load_seconds=load_s, parity=parity)

    def _check(self, staged: str, version: int) -> Parity:
        """The staged version's Parity; a refused push is discarded (SyncError)."""
        serving = self.engine.weight_version
        try:
            parity = self._parity(staged)
        except Exception as e:
            self.engine.discard_adapter(staged)
            raise SyncError(f"push of version {version} refused: the parity probe failed ({type(e).__name__}: "
                            f"{e}); the engine keeps serving version {serving}") from e
        why = parity.refusal(self.cfg.parity_tolerance)
        if why is not None:
            self.engine.discard_adapter(staged)
            raise SyncError(f"push of version {version} refused: {why}; the engine keeps serving version {serving}",
                            metrics=parity.metrics())
        self._passed(parity, version)
        return parity

    def _parity(self, staged: str) -> Parity:
        ids = self.probe_ids
        return self._probe({"engine (staged)": self.engine.prompt_logprobs(ids, staged),
                            "engine (base)": self.engine.prompt_logprobs(ids, None)})


# ---- merged pushes (sglang.push=merged) ------------------------------------------------------------------
def merged_weights(model, adapter: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint name (`language_model.<module path>.weight`) -> W0 + s * B @ A [Out, In] for every LoRA-wrapped
    linear of `model` (a K3ForCausalLM with LoRA applied): W0 is the module's frozen base weight, s its scale
    (`lora_scale`), A [r, In] / B [Out, r] the `adapter`'s tensors by `lora_parameters` name (None: the model's
    own); summed in fp32 and rounded once to W0's dtype, on W0's device. Never cumulative: W0 is not changed.
    Raises ValueError for expert adapters (w1/w2/w3: no dense weight to merge into) and for a missing or
    mis-shaped adapter tensor."""
    experts = expert_loras(model)
    if experts:
        path, name, _ = experts[0]
        raise ValueError(f"{path}.{name}: expert adapters cannot be merged into SGLang's MXFP4 experts")
    out = {}
    with torch.no_grad():
        for path, m in lora_linears(model):
            a, b = (_adapter_tensor(adapter, f"{path}.{ab}.weight", own.weight)
                    for ab, own in (("lora_A", m.lora_A), ("lora_B", m.lora_B)))
            out[f"{CHECKPOINT_PREFIX}{path}.weight"] = _merge(m.weight, a, b, m.scale)
    return out


def _merge(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 + scale * B @ A, summed in fp32 and rounded once to W0's dtype."""
    return (w0.float() + (b.float() @ a.float()) * scale).to(w0.dtype)


def _adapter_tensor(adapter: Mapping[str, torch.Tensor] | None, name: str, own: torch.Tensor) -> torch.Tensor:
    if adapter is None:
        return own.detach()
    if name not in adapter:
        raise ValueError(f"adapter tensor {name} is missing (a merged push carries the whole adapter)")
    t = adapter[name]
    if tuple(t.shape) != tuple(own.shape):
        raise ValueError(f"adapter tensor {name}: shape {tuple(t.shape)}, the model's is {tuple(own.shape)}")
    return t.detach().to(own.device)


def merged_from_checkpoint(path, lora, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `merged_weights` gives for a saved adapter, without building the model: checkpoint name -> W0 + s * B @ A
    for each module of `tensors` (an adapter file's PEFT-named A / B, `miles_k3.model.adapter.read_adapter`), W0 read from
    the K3 checkpoint directory `path`, s the scale of `lora` (a LoRAConfig), summed in fp32 and rounded once to
    W0's stored dtype (python -m miles_k3.eval engine.backend=sglang serves an adapter SGLang's K3 LoRA cannot so).
    Raises ValueError naming the module for an expert adapter, a module the checkpoint lacks, or a shape that does
    not fit W0."""
    from miles_k3.model.adapter import PEFT_PREFIX, lora_pairs
    from miles_k3.model.lora import lora_scale
    from miles_k3.model.weight_files import inspect_weights, open_safetensors

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for module, ab in lora_pairs(tensors).items():
        if not module.startswith(PEFT_PREFIX):
            raise ValueError(f"adapter module {module}: not a K3 module (expected {PEFT_PREFIX}<module path>)")
        if ".experts." in module:
            raise ValueError(f"adapter module {module}: expert adapters cannot be merged into SGLang's MXFP4 experts")
        pairs[CHECKPOINT_PREFIX + module.removeprefix(PEFT_PREFIX) + ".weight"] = ab
    info = inspect_weights(path)
    missing = [name for name in pairs if name not in info.tensors]
    if missing:
        raise ValueError(f"adapter modules {missing[:3]}: checkpoint {path} has no such weight; the adapter belongs "
                         "to another model")
    by_file: dict = {}
    for name in sorted(pairs):
        by_file.setdefault(info.tensors[name][0], []).append(name)
    scale = lora_scale(lora.rank, lora.alpha, lora.use_rslora)
    out = {}
    with torch.no_grad():
        for file, names in by_file.items():
            with open_safetensors(file, names) as f:
                for name in names:
                    w0, a, b = f.get_tensor(name), pairs[name]["A"], pairs[name]["B"]
                    if (b.shape[0], a.shape[1]) != tuple(w0.shape):
                        raise ValueError(f"adapter for {name}: B @ A is {b.shape[0]} x {a.shape[1]}, the "
                                         f"checkpoint's weight is {tuple(w0.shape)}")
                    out[name] = _merge(w0, a, b, scale)
    return out


def base_weights(model) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the frozen base weight W0 of every LoRA-wrapped linear (what SGLang served at start)."""
    return {f"{CHECKPOINT_PREFIX}{path}.weight": m.weight.detach() for path, m in lora_linears(model)}


class SGLangMergedChannel(_VerifiedPushes):
    """`push(tensors, version)` of adapter `adapter` as merged base weights into `engine` (an SGLangEngine with
    push=merged), the trainer's `model` holding W0 and the LoRA modules; `tensors` are the adapter's A / B by
    `lora_parameters` name. Checked as SGLangChannel is (module docstring), b measured once, here, while the engine
    still serves W0. `serve_initial` writes the adapter the run starts with (a resumed run's)."""

    transport = "sglang-merged"

    def __init__(self, engine, adapter: str, cfg: SGLangConfig, model, probe_ids: list[int] | None = None,
                 trainer_logprobs: Logprobs | None = None, trainer_base_logprobs: Logprobs | None = None):
        super().__init__(engine, adapter, cfg, probe_ids, trainer_logprobs, trainer_base_logprobs)
        if expert_loras(model):
            raise ValueError("a merged push cannot carry expert adapters (w1/w2/w3): SGLang's experts are MXFP4")
        engine.serve_merged(adapter)
        self.model = model
        self._engine_base = engine.prompt_logprobs(probe_ids, None) if cfg.verify_push != "never" else None
        self._served: dict[str, torch.Tensor] | None = None  # the A / B merged into what the engine serves; None: W0
        self.broken: str | None = None  # why the engine's weights are unknown (a restore failed)

    def serve_initial(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the merged weights of `tensors` without a check (the engine's weight_version unchanged), as the
        LoRA path loads its first adapter."""
        self.engine.write_base_weights(merged_weights(self.model, tensors))
        self._served = _kept(tensors)

    def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """Serve `tensors` merged as `version`. Raises SyncError (the engine serving its previous weights again)
        when the merge, the write or the parity check fails."""
        sync_devices({t.device for t in tensors.values()} or {torch.device("cpu")})
        t0 = time.perf_counter()
        if self.broken is not None:
            raise SyncError(f"push of version {version} refused: {self.broken}")
        _check_forward(self.engine, version)
        try:
            merged = merged_weights(self.model, tensors)
        except ValueError as e:
            raise SyncError(f"push of version {version} refused: {e}") from None
        finite = torch.stack([torch.isfinite(t).all() for t in merged.values()]).tolist()  # one device sync
        bad = next((name for name, ok in zip(merged, finite) if not ok), None)
        if bad is not None:
            raise SyncError(f"push of version {version} refused: merged weight {bad} has non-finite values", bad)
        serving = self.engine.weight_version
        if self.engine.running():
            raise SyncError(f"push of version {version} refused: {self.engine.running()} requests run (base weights "
                            f"change only between requests); nothing written, the engine serves version {serving}")
        try:
            self.engine.write_base_weights(merged)
        except Exception as e:  # SGLang may have loaded part of it: write back what it served
            raise SyncError(f"push of version {version} failed in sglang: {type(e).__name__}: {e}; "
                            f"{self._restore(serving)}") from e
        load_s = time.perf_counter() - t0
        parity = self._check(version, serving) if self._due() else None
        self.engine.weight_version = version
        self._served = _kept(tensors)
        self.pushes += 1
        nbytes = sum(t.numel() * t.element_size() for t in merged.values())
        return SGLangPushReport(version, self.transport, nbytes, time.perf_counter() - t0, len(merged),
                                load_seconds=load_s, parity=parity)

    def _check(self, version: int, serving: int) -> Parity:
        try:
            parity = self._probe({"engine (merged)": self.engine.prompt_logprobs(self.probe_ids, None),
                                  "engine (base)": self._engine_base})
        except Exception as e:
            raise SyncError(f"push of version {version} refused: the parity probe failed ({type(e).__name__}: "
                            f"{e}); {self._restore(serving)}") from e
        why = parity.refusal(self.cfg.parity_tolerance)
        if why is not None:
            raise SyncError(f"push of version {version} refused: {why}; {self._restore(serving)}",
                            metrics=parity.metrics())
        self._passed(parity, version)
        return parity

    def _restore(self, serving: int) -> str:
        """Write back what the engine served before this push, in one call; says what it serves now."""
        previous = merged_weights(self.model, self._served) if self._served is not None else base_weights(self.model)
        try:
            self.engine.write_base_weights(previous)
        except Exception as e:  # noqa: BLE001 - reported in the push's SyncError; later pushes are refused
            self.broken = (f"writing back the weights of version {serving} failed too ({type(e).__name__}: {e}), so "
                           "the engine's weights are unknown; restart the run from its last checkpoint")
            return self.broken
        return f"the engine serves version {serving} again"


def _kept(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of the adapter's A / B (the optimizer updates the trainer's in place)."""
    return {name: t.detach().clone() for name, t in tensors.items()}


@dataclass
class SGLangPushReport(PushReport):
    """A PushReport with the adapter load time and the parity check (None when this push was not checked)."""

    load_seconds: float = 0.0
    parity: Parity | None = None

    def metrics(self) -> dict[str, float]:
        m = super().metrics() | {"sync/load_seconds": self.load_seconds}
        if self.parity is not None:
            m |= self.parity.metrics()
        return m
