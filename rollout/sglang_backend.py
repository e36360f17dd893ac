"""`engine.backend=sglang`: the rollout-engine interface of `RolloutEngine` over a real `sglang.Engine`.

The engine is built in the training process (SGLang runs its scheduler and model in its own subprocesses) from
the typed `sglang:` config (`SGLangConfig`), token in / token out (`skip_tokenizer_init`). What the loop sees is
the same as with the native engine (`rollout.api.Engine`):

* `generate(input_ids, sampling_params, n, return_logprob, lora)` -> one record per sample (`rollout.api`), prompt
  i's sample j at i * n + j: `output_ids`, `meta_info` {finish_reason, prompt_tokens, completion_tokens,
  cached_tokens, weight_version, output_token_logprobs [(logprob, token_id)]}, or `error` for a rejected request;
  return_routed_experts=True is refused (SGLang records no routes for this backend). Sample j of a
  prompt with `sampling_seed` s is sent with seed s + j (the native engine's rule), so groups are reproducible.
* The trained adapter is pushed from tensors under versioned names: `load_lora_adapter_from_tensors(name=policy)`
  serves `policy@v<N>` (SGLang cannot update an adapter in place: a reused name is refused), requests for `policy`
  go to the newest version, and the previous version is unloaded once no request of this engine uses it.
  `update_weights_from_tensor(tensors)` without `lora_name` updates base weights (SGLang's own call).
* `stage_adapter` / `commit_adapter` / `discard_adapter` split a push so the channel can check a staged version by
  logprob parity before it serves (`miles_k3.weight_sync.sglang`): SGLang cannot read adapter weights back.
* `release_memory_occupation` / `resume_memory_occupation` (kv_cache, cuda_graph, weights): needs
  `enable_memory_saver`; releasing `weights` needs `enable_weights_cpu_backup` (otherwise SGLang resumes them as
  garbage).
* A K3 checkpoint directory (`k3_checkpoint`) is checked before SGLang starts (the nested config, the shapes SGLang
  0.5.17's kernels need), served with K3's server arguments, and pushed as a LoRA adapter only when every target is
  one SGLang's K3 LoRA serves (`resolve_push`); otherwise (`sglang.push=merged`) the channel writes merged base
  weights (`write_base_weights`: one `update_weights_from_tensor` call per push) and requests for the adapter go to
  the base (`serve_merged`).

SGLang is an optional extra (`pip install 'miles-k3[sglang]'`), imported only when this engine is built.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from miles_k3.model.lora import lora_scale
from miles_k3.rollout.api import BACKEND_CAPABILITIES, Record, VersionedEngine, check_tags, sample_meta
from miles_k3.rollout.requests import generate_requests
from miles_k3.rollout.sglang_config import SGLangConfig
from miles_k3.rollout.sglang_k3 import K3Checkpoint, k3_checkpoint, moe_runner, resolve_push

log = logging.getLogger("miles_k3.rollout")

INSTALL_HINT = ("engine.backend=sglang needs SGLang: pip install 'miles-k3[sglang]' (SGLang serves on CUDA GPUs; "
                "releases pinning torch 2.11 end at sglang 0.5.17), or set engine.backend=native")


def server_args(cfg: SGLangConfig, model_path: str, lora=None, seed: int = 0,
                k3: K3Checkpoint | None = None, fp32_lm_head: bool = False) -> dict[str, Any]:
    """The keyword arguments of `sglang.Engine(...)` for `cfg` serving `model_path` with adapters like `lora`
    (a LoRAConfig, or None for no adapter); `k3`: the directory is this K3 checkpoint (`k3_checkpoint`);
    `fp32_lm_head` (model.fp32_lm_head): SGLang's enable_fp32_lm_head, logits in fp32 as the trainer's."""
    cfg.validate()
    args: dict[str, Any] = {
        "model_path": model_path, "skip_tokenizer_init": True, "random_seed": seed,
        "attention_backend": cfg.attention_backend, "sampling_backend": cfg.sampling_backend,
        "mem_fraction_static": cfg.mem_fraction_static, "disable_cuda_graph": not cfg.cuda_graph,
        "enable_memory_saver": cfg.enable_memory_saver, "enable_weights_cpu_backup": cfg.enable_weights_cpu_backup,
        "dtype": cfg.dtype, "log_level": cfg.log_level,
    }
    if cfg.context_length is not None:
        args["context_length"] = cfg.context_length
    if fp32_lm_head:
        args["enable_fp32_lm_head"] = True
    if k3 is not None:
        # K3 is a VLM class in SGLang: multimodal on builds the K3 image processor, which our tokenizer directory
        # lacks (managers/tokenizer_manager.py:468-490, multimodal/processors/kimi_k3.py:306-326).
        args["enable_multimodal"] = False
        if cfg.dtype == "auto":  # a config.json without a dtype makes SGLang's auto fp16 (configs/model_config.py
            args["dtype"] = "bfloat16"  # :1663-1684); K3 is bf16 whatever the file says
    runner = moe_runner(cfg, k3)
    if runner is not None:
        args["moe_runner_backend"] = runner
    if cfg.enable_lora and lora is not None:
        args |= {"enable_lora": True, "max_lora_rank": cfg.max_lora_rank or lora.rank,
                 "lora_target_modules": list(cfg.lora_target_modules or lora.targets),
                 "max_loras_per_batch": cfg.max_loras_per_batch}
        if cfg.lora_backend is not None:
            args["lora_backend"] = cfg.lora_backend
    return args | dict(cfg.extra_args)


def import_engine_class():
    """sglang.Engine, or ImportError saying how to install it."""
    try:
        import sglang
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from None
    return sglang.Engine


def versioned_name(adapter: str, version: int) -> str:
    return f"{adapter}@v{version}"


def version_of(name: str) -> int | None:
    """The version a versioned adapter name carries (`policy@v12` -> 12), else None."""
    head, sep, tail = name.rpartition("@v")
    return int(tail) if sep and head and tail.isdigit() else None


def peft_config_dict(lora) -> dict[str, Any]:
    """adapter_config.json as a dict (what SGLang's load_lora_adapter_from_tensors takes) for a LoRAConfig. SGLang
    0.5.17 ignores use_rslora (its scaling is lora_alpha / r: lora/lora.py:71), so the alpha sent is the one whose
    alpha / r is our scale (alpha * sqrt(r) with rsLoRA), with use_rslora false."""
    alpha = lora_scale(lora.rank, lora.alpha, True) * lora.rank if lora.use_rslora else lora.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": float(alpha),
            "lora_dropout": 0.0, "target_modules": list(lora.targets), "use_rslora": False,
            "bias": "none", "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False}


def check_result(result, what: str) -> None:
    """SGLang reports a failed control call in its return value ((success, message), or an object with success and
    error_message): raise RuntimeError with its message."""
    if result is None:
        return
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        ok, message = result
    elif hasattr(result, "success"):
        ok, message = result.success, getattr(result, "error_message", None)
    else:
        return
    if not ok:
        raise RuntimeError(f"sglang {what} failed: {message}")


def serve_checkpoint(cfg: SGLangConfig, model_cfg, tokenizer, stop_token_ids: list[int], lora=None, seed: int = 0,
                     fallback_context: int = 4096, push: str | None = None) -> SGLangEngine:
    """The SGLangEngine serving the checkpoint directory `model_cfg` names (`hf_path`, else `path`), with adapters
    like `lora` (None: the base alone) pushed as `push` (None: sglang.push), ending every sample at
    `stop_token_ids`. A request may hold `sglang.context_length`, else the checkpoint's max_position_embeddings (its
    config.json), else `fallback_context` tokens."""
    if not stop_token_ids:
        raise ValueError("engine.eos_token_ids: the model directory names no stop token (no eos_token_id in "
                         "generation_config.json or the tokenizer); set engine.eos_token_ids=[ID, ...]")
    path = model_cfg.hf_path or model_cfg.path
    return SGLangEngine(cfg, path, lora=lora, seed=seed, tokenizer=tokenizer, stop_token_ids=list(stop_token_ids),
                        max_context=checkpoint_context(path) or fallback_context, push=push,
                        fp32_lm_head=model_cfg.fp32_lm_head)


def checkpoint_context(path: str) -> int | None:
    """max_position_embeddings of the checkpoint directory `path` (config.json, or its text_config), or None."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    value = raw.get("max_position_embeddings") or (raw.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


