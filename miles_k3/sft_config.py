"""The config of `python -m miles_k3.sft` (`SFTConfig`, the schema `sft_schema` that recipes/sft.yaml extends),
registered with the other commands' schemas by `miles_k3.config.register_schemas`."""
from dataclasses import dataclass, field

from miles_k3.config_checks import (
    check_context,
    check_device,
    check_kernels,
    check_parallel,
    check_weights_given,
)
from miles_k3.envs.env import EnvConfig
from miles_k3.evals.datasets import DatasetConfig
from miles_k3.evals.harness import EvalConfig
from miles_k3.evals.templates import template_names
from miles_k3.model.build import ModelConfig
from miles_k3.model.kernel_config import KernelsConfig
from miles_k3.model.lora import LoRAConfig
from miles_k3.parallel.config import ParallelConfig
from miles_k3.rollout.api import capabilities
from miles_k3.rollout.engine_config import EngineConfig
from miles_k3.trainer.optim import OptimConfig
from miles_k3.utils.tracking import TrackingConfig

SFT_MODES = ("full", "lora")
SFT_TRANSCRIPTS = ("none", "guess_random", "guess_noisy_bisect", "guess_passes")


@dataclass
class SFTConfig:
    """`python -m miles_k3.sft`: supervised fine-tuning on (problem, answer) pairs, full-parameter or LoRA."""

    seed: int = 0
    """Seed for torch, python and numpy RNGs (the random init of a shipped config, the adapter's init,
    dropout) and for the order of the training problems."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model: a shipped config trained from its random init (model=k3_nano|k3_tiny|k3_m|k3_m2), or
    model.path=DIR."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """The kernels of the K3 forward: kernels.mxfp4_experts (auto | torch | triton), kernels.reference (pure-torch
    references instead of the fused kernels); resolved once at startup and logged with the reason."""
    mode: str = "full"
    """full (every parameter trains; the routed experts need model.experts=bf16, which auto becomes) or lora
    (only the `lora` adapter trains; the base stays frozen)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """The trained LoRA adapter (mode=lora only): rank, alpha, dropout, target module names."""
    data: DatasetConfig = field(default_factory=DatasetConfig)
    """The training problems: the prompt is the problem under `template`, the target its gold answer + eos."""
    template: str = "plain"
    """Prompt template of the training problems (evals.templates: boxed, plain, chat, ...), rendered and
    tokenized exactly as the RL rollouts do."""
    steps: int = 100
    """Optimizer steps to train; >= 1."""
    batch_size: int = 8
    """Problems per optimizer step; >= 1."""
    micro_batch_tokens: int = 0
    """Padded tokens (rows x longest row) per forward/backward; a step's batch is cut into such micro-batches in order
    and their gradients add up to the whole batch's (the loss is normalised by the batch's target tokens). 0: the
    whole batch in one forward."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them (less memory, ~1.4x the step
    time): full-parameter training of k3_m2 over thousands of tokens per step needs it on an 80 GB GPU."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """AdamW, LR schedule (warmup_steps, cosine decay to min_lr_ratio at total_steps), grad_clip, betas."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine's sizes for evaluation (max_context must hold a prompt + eval.max_new_tokens)."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(template="plain", samples=1, temperature=0.0,
                                                                max_new_tokens=256, grader="math"))
    """Held-out evaluation through the rollout engine every eval.every_n_steps steps and at the end (0:
    never; eval.at_start: also before the first update); its own dataset (eval.data), template, sampling and
    grader."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """W&B (tracking.logger=wandb) besides the run directory's metrics.jsonl."""
    run_dir: str | None = None
    """metrics.jsonl, eval reports, Hydra's record and the result (model/ in full mode, adapter/ in lora mode);
    None (run_dir=null): the default, runs/sft-<date>-<time>."""
    threads: int = 0
    """CPU threads torch computes with (torch.set_num_threads); 0: torch's default (one per core, or
    OMP_NUM_THREADS)."""
    log_every: int = 10
    """Log train/loss (mean since the last log), train/lr, train/grad_norm, perf/tokens_per_s every N steps
    (and at the last step); >= 1."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """single (the default): (problem, answer) pairs. A multi-turn environment (env.name=guess) trains on
    `transcripts` of it, at most env.max_turns policy turns each, and evaluates held-out episodes of it."""
    transcripts: str = "none"
    """none: the target is the gold answer + eos. guess_random (env=guess): a multi-turn transcript of the
    environment played by a uniformly random guess consistent with the feedback so far; guess_noisy_bisect: the
    middle of the numbers the feedback allows half of the time, such a random guess otherwise; guess_passes: as
    guess_noisy_bisect, but 40% of the turns pass (" pass": no number, a lost turn). The loss is on the
    guesses' tokens only (each observation is the environment's text, tokenized on its own, as in rollouts)."""
    heldout_every: int = 0
    """Every N steps (and at the last), teacher-forced held-out figures without the engine: `heldout_size` problems
    of data's test split (data.split=test, data.seed, same fields), one forward each; sft/heldout_exact is the share
    whose every target token is the model's argmax (exactly the share greedy decoding reproduces), sft/heldout_token
    the share of target tokens that are. 0: off. Needs a generated data.source (it has a test split)."""
    heldout_size: int = 256
    """Held-out problems of heldout_every."""
    stop_at_heldout_exact: float = 0.0
    """Stop training (and save, as at the last step) at the first held-out measurement whose sft/heldout_exact is
    at least this: a base deliberately imperfect by construction, whatever the machine's speed (0: off; needs
    heldout_every)."""
    quantize: bool = False
    """mode=full: also write run_dir/base, the trained model with its routed experts quantized to native MXFP4 (as
    `python -m miles_k3.quantize` does): the frozen base RL trains from."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The mesh of a torchrun launch, as training's (all 1: one process), mode=lora only: every rank builds its shard
    of the base and reads only its slices; each DP replica trains on its share of every step's batch.
    torchrun --nproc-per-node dp*tp -m miles_k3.sft mode=lora parallel.tp=... (docs/concepts/scale-out.md)."""

    def validate(self) -> None:
        check_device(self.device)
        check_parallel(self.parallel, self.device, self.engine.backend)
        if self.mode == "full" and self.parallel.world_size > 1:
            raise ValueError(f"mode: full-parameter SFT runs in one process, not on the {self.parallel.world_size} "
                             "ranks of parallel.dp x parallel.tp; under torchrun train an adapter (mode=lora)")
        check_kernels(self.kernels, self.device)
        check_weights_given(self.model)
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0 (0: torch's default), got {self.threads}")
        for name in ("steps", "batch_size", "log_every", "heldout_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens: must be >= 0 (0: the whole batch at once), got "
                             f"{self.micro_batch_tokens}")
        if self.heldout_every < 0:
            raise ValueError(f"heldout_every: must be >= 0 (0: off), got {self.heldout_every}")
        if not 0.0 <= self.stop_at_heldout_exact <= 1.0:
            raise ValueError(f"stop_at_heldout_exact: a share in [0, 1] (0: off), got {self.stop_at_heldout_exact}")
        if self.stop_at_heldout_exact and not self.heldout_every:
            raise ValueError("stop_at_heldout_exact: needs the held-out figures; set heldout_every (e.g. 20)")
        if self.heldout_every and self.data.split not in (None, "train"):
            raise ValueError(f"heldout_every: the held-out problems are data's test split; train on the train split "
                             f"(data.split=train or unset), got data.split={self.data.split}")
        if self.quantize and self.mode != "full":
            raise ValueError("quantize: writes the fully trained model with MXFP4 experts (mode=full); a LoRA "
                             "adapter keeps its base as it is: remove quantize=true")
        if self.mode not in SFT_MODES:
            raise ValueError(f"mode: '{self.mode}' is not one of {', '.join(SFT_MODES)}")
        if self.model.hf_path is not None:
            raise ValueError("model.hf_path: python -m miles_k3.sft trains K3 models (model.name, model.path); an HF "
                             "architecture is trained by python -m miles_k3.train engine.backend=sglang")
        if not capabilities(self.engine.backend).in_process_model:
            raise ValueError(f"engine.backend: python -m miles_k3.sft evaluates through the native engine, which "
                             f"shares the trained model's tensors; remove engine.backend={self.engine.backend}")
        if self.template not in template_names():
            raise ValueError(f"template: '{self.template}' is not one of {', '.join(template_names())}")
        if self.mode == "full" and self.engine.fuse_projections:
            raise ValueError("engine.fuse_projections: in mode=full the eval engine reads the weights being trained "
                             "in place, and fused projections are a copy that would not follow them; remove it "
                             "(mode=full leaves it off)")
        if self.mode == "full" and self.model.experts == "mxfp4":
            raise ValueError("model.experts: mxfp4 experts are frozen storage and cannot train in mode=full; "
                             "set model.experts=bf16 (or auto), or train an adapter with mode=lora")
        if self.eval.every_n_steps > 0:
            check_context("eval.max_new_tokens", self.eval.max_new_tokens, self.engine)
        self.env.validate()
        if self.transcripts not in SFT_TRANSCRIPTS:
            raise ValueError(f"transcripts: '{self.transcripts}' is not one of {', '.join(SFT_TRANSCRIPTS)}")
        if (self.transcripts != "none") != (self.env.name == "guess"):
            raise ValueError(f"transcripts: transcripts={self.transcripts} with env={self.env.name}; "
                             "transcripts=guess_* plays env=guess (set both), and env=guess trains on its "
                             "transcripts (pairs would teach the secret from the prompt alone)"
                             if self.env.name in ("single", "guess") else
                             f"env: python -m miles_k3.sft has no transcripts of env={self.env.name}; use "
                             "env=single or env=guess")
