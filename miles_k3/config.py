"""The run's typed config tree and its Hydra plumbing.

Hydra composes `recipes/` (`train.yaml` + groups `recipe/`, `model/`, ...); each section is typed by the
dataclass its component owns (`ModelConfig`, ...), registered here as the schema `train.yaml` extends. An unknown
key or a value of the wrong type fails while composing; `to_typed` then builds the dataclasses and runs every
section's `validate()`, so a bad value fails before any work with the field's full name.
"""
import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from miles_k3.cli import RECIPES_MODULE, check_overrides, closest_fields, did_you_mean
from miles_k3.config_checks import (
    check_agent,
    check_backend,
    check_context,
    check_device,
    check_filtered_logprobs,
    check_kernels,
    check_parallel,
    check_partial,
    check_release_tags,
    check_requires,
    check_routes,
    check_sync,
    check_weights_given,
    tis_for_mode,
)
from miles_k3.envs.env import EnvConfig
from miles_k3.evals.datasets import DatasetConfig
from miles_k3.evals.harness import EvalConfig, PromptLengthError
from miles_k3.evals.problems import DatasetError
from miles_k3.evals.rewards import RewardConfig
from miles_k3.model.build import ModelConfig
from miles_k3.model.config import ConfigError
from miles_k3.model.kernel_config import KernelsConfig
from miles_k3.model.lora import LoRAConfig
from miles_k3.model.weight_files import WeightsError
from miles_k3.parallel.config import ParallelConfig, ParallelConfigError
from miles_k3.ray_config import RayConfig, check_fleet, check_launcher, default_ray_dp
from miles_k3.rollout.api import capabilities
from miles_k3.rollout.engine_config import EngineConfig
from miles_k3.rollout.server.config import ServerConfig, ServerConfigError
from miles_k3.rollout.sglang_config import SGLangConfig
from miles_k3.sft_config import SFTConfig
from miles_k3.trainer.checkpoint import ResumeError
from miles_k3.trainer.losses import LossConfig
from miles_k3.trainer.rollouts import RolloutConfig
from miles_k3.trainer.step import TrainerConfig
from miles_k3.utils.tracking import TrackingConfig
from miles_k3.weight_sync.config import WeightSyncConfig


class ConfigFieldError(ValueError):
    """A config value is invalid; the message starts with the field's full dotted name."""


@dataclass
class Requires:
    """What a recipe needs before it can run, checked before anything else (a recipe sets these; empty: nothing).
    A recipe sized for a GPU sets `device`; one trained from a base the user builds first sets `base_command`."""

    device: str = ""
    """cuda: refuse every other device (the recipe's model and lengths are a GPU's work; the message points to
    the CPU quickstart); "": any device."""
    base_command: str = ""
    """The command that builds the recipe's base model; when set, model.path must be given (the refusal prints
    this command); "": the recipe needs no base of its own."""

    def validate(self) -> None:
        if self.device not in ("", "cuda"):
            raise ValueError(f"device: '{self.device}' is not one of '' (any), cuda")


