"""The rules of a run's config that span its sections (engine backend against model, routes, memory tags, sync,
device, context, weights), called by the section-level `validate`s of `miles_k3.config`'s run configs. Each raises
ValueError (ParallelConfigError for the mesh) naming the field and the fix. What an engine.backend can do is asked
of its declared capabilities (`rollout.api.capabilities`), never of its name."""
from __future__ import annotations

import dataclasses
import os

import torch

from miles_k3.model.build import ModelConfig
from miles_k3.model.kernel_config import KernelsConfig
from miles_k3.model.lora import LoRAConfig
from miles_k3.parallel.config import ParallelConfig, ParallelConfigError
from miles_k3.rollout.api import capabilities
from miles_k3.rollout.engine_config import EngineConfig
from miles_k3.rollout.sglang_config import SGLangConfig
from miles_k3.weight_sync.config import WeightSyncConfig


def check_parallel(parallel: ParallelConfig, device: str, backend: str) -> None:
    """The `parallel:` mesh (its own fields checked by ParallelConfig.validate) fits the rest of the run: the
    engine can be colocated on every rank and each rank picks its own device (an EP group spanning DP replicas
    runs its forwards in lockstep: `parallel.lockstep`). The world size (torchrun's) and the model's shapes are
    checked when the run starts (`launch.build_run`: `init_parallel`, `ParallelConfig.check_model`)."""
    if parallel.world_size == 1:
        return
    if not capabilities(backend).in_process_model:
        raise ParallelConfigError(f"parallel.dp x parallel.tp = {parallel.world_size}: engine.backend={backend} runs "
                                  "one SGLang engine for one trainer process; use engine.backend=native (colocated "
                                  "on every rank) or parallel.dp=1 parallel.tp=1")
    if device.startswith("cuda:"):
        raise ParallelConfigError(f"parallel.dp x parallel.tp = {parallel.world_size}: device={device} pins one GPU "
                                  "for every rank, and each rank takes cuda:LOCAL_RANK; use device=cuda or "
                                  "device=auto")


def check_backend(model: ModelConfig, backend: str, sglang: SGLangConfig | None = None, lora: LoRAConfig | None = None
                  ) -> None:
    """engine.backend (`backend`, one of rollout.engine_config.BACKENDS: EngineConfig checks) can serve the model: an
    engine over this process's model (native) serves K3 only; SGLang serves a checkpoint directory, and a local K3
    one only when SGLang 0.5.17 can (`k3_checkpoint`: the nested config.json, its shapes) with an sglang.push that
    serves `lora` (None: the adapter is not known yet, as in eval)."""
    if capabilities(backend).in_process_model:
        if model.hf_path is not None:
            raise ValueError("model.hf_path: an HF architecture is served by SGLang only; set engine.backend=sglang "
                             "(the native engine serves K3 models)")
        return
    if model.fp32_gemm_reduction:
        raise ValueError("model.fp32_gemm_reduction: engine.backend=sglang samples in SGLang's scheduler process, "
                         "whose bf16 GEMMs keep torch's default reduction, so only the trainer's would change; set "
                         "model.fp32_gemm_reduction=false or engine.backend=native")
    if model.fp32_residual:
        raise ValueError("model.fp32_residual: engine.backend=sglang samples with SGLang's own K3, whose residual "
                         "stream is bf16, so the trainer's fp32 one would widen the train/rollout gap it is for; set "
                         "model.fp32_residual=false or engine.backend=native")
    if model.hf_path is None and model.path is None:
        raise ValueError("engine.backend: sglang serves a checkpoint directory; set model.hf_path (an HF "
                         "architecture such as Qwen3) or model.path (a K3 checkpoint directory)")
    if sglang is None:
        return
    from miles_k3.rollout.sglang_k3 import k3_checkpoint, resolve_push

    k3 = k3_checkpoint(model.hf_path or model.path, sglang)  # None: not a local K3 directory
    if k3 is None and model.hf_path is None:
        raise ValueError(f"model.path: engine.backend=sglang serves a local K3 checkpoint directory (its config.json "
                         f"is checked before SGLang starts); {model.path} is not one: download it, or set "
                         "model.hf_path for an HF architecture")
    if lora is not None:
        resolve_push(sglang.push, lora, k3, sglang)