class SGLangEngine(VersionedEngine):
    """The `RolloutEngine` interface over `sglang.Engine` (see the module docstring). Adapter tensors are pushed
    under their PEFT names (`miles_k3.model.adapter.peft_tensors`), which SGLang loads, or merged into the base weights
    (`push`: the resolved mode, `resolve_push`). A K3 checkpoint directory is checked (`k3_checkpoint`) before
    SGLang starts. `stop_token_ids` end every sample (added to each request's sampling params unless it names its
    own). `fp32_lm_head`: SGLang computes the logits in fp32 (model.fp32_lm_head). `engine_cls` replaces
    sglang.Engine (tests pass a double)."""

    backend = "sglang"
    capabilities = BACKEND_CAPABILITIES[backend]  # generate, push and release only
    push_needs_memory = True  # a push's parity probe runs a request: the loop resumes memory before it

    def __init__(self, cfg: SGLangConfig, model_path: str, lora=None, seed: int = 0, tokenizer: Any = None,
                 stop_token_ids: list[int] | None = None, max_context: int = 4096, engine_cls=None,
                 push: str | None = None, fp32_lm_head: bool = False):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_context = cfg.context_length or max_context  # prompt + completion tokens a request may hold
        self.stop_token_ids = list(stop_token_ids or [])
        cfg.validate()
        self.k3 = k3_checkpoint(model_path, cfg)
        self.push, why = resolve_push(push or cfg.push, lora, self.k3, cfg)
        args = server_args(cfg, model_path, lora if self.push == "lora" else None, seed, self.k3, fp32_lm_head)
        engine_cls = engine_cls or import_engine_class()
        if self.push is not None:
            log.info("sglang push=%s (%s)", self.push, why)
        log.info("sglang engine: %s", ", ".join(f"{k}={v}" for k, v in args.items() if k != "model_path"))
        self.engine = engine_cls(**args)
        self._serving: dict[str, str] = {}  # adapter name -> the versioned SGLang name requests go to
        self._configs: dict[str, Any] = {}
        self._in_flight: Counter[str] = Counter()  # versioned name -> requests of ours running on it
        self._retired: set[str] = set()  # replaced versions, unloaded once their requests finish
        self._released: set[str] = set()
        self._merged: set[str] = set()  # adapters served merged into the base (push=merged)
        self._running = 0  # requests of ours in SGLang now (a base-weight update needs none)
        self._lock = threading.RLock()

    # ---- generation ------------------------------------------------------------------------------------
    def generate(self, input_ids: list[list[int]] | None = None, prompts: list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, n: int = 1, return_logprob: bool = True,
                 lora: str | list[str | None] | None = None, return_routed_experts: bool = False) -> list[Record]:
        """Samples for every prompt, `n` each, prompt i's sample j at i * n + j (see the module docstring).
        `return_routed_experts` is refused: this backend does not record routes (`config_checks` says why)."""
        if return_routed_experts:
            raise ValueError("return_routed_experts: the sglang engine does not record routed experts; use "
                             "engine.backend=native to record or replay routes")
        ids, params, loras = generate_requests(input_ids, prompts, sampling_params, n, lora, self.tokenizer,
                                               self._released)
        with self._lock:
            names = [self._route(name) for name in loras]
            used = Counter(name for name in names for _ in range(n) if name is not None)
            self._in_flight.update(used)
            self._running += len(names) * n
        reqs, sps, paths = [], [], []
        for p, sp, name in zip(ids, params, names):
            for j in range(n):
                one = dict(sp)
                if self.stop_token_ids and "stop_token_ids" not in one:
                    one["stop_token_ids"] = list(self.stop_token_ids)
                if one.get("sampling_seed") is not None:
                    one["sampling_seed"] = int(one["sampling_seed"]) + j
                reqs.append(list(p))
                sps.append(one)
                paths.append(name)
        try:
            outs = self.engine.generate(input_ids=reqs, sampling_params=sps, return_logprob=return_logprob,
                                        lora_path=paths if any(paths) else None) if reqs else []
        finally:
            with self._lock:
                self._in_flight.subtract(used)
                self._running -= len(names) * n
                self._unload_drained()
        if len(outs) != len(reqs):
            raise RuntimeError(f"sglang returned {len(outs)} results for {len(reqs)} requests")
        return [self._record(o, name, return_logprob) for o, name in zip(outs, paths)]

    def prompt_logprobs(self, ids: list[int], adapter: str | None) -> list[float]:
        """SGLang's log-probs of ids[1:] given their prefixes (prompt log-probs), with the adapter as served under
        the versioned or plain SGLang name `adapter` (None: the base)."""
        out = self.engine.generate(input_ids=[list(ids)], sampling_params=[{"max_new_tokens": 1,
                                                                             "temperature": 0.0}],
                                   return_logprob=True, logprob_start_len=0,
                                   lora_path=[adapter] if adapter is not None else None)
        rows = out[0]["meta_info"]["input_token_logprobs"]
        values = [row[0] for row in rows]
        if len(values) == len(ids) and values[0] is None:
            values = values[1:]  # the first prompt token has no log-prob
        if len(values) != len(ids) - 1 or any(v is None for v in values):
            raise RuntimeError(f"sglang returned {len(values)} prompt log-probs for a {len(ids)}-token probe")
        return [float(v) for v in values]

    # ---- adapters and weights --------------------------------------------------------------------------
    def load_lora_adapter_from_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], config) -> None:
        """Serve adapter `name` (config: its LoRAConfig) from the trainer's tensors, as version weight_version."""
        if self.push != "lora":
            raise ValueError(f"adapter '{name}': this engine pushes {self.push or 'no adapter'}, not a LoRA "
                             "adapter (sglang.push)")
        self._configs[name] = config
        staged = self.stage_adapter(name, tensors, self.weight_version)
        self.commit_adapter(name, staged)

    def update_weights_from_tensor(self, named_tensors: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
                                   lora_name: str | None = None, weight_version: int | None = None) -> None:
        """With `lora_name`: serve a new version of that adapter from `named_tensors` (the trainer's names). Without:
        update base weights in place (HF names; SGLang's update_weights_from_tensor). The engine's weight_version
        becomes `weight_version` (default: one more); versions only move forward."""
        version = self.next_version(weight_version)
        if lora_name is None:
            self.write_base_weights(dict(named_tensors))
            self.weight_version = version
            return
        staged = self.stage_adapter(lora_name, named_tensors, version)
        self.commit_adapter(lora_name, staged)

    def write_base_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Write base weights by checkpoint name in ONE update_weights_from_tensor call (flush_cache=True), the
        weight_version unchanged. Refused (RuntimeError, nothing sent) while requests of ours run: SGLang's flush
        after an update asserts an idle scheduler (managers/scheduler.py:4137-4160), and a request would mix
        weights. SGLang skips names its model lacks without a word (models/kimi_k3.py:2824-2825, :2846-2847)."""
        with self._lock:
            if self._running:
                raise RuntimeError(f"base weights cannot be updated while {self._running} requests run")
            check_result(self.engine.update_weights_from_tensor(named_tensors=list(named_tensors.items()),
                                                                flush_cache=True), "update_weights_from_tensor")

    def running(self) -> int:
        """Requests of ours in SGLang now."""
        with self._lock:
            return self._running

    def serve_merged(self, name: str) -> None:
        """Serve adapter `name` merged into the base weights (push=merged): requests for it go to the base, whose
        weights the channel writes (`write_base_weights`)."""
        if self.push != "merged":
            raise ValueError(f"adapter '{name}': this engine pushes {self.push}, not merged (sglang.push)")
        self._merged.add(name)

    def stage_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], version: int) -> str:
        """Load the tensors as `name@v<version>` without serving it yet; returns the staged SGLang name. Refuses
        (ValueError, nothing loaded) an unknown adapter, an empty push or a non-finite tensor."""
        if name not in self._configs:
            raise ValueError(f"adapter '{name}' is not loaded; load_lora_adapter_from_tensors first (loaded: "
                             f"{sorted(self._configs)})")
        if not tensors:
            raise ValueError("empty push: no tensors given (a push must carry the whole adapter)")
        finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()  # one device sync
        bad = next((key for key, ok in zip(tensors, finite) if not ok), None)
        if bad is not None:
            raise ValueError(f"tensor {bad} has non-finite values; the push is refused")
        staged = versioned_name(name, version)
        peft = {key: t.detach().contiguous() for key, t in tensors.items()}
        check_result(self.engine.load_lora_adapter_from_tensors(staged, peft, peft_config_dict(self._configs[name])),
                     f"load_lora_adapter_from_tensors({staged})")
        return staged

    def commit_adapter(self, name: str, staged: str) -> None:
        """Route new requests for `name` to the staged version; the one it replaces is unloaded once drained."""
        with self._lock:
            old = self._serving.get(name)
            self._serving[name] = staged
            self.weight_version = version_of(staged)
            if old is not None and old != staged:
                self._retired.add(old)
            self._unload_drained()

    def discard_adapter(self, staged: str) -> None:
        """Unload a staged version that never served (a push that failed its check)."""
        check_result(self.engine.unload_lora_adapter(staged), f"unload_lora_adapter({staged})")

    def serving(self, name: str) -> str | None:
        """The versioned SGLang name requests for adapter `name` go to."""
        return self._serving.get(name)

    # ---- memory and lifecycle --------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free SGLang's memory for `tags` (None = all three) while no request runs."""
        tags = self._check_tags(tags)
        check_result(self.engine.release_memory_occupation(tags=tags), "release_memory_occupation")
        self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = self._check_tags(tags)
        check_result(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
        self._released -= set(tags)

    def flush_cache(self) -> bool:
        out = self.engine.flush_cache()
        return bool(getattr(out, "success", True if out is None else out))

    def shutdown(self) -> None:
        self.engine.shutdown()

    close = shutdown

    # ---- internals -------------------------------------------------------------------------------------
    def _route(self, name: str | None) -> str | None:
        if name is None or name in self._merged:  # merged: the base serves the adapter
            return None
        if name in self._serving:
            return self._serving[name]
        raise ValueError(f"lora: adapter '{name}' is not loaded (loaded: {sorted(self._serving)})")

    def _unload_drained(self) -> None:
        for old in sorted(self._retired):
            if self._in_flight[old] <= 0:
                check_result(self.engine.unload_lora_adapter(old), f"unload_lora_adapter({old})")
                self._retired.discard(old)
                del self._in_flight[old]

    def _record(self, out: dict, name: str | None, return_logprob: bool) -> Record:
        """One SGLang result as the native engine's record."""
        meta = out.get("meta_info", {})
        finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish reason"}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return {"error": finish.get("message", "aborted by sglang"), "meta_info": {"finish_reason": finish}}
        ids = list(out.get("output_ids", []))
        version = version_of(name) if name is not None else self.weight_version
        record_meta = sample_meta(finish, meta.get("prompt_tokens", 0), meta.get("completion_tokens", len(ids)),
                                  meta.get("cached_tokens", 0), [version])
        if return_logprob:
            rows = meta.get("output_token_logprobs") or []
            pairs = [(float(row[0]), int(row[1])) for row in rows]
            if [t for _, t in pairs] != ids:
                raise RuntimeError(f"sglang returned log-probs of {len(pairs)} tokens for {len(ids)} output ids "
                                   "(or of other tokens): the sample cannot be trained on")
            record_meta["output_token_logprobs"] = pairs
        return {"output_ids": ids, "meta_info": record_meta}

    def _check_tags(self, tags: list[str] | None) -> list[str]:
        tags = check_tags(tags, self.capabilities.memory_tags, self.backend)
        if not self.cfg.enable_memory_saver:
            raise ValueError("release/resume_memory_occupation: needs sglang.enable_memory_saver=true")
        if "weights" in tags and not self.cfg.enable_weights_cpu_backup:
            raise ValueError("releasing 'weights' without sglang.enable_weights_cpu_backup=true would resume them as "
                             "garbage; enable the backup or release only kv_cache and cuda_graph")
        return tags