@dataclass
class TrainConfig:
    """`python -m miles_k3.train`: the whole run."""

    requires: Requires = field(default_factory=Requires)
    """What the recipe needs (a GPU, a base built first), checked before anything else."""
    threads: int = 0
    """CPU threads torch computes with (torch.set_num_threads); 0: torch's default (one per core, or
    OMP_NUM_THREADS)."""

    seed: int = 0
    """Seed for torch, python and numpy RNGs (the adapter's init, a random base) and, unless rollout.seed is given,
    the rollouts' prompt order and sampling seeds (rollout.seed is `${seed}` in recipes/train.yaml)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's base model (frozen)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """The trained LoRA adapter: rank, alpha, dropout, target module names."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """The kernels of the K3 forward: kernels.mxfp4_experts (auto | torch | triton), kernels.reference (pure-torch
    references instead of the fused kernels); resolved once at startup and logged with the reason."""
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """The weight-sync channel from the trainer into the native rollout engine (sync.readback: a debug check)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The verifiable reward of the rollouts (reward=aime | math, by name; format bonus; grading timeouts)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment each rollout is an episode of (env=single | guess | tools): one turn graded by the reward,
    or a multi-turn episode, token in / token out (miles_k3/envs/env.py)."""
    steps: int = 0
    """Optimizer steps to train; 0 builds the base model and attaches the adapter, then stops (no data, engine or
    optimizer: a check of the config, the model and the adapter)."""
    data: DatasetConfig = field(default_factory=DatasetConfig)
    """The training problems (prompt + gold answer): a hub id or a local jsonl/json/parquet file."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Prompts and samples per step, sampling, advantages, dynamic sampling, overlong handling."""
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(loss=LossConfig(tis="auto")))
    """Policy loss, optimizer and LR schedule, micro-batching, precision. Here trainer.loss.tis defaults to auto, made
    the rollout mode's setting when the config is built (`tis_for_mode`): token_truncate under rollout.mode=partial
    (the importance weight its off-policy tokens need: docs/concepts/off-policy.md), none under sync; an explicit
    setting is kept (and checked)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The colocated rollout engine: engine.backend (native | sglang) and the native engine's sizes (max_context
    must hold every training prompt + rollout.max_new_tokens: checked when the data loads)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang engine of engine.backend=sglang: server arguments and push verification."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(samples=4))
    """Evaluation during training (eval.every_n_steps > 0): dataset, sampling, grading."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """W&B (tracking.logger=wandb) besides the run directory's metrics.jsonl."""
    run_dir: str | None = None
    """Checkpoints, metrics.jsonl, eval reports and Hydra's record; None (run_dir=null): the default,
    runs/train-<date>-<time>."""
    resume: str = "none"
    """none, auto (the latest complete checkpoint in run_dir) or a checkpoint directory."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0: only at the end); always also on SIGINT / SIGTERM."""
    keep_checkpoints: int = 3
    """Checkpoints kept in run_dir/checkpoints (older ones are deleted after a new one is published)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Scale-out over torchrun's processes: dp replicas x tp ranks each, ep expert ranks over them (all 1: one
    process). torchrun --nproc-per-node dp*tp -m miles_k3.train parallel.dp=... (docs/concepts/scale-out.md)."""
    launcher: str = "process"
    """process: this process runs the loop (one process, or a rank of a torchrun launch); ray: Ray Train's workers
    run it, ray.num_workers ranks restarted after a worker dies (miles_k3/ray_launch.py, docs/guides/ray.md)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray Train job of launcher=ray: workers, cluster address, restarts, resources per worker, start timeout."""

    def __post_init__(self) -> None:
        if self.trainer.loss.tis == "auto":
            self.trainer.loss.tis = tis_for_mode(self.rollout.mode)
        default_ray_dp(self.launcher, self.parallel, self.ray)  # launcher=ray: dp = ray.num_workers / tp

    def validate(self) -> None:
        check_requires(self.requires.device, self.requires.base_command, self.device, self.model.path)
        check_parallel(self.parallel, self.device, self.engine.backend)
        check_launcher(self.launcher, self.ray, self.parallel, self.resume, self.device)
        check_device(self.device)
        check_kernels(self.kernels, self.device, None if self.model.hf_path is None else
                      "model.hf_path: the HF model's forward is transformers' and SGLang's")
        check_weights_given(self.model)
        if self.env.keep_state and self.env.max_turns > 1 and not capabilities(self.engine.backend).keeps_state:
            raise ValueError("env.keep_state: keeping an episode's state in the engine between turns needs "
                             f"engine.backend=native (the {self.engine.backend} engine keeps no state between "
                             "requests); set env.keep_state=false")
        if self.rollout.partial.refill and (self.rollout.mode != "partial" or self.env.max_turns > 1):
            raise ValueError("rollout.partial.refill: refills the pool of rollout.mode=partial with single-turn "
                             f"episodes (here rollout.mode={self.rollout.mode}, env.max_turns={self.env.max_turns}); "
                             "set rollout.partial.refill=false")
        if self.rollout.partial.refill and self.parallel.world_size > 1:
            raise ValueError(f"rollout.partial.refill: runs in one process for now (here {self.parallel.world_size} "
                             "ranks: refilling under dp/tp/ep is not tested yet); run it without torchrun / "
                             "parallel.*, or set rollout.partial.refill=false")
        if self.env.name == "agent":
            check_agent(self.engine.backend, self.parallel.world_size, self.rollout.mode,
                        self.rollout.return_routed_experts or self.trainer.routing_replay)
        check_backend(self.model, self.engine.backend, self.sglang, self.lora)
        check_release_tags(self.rollout.release_tags, self.engine.backend, self.sglang)
        check_sync(self.sync, self.engine.backend)
        check_routes(self.rollout.return_routed_experts, self.trainer.routing_replay, self.engine.backend)
        check_fleet(self)
        check_partial(self.rollout.mode, self.trainer.old_logprobs, self.trainer.loss.tis, self.engine.backend)
        check_filtered_logprobs(self.rollout.top_p, self.rollout.top_k, self.trainer.old_logprobs, self.trainer.loss.tis,
                                self.engine.backend)
        check_context("rollout.max_new_tokens", self.rollout.max_new_tokens, self.engine, self.sglang)
        if self.eval.every_n_steps > 0:
            check_context("eval.max_new_tokens", self.eval.max_new_tokens, self.engine, self.sglang)
        if self.trainer.old_logprobs == "rollout" and self.trainer.loss.tis != "none":
            raise ValueError(f"trainer.loss.tis: with trainer.old_logprobs=rollout the ratio's old log-probs are the "
                             f"engine's, so the TIS weight exp(old - rollout) is exactly 1 and tis="
                             f"{self.trainer.loss.tis} does nothing; set trainer.old_logprobs=recompute (TIS then "
                             "corrects the engine/trainer mismatch) or trainer.loss.tis=none")
        for name in ("steps", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0 (0: torch's default), got {self.threads}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints: must be >= 1, got {self.keep_checkpoints}")


@dataclass
class ModelInfoConfig:
    """`python -m miles_k3.model_info`: sizing figures of a K3 config, whole and per rank of a mesh."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="k3"))
    """The model to size (computed on the meta device: no memory, any size)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The mesh whose rank 0 is sized (parallel.dp x parallel.tp = gpus; parallel.ep divides them); default one
    GPU."""
    gpus: int | None = None
    """GPUs of the run: parallel.dp defaults to gpus / parallel.tp (None: parallel.dp as given, default 1)."""
    batch: int = 32
    """Requests each DP replica's engine holds at once (the KDA state and MLA KV figures)."""
    context: int = 20480
    """Tokens per request for the MLA KV figure (prompt + response; aime_grpo's engine.max_context)."""
    micro_batch_tokens: int = 32768
    """Tokens of one training micro-batch (aime_grpo's trainer.micro_batch_tokens): the activation estimate."""
    gpu_gib: float = 141.0 * 1e9 / 2**30
    """Memory of one GPU, GiB, that the per-rank total is compared with (H200: 141 GB)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """The LoRA adapter whose size `adapter_params` reports."""

    def validate(self) -> None:
        if self.model.hf_path is not None:
            raise ValueError("model.hf_path: model_info sizes K3 configs (model.name, model.path), not HF models")
        if self.gpus is not None and self.gpus != self.parallel.world_size:
            raise ValueError(f"gpus: {self.gpus} is not parallel.dp x parallel.tp = {self.parallel.dp} x "
                             f"{self.parallel.tp}; give gpus as a multiple of parallel.tp (parallel.dp follows) or "
                             "leave parallel.dp unset")
        for name in ("batch", "context", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.gpu_gib > 0:
            raise ValueError(f"gpu_gib: must be > 0, got {self.gpu_gib}")


@dataclass
class EvalRunConfig:
    """`python -m miles_k3.eval`: a model (and adapter) evaluated on a dataset through the rollout engine."""

    seed: int = 0
    """Seed for torch's RNG (sampling seeds come from eval.seed)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model."""
    adapter: str | None = None
    """A PEFT LoRA adapter directory (save_adapter / a training run's adapter) evaluated on the base; None: the
    base alone."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """The kernels of the K3 forward: kernels.mxfp4_experts (auto | torch | triton), kernels.reference (pure-torch
    references instead of the fused kernels); resolved once at startup and logged with the reason."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine that generates: engine.backend (native: miles_k3's K3 engine; sglang: sglang.Engine serving
    model.hf_path or model.path) and the native engine's sizes (max_context must hold the longest prompt +
    eval.max_new_tokens)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Dataset, template, sampling, grading and metrics."""
    run_dir: str | None = None
    """Where results.jsonl, summary.json, metrics.jsonl and Hydra's record go; None (run_dir=null): the default,
    runs/eval-<date>-<time>."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """W&B (tracking.logger=wandb) besides the run directory's metrics.jsonl."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang engine of engine.backend=sglang (its server arguments; push verification does not apply)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The mesh of a torchrun launch, as training's (all 1: one process): every rank builds its shard of the model
    and reads only its slices; each DP replica generates its share, rank 0 grades and writes. torchrun
    --nproc-per-node dp*tp -m miles_k3.eval parallel.tp=... (docs/concepts/scale-out.md)."""

    def validate(self) -> None:
        check_device(self.device)
        check_parallel(self.parallel, self.device, self.engine.backend)
        check_kernels(self.kernels, self.device, None if capabilities(self.engine.backend).in_process_model else
                      f"engine.backend={self.engine.backend}: SGLang generates with its own kernels; no model runs in "
                      "this process")
        check_weights_given(self.model)
        check_backend(self.model, self.engine.backend, self.sglang)
        check_context("eval.max_new_tokens", self.eval.max_new_tokens, self.engine, self.sglang)


@dataclass
class ServeConfig(ServerConfig):
    """`python -m miles_k3.serve`: an OpenAI-compatible HTTP endpoint (chat/completions, sessions that keep the
    exact token sequence) over the native rollout engine (docs/concepts/serve.md). The server's own fields (limits,
    chat_format, served_model_name, api_key_env) are `ServerConfig`'s, the library's (miles_k3/rollout/server/)."""

    seed: int = 0
    """Seed for torch's RNG: the sampling seeds of requests that give no `seed` are drawn from it."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model."""
    adapter: str | None = None
    """A PEFT LoRA adapter directory (save_adapter / a training run's adapter) served on the base; None: the
    base alone."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """The kernels of the K3 forward (kernels.mxfp4_experts, kernels.reference), resolved once at startup."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The native engine's sizes; engine.max_context bounds prompt + max_tokens of every request (a session's
    whole conversation included). Only engine.backend=native."""
    host: str = "127.0.0.1"
    """Address to bind: loopback by default; a non-loopback address (0.0.0.0, a LAN IP) only when given here."""
    port: int = 8000
    """TCP port, 1..65535."""

    def model_id(self) -> str:
        """served_model_name, else model.name."""
        return self.served_model_name or self.model.name

    def validate(self) -> None:
        check_device(self.device)
        check_kernels(self.kernels, self.device)
        check_weights_given(self.model)
        if not capabilities(self.engine.backend).in_process_model:
            raise ValueError(f"engine.backend: python -m miles_k3.serve serves the native engine; remove "
                             f"engine.backend={self.engine.backend}")
        if self.model.hf_path is not None:
            raise ValueError("model.hf_path: python -m miles_k3.serve serves K3 models (model.name, model.path) "
                             "through the native engine")
        if not self.host:
            raise ValueError("host: give an address to bind (127.0.0.1: this machine only)")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port: must be in 1..65535, got {self.port}")
        super().validate()


SHIPPED_BASES = {"k3_nano": "builtin:k3_nano_chain_sum"}
"""Architectures with trained weights shipped in the package: `python -m miles_k3.eval`'s model.path when the
command line gives neither model.path nor model.hf_path (recipes/eval.yaml: `${miles_k3.shipped_base:...}`)."""


def shipped_base(name: str, hf_path: str | None) -> str | None:
    """The resolver `miles_k3.shipped_base`: the shipped weights of model `name`, or None (its random init) when
    it has none or an HF checkpoint (model.hf_path) is given instead."""
    return None if hf_path is not None else SHIPPED_BASES.get(name)


def or_default(value: Any, default: Any) -> Any:
    """The resolver `miles_k3.or_default`: `value`, or `default` where it is null. The recipes' hydra.run.dir is
    `${miles_k3.or_default:${run_dir},runs/<app>-${now:%Y%m%d-%H%M%S}}`: run_dir=null is the default directory
    (`typed_or_exit` gives run_dir the same one)."""
    return default if value is None else value


def replicas(gpus: Any, tp: Any) -> Any:
    """The resolver `miles_k3.replicas`: model_info's parallel.dp from `gpus` (gpus // parallel.tp; 1 when gpus is
    null). ModelInfoConfig.validate checks that dp x tp is gpus."""
    return 1 if gpus is None else max(int(gpus) // int(tp), 1)


def schedule_steps(steps: Any) -> int | None:
    """The resolver `miles_k3.schedule_steps`: a run's `steps` as an LR schedule's total_steps (the quickstart
    decays over its whole run), or None (a constant lr) for steps < 1 (steps=0 is a dry run; a negative steps is
    refused by its own field)."""
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else None


def on_rank0(value: Any, other: Any) -> Any:
    """The resolver `miles_k3.on_rank0`: `value` in rank 0 of a torchrun launch (or without torchrun), `other` in
    the other ranks. recipes/train.yaml gives only rank 0 Hydra's record (.hydra/) and train.log."""
    return value if os.environ.get("RANK", "0") == "0" else other