def check_routes(return_routed_experts: bool, routing_replay: bool, backend: str) -> None:
    """Routes come from the native engine: engine.backend=sglang serves HF architectures, whose routers the
    trainer's HF model does not replay, and K3, whose routed-experts capture is broken in SGLang 0.5.17
    (state_capturer/routed_experts.py:67 reads num_experts_per_tok; K3's TopK has no layer_id,
    models/kimi_k3.py:424-449, so every layer gets the same ids)."""
    if not capabilities(backend).records_routes and (return_routed_experts or routing_replay):
        field = "trainer.routing_replay" if routing_replay else "rollout.return_routed_experts"
        raise ValueError(f"{field}: engine.backend={backend} serves HF architectures, whose MoE routers the trainer "
                         "does not record or replay, and K3, whose routed experts SGLang 0.5.17 does not capture "
                         "right (its capturer reads num_experts_per_tok, which K3's config lacks, and K3's TopK has "
                         "no layer id, so every layer would get the same experts); use engine.backend=native or set "
                         f"{field}=false")


def check_release_tags(tags: list[str], backend: str, sglang: SGLangConfig) -> None:
    """rollout.release_tags are memory tags of the engine engine.backend names (SGLang can also release its
    weights, given a CPU backup to restore them from)."""
    allowed = capabilities(backend).memory_tags
    bad = [t for t in tags if t not in allowed]
    if bad:
        raise ValueError(f"rollout.release_tags: {bad} are not {backend} engine memory tags ({', '.join(allowed)}; "
                         f"engine.backend={backend})")
    if "weights" in tags and not sglang.enable_weights_cpu_backup:
        raise ValueError("rollout.release_tags: releasing weights needs sglang.enable_weights_cpu_backup=true "
                         "(SGLang resumes released weights as garbage otherwise)")


def check_sync(sync: WeightSyncConfig, backend: str) -> None:
    """`sync:` configures the channel into an engine over this process's model (native); with the SGLang backend
    (pushes through SGLang's adapter API) no `sync:` field does anything."""
    if capabilities(backend).in_process_model:
        return
    default = WeightSyncConfig()
    changed = [f.name for f in dataclasses.fields(sync) if getattr(sync, f.name) != getattr(default, f.name)]
    if changed:
        raise ValueError(f"sync.{changed[0]}: does nothing with engine.backend={backend} (a push goes through "
                         "SGLang's adapter API, verified by sglang.verify_push); remove the sync: overrides")


def check_kernels(kernels: KernelsConfig, device: str, no_k3_forward: str | None = None) -> None:
    """`kernels:` (its values checked by KernelsConfig.validate) fits the run: forced triton experts need CUDA on
    `device` (or Triton's interpreter, TRITON_INTERPRET=1), and a run where no K3 forward runs in this process
    (`no_k3_forward` says why) takes no `kernels:` field."""
    if no_k3_forward is not None:
        default = KernelsConfig()
        changed = [f.name for f in dataclasses.fields(kernels) if getattr(kernels, f.name) != getattr(default, f.name)]
        if changed:
            raise ValueError(f"kernels.{changed[0]}: does nothing here ({no_k3_forward}); remove the kernels: "
                             "overrides")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if kernels.mxfp4_experts == "triton" and not cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"kernels.mxfp4_experts: triton is a CUDA kernel and device={device} runs on the CPU here; "
                         "use kernels.mxfp4_experts=auto (torch on the CPU) or torch")