def register_schemas() -> None:
    if not OmegaConf.has_resolver("miles_k3.schedule_steps"):
        OmegaConf.register_new_resolver("miles_k3.schedule_steps", schedule_steps)
    if not OmegaConf.has_resolver("miles_k3.shipped_base"):
        OmegaConf.register_new_resolver("miles_k3.shipped_base", shipped_base)
    if not OmegaConf.has_resolver("miles_k3.or_default"):
        OmegaConf.register_new_resolver("miles_k3.or_default", or_default)
    if not OmegaConf.has_resolver("miles_k3.on_rank0"):
        OmegaConf.register_new_resolver("miles_k3.on_rank0", on_rank0)
    if not OmegaConf.has_resolver("miles_k3.replicas"):
        OmegaConf.register_new_resolver("miles_k3.replicas", replicas)
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    store.store(name="eval_schema", node=EvalRunConfig)
    store.store(name="model_info_schema", node=ModelInfoConfig)
    store.store(name="sft_schema", node=SFTConfig)
    store.store(name="serve_schema", node=ServeConfig)


def to_typed(cfg: DictConfig) -> Any:
    """The composed config as its dataclasses, every section validated (errors name the field path)."""
    _check_added_keys(cfg, "")
    obj = OmegaConf.to_object(cfg)
    _validate_tree(obj, "")
    return obj


def _check_added_keys(node: DictConfig, path: str) -> None:
    """Every key of a section typed by a dataclass is one of its fields. Hydra refuses `key=value` for a key the
    schema lacks, but `+key=value` (which its refusal suggests) adds it, and OmegaConf.to_object would drop it
    without a word: e.g. an old name, +output_dir=DIR, would be ignored. Free-form dicts (data.task_args) take
    any key."""
    schema = OmegaConf.get_type(node)
    names = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key, value in node.items_ex(resolve=False):
        if names is not None and key not in names:
            hint = did_you_mean([path + name for name in closest_fields(schema, key)])
            raise ConfigFieldError(f"{path}{key}: not a field of {schema.__name__}, so it would do nothing; remove "
                                   f"the +{path}{key} override{hint} (--cfg job prints the fields and their values)")
        if isinstance(value, DictConfig):
            _check_added_keys(value, f"{path}{key}.")


def _validate_tree(obj: Any, path: str) -> None:
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        _validate_tree(getattr(obj, f.name), f"{path}{f.name}.")
    validate = getattr(type(obj), "validate", None)
    if validate is not None:
        try:
            validate(obj)
        except ValueError as e:  # a message that names its field in full already (parallel.dp: ...) stays so
            message = str(e)
            raise ConfigFieldError(message if message.startswith(path) else f"{path}{message}") from None