def check_device(device: str) -> None:
    """`device` is auto, cpu, cuda or cuda:N, and a CUDA device is one this machine has (checked with the config,
    before any data or model loads; `runtime.resolve_device` checks again when it resolves it)."""
    kind, colon, index = device.partition(":")
    if not (device in ("auto", "cpu", "cuda") or (kind == "cuda" and colon and index.isdigit())):
        raise ValueError(f"device: '{device}' is not one of auto, cpu, cuda, cuda:N")
    if kind != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"device: {device} but CUDA is not available here ({why}); use device=cpu or device=auto")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"device: {device} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
                         f"use device=cuda:0..cuda:{count - 1}, device=cuda or device=auto")


def check_requires(needs_device: str, base_command: str, device: str, model_path: str | None) -> None:
    """A recipe's `requires`: one sized for a GPU (needs_device=cuda) refuses another device, and one trained from a
    base the user builds first (base_command) refuses to start without model.path; each message says what to run."""
    if needs_device == "cuda" and (device == "cpu" or not torch.cuda.is_available()):
        why = "device=cpu" if device == "cpu" else "no CUDA device here"
        raise ValueError(f"device: this recipe (requires.device=cuda) is sized for a CUDA GPU ({why}); on a CPU, run "
                         "the quickstart instead: python -m miles_k3.train")
    if base_command and model_path is None:
        raise ValueError(f"model.path: this recipe trains from a base you build first; build it with\n  "
                         f"{base_command}\nthen pass model.path=<that run_dir>/base")


def check_context(field_name: str, max_new_tokens: int, engine: EngineConfig,
                  sglang: SGLangConfig | None = None) -> None:
    """A request holds its prompt and up to `max_new_tokens` (the field `field_name`) in the engine's context, so
    max_new_tokens must be below it: engine.max_context (engine.backend=native), sglang.context_length when set
    (sglang; unset, the checkpoint's own length applies, known only when it is served). The prompts themselves
    are checked when the data loads (train) or before they are generated (eval)."""
    if capabilities(engine.backend).in_process_model:
        limit_name, limit = "engine.max_context", engine.max_context
    else:
        if sglang is None or sglang.context_length is None:
            return
        limit_name, limit = "sglang.context_length", sglang.context_length
    if max_new_tokens >= limit:
        raise ValueError(f"{field_name}: {max_new_tokens} leaves no room for the prompt in {limit_name}={limit} "
                         f"(a request holds its prompt plus up to {field_name} tokens); raise {limit_name} to at "
                         f"least the longest prompt + {max_new_tokens}, or lower {field_name}")


RANDOM_INIT_REFUSED = ("k3",)
"""Shipped architectures that train and eval never build with random weights (the published 2.78T K3)."""


def check_weights_given(model: ModelConfig) -> None:
    """A run of the full K3 needs its checkpoint: random weights of 2.78T parameters are never meant."""
    if model.path is None and model.name in RANDOM_INIT_REFUSED:
        raise ValueError(f"model.path: required for model '{model.name}' (its weights are not random-initialised "
                         "for a run); set model.path=/path/to/checkpoint or model.path=moonshotai/Kimi-K3")


def check_filtered_logprobs(top_p: float, top_k: int, old_logprobs: str, tis: str, backend: str) -> None:
    """The engine's log-probs enter the loss (trainer.old_logprobs=rollout, trainer.loss.tis) only as log-probs of
    the whole vocabulary's distribution, which the trainer's are: under top-p / top-k an engine that reports those
    beside the filtered ones it sampled from (`EngineCapabilities.unfiltered_logprobs`: native) gives them to the
    loss (`trainer.batch.pack` takes them), in every env; one that reports only the filtered ones (SGLang) is
    refused, in every env, since the PPO ratio / TIS weight against them would start below 1 on every token. Every
    env carries what its engine reports into the samples: the turn loop's episodes (`Episode.record`) and
    env=agent's server sessions (`serve.Session`, `agent.episode_from_session`), so whether a run can use them
    depends on the engine only."""
    if capabilities(backend).unfiltered_logprobs or (top_p >= 1.0 and top_k <= 0):
        return
    uses = [f for f, on in (("trainer.old_logprobs=rollout", old_logprobs == "rollout"),
                            (f"trainer.loss.tis={tis}", tis != "none")) if on]
    if uses:
        raise ValueError(f"{uses[0]}: with engine.backend={backend} and rollout.top_p={top_p} rollout.top_k={top_k} the "
                         "engine's log-probs are of the filtered distribution it sampled from (SGLang does not report "
                         "the unfiltered ones), so the ratio against them starts below 1 on every token; set "
                         "rollout.top_p=1.0 rollout.top_k=-1, or engine.backend=native (it reports both), or "
                         "trainer.old_logprobs=recompute trainer.loss.tis=none")