def typed_or_exit(raw: DictConfig, prog: str) -> Any:
    """An entry point's composed config as its dataclasses; an invalid field exits with its name (no traceback).
    run_dir=null is made the default run directory first (`default_null_run_dir`)."""
    default_null_run_dir(raw, prog.removeprefix("miles_k3."))
    with exit_on_user_error(prog):
        return to_typed(raw)


def default_null_run_dir(raw: DictConfig, app: str) -> None:
    """run_dir=null means the default, runs/<app>-<date>-<time>: the directory hydra.run.dir fell back to (its
    `or_default`), with the same time (Hydra's `now` resolver is cached per run), so the run and Hydra's record
    share one tree."""
    if "run_dir" in raw and raw.run_dir is None:
        raw.run_dir = f"runs/{app}-${{now:%Y%m%d-%H%M%S}}"


USER_ERRORS = (ConfigFieldError, ConfigError, DatasetError, WeightsError, ResumeError,
               PromptLengthError, ParallelConfigError, ServerConfigError)
"""Errors that are about the user's config, data or checkpoints: their messages say what to fix."""


@contextmanager
def exit_on_user_error(prog: str):
    """An entry point's body: a USER_ERRORS error exits with its message (no traceback), anything else raises."""
    try:
        yield
    except USER_ERRORS as e:
        raise SystemExit(f"{prog}: {e}") from None


def compose_cli(config_name: str, argv: list[str], prog: str, usage: str) -> Any:
    """The config of a `python -m <prog> key=value ...` command that is not a Hydra app (model_info,
    init_checkpoint): --help / -h prints `usage` and exits 0; another --flag, a key that is not a field (with the
    closest names: `cli.check_overrides`), a bad override (Hydra's message) or an invalid field exits with one line
    naming it; else `compose_config(config_name, argv)`."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage.strip("\n"))
        raise SystemExit(0)
    flag = next((a for a in argv if a.startswith("-")), None)
    if flag is not None:
        raise SystemExit(f"{prog}: {flag}: not an option; arguments are key=value overrides (python -m {prog} "
                         "--help)")
    register_schemas()
    check_overrides(prog, config_name, argv, f" (python -m {prog} --help)")
    try:
        with exit_on_user_error(prog):
            return compose_config(config_name, argv)
    except HydraException as e:  # Hydra's message (with its cause: the override's own error), no traceback
        cause = f"\n{e.__cause__}" if e.__cause__ is not None else ""
        raise SystemExit(f"{prog}: {e}{cause}\n(the fields: python -m {prog} --help)") from None


def compose_config(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose `recipes/<config_name>.yaml` with Hydra overrides and return the validated dataclass tree."""
    register_schemas()
    with initialize_config_module(config_module=RECIPES_MODULE, version_base=None):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    return to_typed(cfg)