def tis_for_mode(mode: str) -> str:
    """trainer.loss.tis=auto (python -m miles_k3.train's default) for rollout mode `mode`: token_truncate under
    partial and fleet, whose tokens were sampled under up to max_staleness older adapters and are importance
    weighted against the engine's log-probs (docs/concepts/off-policy.md); none under sync (the trainer's adapter
    sampled every token)."""
    return "token_truncate" if mode in ("partial", "fleet") else "none"


def check_partial(mode: str, old_logprobs: str, tis: str, backend: str) -> None:
    """rollout.mode=partial (and fleet) trains samples whose tokens span weight versions: the PPO ratio is taken
    against the trainer's own log-probs at the start of the step (old_logprobs=recompute, decoupled PPO) and the
    tokens the engine drew under an older adapter are importance weighted (trainer.loss.tis). Partial needs the
    native engine's paused requests, its partial queue (SGLang 0.5.17 pauses only through its HTTP server's
    /pause_generation; its offline Engine, which engine.backend=sglang drives, has no pause)."""
    if mode not in ("partial", "fleet"):
        return
    if mode == "partial" and not capabilities(backend).partial_queue:
        raise ValueError("rollout.mode=partial: needs engine.backend=native (SGLang 0.5.17's offline Engine cannot "
                         "pause and continue requests: its pause_generation is an HTTP-server endpoint); use "
                         "engine.backend=native or rollout.mode=sync")
    if old_logprobs != "recompute":
        raise ValueError(f"trainer.old_logprobs: rollout.mode={mode} takes the PPO ratio against the trainer's "
                         "log-probs at the start of the step (the engine's may come from an older adapter, and "
                         "would clip a stale token as if it were on-policy); set trainer.old_logprobs=recompute")
    if tis == "none":
        raise ValueError(f"trainer.loss.tis: rollout.mode={mode} trains tokens sampled under older adapters, which "
                         "need an importance weight against the engine's log-probs; set "
                         "trainer.loss.tis=token_truncate (or seq_mask), or leave it unset (auto: token_truncate in "
                         f"{mode} mode)")


def check_agent(backend: str, world_size: int, mode: str, routes: bool) -> None:
    """env=agent (`miles_k3.agent`): agent code drives the engine through an in-process HTTP server, whose engine
    calls are neither in lockstep across ranks nor routed, nor paused across a weight update. The server runs over
    an engine over this process's model, as `python -m miles_k3.serve` does."""
    if not capabilities(backend).in_process_model:
        raise ValueError("env=agent: the in-process OpenAI-compatible server runs over the native engine; set "
                         "engine.backend=native")
    if world_size != 1:
        raise ValueError(f"env=agent: runs in one process (its agents' engine calls are not in lockstep across "
                         f"ranks), got {world_size} ranks; run without torchrun / parallel.*")
    if mode != "sync":
        raise ValueError("env=agent: rollout.mode=partial cannot pause an agent's episode across a weight update; "
                         "set rollout.mode=sync")
    if routes:
        raise ValueError("env=agent: the server does not record routes; set trainer.routing_replay=false and "
                         "rollout.return_routed_experts=false")
