"""Our own LoRA modules over the frozen K3 base: `LoRAConfig` (the `lora` config section), `LoRALinear` for
the attention/MLP linears, `ExpertLoRA` for the routed experts (bf16 or MXFP4 storage alike: only the delta
is computed here), `apply_lora` to freeze the base and attach adapters, and helpers to list, count, merge and
remove them. A wrapped linear shares its base weight Parameter, so base state-dict keys (`<path>.weight`) are
unchanged and adapters add `<path>.lora_A.weight` [r, In] / `<path>.lora_B.weight` [Out, r] (experts:
`experts.lora.<w>.lora_A` [E, r, In] / `.lora_B` [E, Out, r]). The delta is s * B @ A with s = alpha / r
(alpha / sqrt(r) with rsLoRA), the same convention as PEFT, so exported tensors need no rescaling.

Adapter dtype: master adapter tensors are fp32 whatever the base dtype (AdamW updates of lr ~1e-5 relative to
a weight round away in bf16, and adapters are ~1% of the parameters), and are cast to the activation dtype in
forward, so the matmuls run in bf16 on GPU and gradients flow back to the fp32 masters.

Legend: M routed rows (token-expert pairs), E experts, r rank, In/Out a projection's input/output width.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.experts import PROJS as EXPERT_PROJS
from miles_k3.model.experts import RoutedExperts, grouped_linear

KDA_TARGETS = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # g_proj, o_proj as in KDA
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")  # dense layer 0 and the shared experts
DEFAULT_TARGETS = KDA_TARGETS + MLA_TARGETS + MLP_TARGETS
# Further nn.Linear targets: KDA's decay/beta projections and the latent MoE projections (the router `gate` is
# not a linear layer and is not adaptable).
EXTRA_LINEAR_TARGETS = ("f_a_proj", "f_b_proj", "b_proj", "routed_expert_down_proj", "routed_expert_up_proj")
LINEAR_TARGETS = DEFAULT_TARGETS + EXTRA_LINEAR_TARGETS
EXPERT_TARGETS = EXPERT_PROJS  # w1 (gate), w2 (down), w3 (up) of every routed expert
ALLOWED_TARGETS = LINEAR_TARGETS + EXPERT_TARGETS


@dataclass
class LoRAConfig:
    rank: int = 16
    """LoRA rank r (adapter A is [r, In], B is [Out, r])."""
    alpha: float = 32.0
    """Scale numerator: the delta is (alpha / r) * B @ A, or (alpha / sqrt(r)) * B @ A with use_rslora."""
    dropout: float = 0.0
    """Dropout on the adapter input (training only; the base path never sees it). In [0, 1)."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Module names to adapt, matched against the last component of each module path: attention and MLP
    linears (see LINEAR_TARGETS); add w1, w2, w3 to adapt every routed expert (opt-in: ~E times larger)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r."""

    def validate(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank: must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"alpha: must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError(f"targets: empty; list module names among {list(ALLOWED_TARGETS)}")
        unknown = [t for t in self.targets if t not in ALLOWED_TARGETS]
        if unknown:
            raise ValueError(f"targets: unknown {unknown}; allowed names are {list(ALLOWED_TARGETS)}")
        dups = sorted({t for t in self.targets if self.targets.count(t) > 1})
        if dups:
            raise ValueError(f"targets: {dups} listed more than once; list each name once")

    @property
    def scale(self) -> float:
        return lora_scale(self.rank, self.alpha, self.use_rslora)


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """s in delta = s * B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's `scaling`)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class LoRALinear(nn.Linear):
    """An nn.Linear plus a low-rank delta: y = x W^T (+ bias) + s * B(A(dropout(x))).

    Shares `base`'s weight (and bias) Parameter, so `<path>.weight` keeps its key and its storage. Adds
    `lora_A.weight` [r, In] (kaiming-uniform a=sqrt(5), PEFT's default) and `lora_B.weight` [Out, r] (zeros),
    both fp32 on the base weight's device; they are cast to x's dtype in forward.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 use_rslora: bool = False):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scale = lora_scale(rank, alpha, use_rslora)
        self.lora_dropout = _dropout(dropout)
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.enabled = True  # False inside `adapters_disabled`: the base alone (the reference policy)
        self.inference_copies: InferenceCopies | None = None  # the engine's (`InferenceCopies.attach`)

    @property
    def dropout_p(self) -> float:
        return self.lora_dropout.p if isinstance(self.lora_dropout, nn.Dropout) else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copies = self.inference_copies if not torch.is_grad_enabled() else None  # the engine's, without grad
        if copies is not None and copies.forward_merged and self.enabled and copies.merged.dtype == x.dtype:
            return F.linear(x, copies.merged, self.bias)  # the engine's merge_lora: one GEMM, no dropout
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        if copies is not None and copies.a.dtype == x.dtype:
            a, b = copies.a, copies.b  # the casts below, made once per adapter version instead of every call
            if copies.add_in_gemm:  # y += s * (A x) B^T in one GEMM, rounded once (the engine's fuse_projections)
                y.view(-1, y.shape[-1]).addmm_(F.linear(self.lora_dropout(x), a).view(-1, a.shape[0]), b.t(),
                                               alpha=self.scale)
                return y
        else:
            a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        return y + F.linear(F.linear(self.lora_dropout(x), a), b) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A [Out, In] in fp32 (differentiable in the adapters)."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + s * B @ A [Out, In], summed in fp32 and rounded once to the weight's dtype. Non-destructive."""
        return (self.weight.float() + self.delta_weight()).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, use_rslora={self.use_rslora}"


def effective_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight `linear` applies: the merged W + s * B @ A for a LoRALinear, else its weight (for code that
    reads a projection's weight directly, such as MLA's absorbed decode). Without gradients, a LoRALinear whose
    inference copies keep the merged weight (the engine's MERGED_READS) returns that copy: the same values,
    computed once per adapter version."""
    if not (isinstance(linear, LoRALinear) and linear.enabled):
        return linear.weight
    copies = linear.inference_copies
    if copies is not None and copies.merged is not None and not torch.is_grad_enabled():
        return copies.merged
    return linear.merged_weight()


class InferenceCopies:
    """An adapter module's tensors as its no-grad forward uses them, kept by an inference engine (whose model
    never trains): A and B cast to the compute dtype (the cast forward otherwise makes on every call: two kernels
    per adapted linear per decode step), and for a linear read through `effective_weight`, its merged weight.
    Allocated once (CUDA graphs read their addresses) and `refresh`ed in place whenever the adapter's values
    change; a forward with gradients, or in another dtype, ignores them.

    `forward_merged` (the engine's merge_lora): the LoRALinear's forward computes x @ merged^T (+ bias), one GEMM,
    instead of x W^T + s * B(A x) (while enabled; disabled, the base alone as ever). The merged weight is rounded
    once to W's dtype, so in bf16 its output differs from the unmerged forward's by that rounding. Off, a merged
    copy is only read through `effective_weight` and the forward is unchanged.

    `add_in_gemm` (set by the engine's fuse_projections): an unmerged forward adds s * B(A x) into x W^T inside the
    B GEMM (`addmm_`, the scale as its alpha): 3 kernels instead of 5, the delta rounded once with the sum."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, merged: torch.Tensor | None, forward_merged: bool = False):
        if forward_merged and merged is None:
            raise ValueError("InferenceCopies: forward_merged needs the merged weight")
        self.a, self.b, self.merged, self.forward_merged = a, b, merged, forward_merged
        self.add_in_gemm = False

    @classmethod
    def attach(cls, module: LoRALinear | ExpertLoRA, dtype: torch.dtype, merged: bool = False,
               forward_merged: bool = False) -> None:
        """Copies for `module` in `dtype` (the merged weight too, for a LoRALinear, if `merged` or
        `forward_merged`; the latter also has its forward use it), filled now."""
        if forward_merged and not isinstance(module, LoRALinear):
            raise ValueError("InferenceCopies: only a LoRALinear's forward can use a merged weight")
        a, b = _adapter_pair(module)
        copies = cls(torch.empty_like(a, dtype=dtype), torch.empty_like(b, dtype=dtype),
                     torch.empty_like(module.weight) if merged or forward_merged else None, forward_merged)
        module.inference_copies = copies
        copies.refresh(module)

    @torch.no_grad()
    def refresh(self, module: LoRALinear | ExpertLoRA) -> None:
        a, b = _adapter_pair(module)
        self.a.copy_(a)
        self.b.copy_(b)
        if self.merged is not None:
            self.merged.copy_(module.merged_weight())


def _adapter_pair(module: LoRALinear | ExpertLoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of an adapter module: a LoRALinear's are its lora_A / lora_B linears' weights."""
    if isinstance(module, ExpertLoRA):
        return module.lora_A, module.lora_B
    return module.lora_A.weight, module.lora_B.weight


class ExpertLoRA(nn.Module):
    """Per-expert LoRA for one routed-expert projection: delta [M, Out] = s * B_e(A_e(dropout(x))) per row's
    expert e. `lora_A` [E, r, In] (each [r, In] slice kaiming-uniform a=sqrt(5), i.e. U(+-1/sqrt(In))) and
    `lora_B` [E, Out, r] (zeros), fp32; the experts' base weights (bf16 or MXFP4) are never touched here.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float = 0.0, use_rslora: bool = False, device: torch.device | str | None = None):
        super().__init__()
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scale = lora_scale(rank, alpha, use_rslora)
        self.lora_dropout = _dropout(dropout)
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform(a=sqrt(5)) bound for fan_in = In
        fp32 = {"device": device, "dtype": torch.float32}
        a_ERI = torch.empty(num_experts, rank, in_features, **fp32).uniform_(-bound, bound)
        self.lora_A = nn.Parameter(a_ERI)
        self.lora_B = nn.Parameter(torch.zeros(num_experts, out_features, rank, **fp32))
        self.enabled = True  # False inside `adapters_disabled` (the caller then skips the delta)
        self.inference_copies: InferenceCopies | None = None  # the engine's (`InferenceCopies.attach`)

    @property
    def dropout_p(self) -> float:
        return self.lora_dropout.p if isinstance(self.lora_dropout, nn.Dropout) else 0.0

    def forward(self, x_MI: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [M, In] grouped by expert (counts[e] rows each) -> delta [M, Out] in x's dtype."""
        copies = self.inference_copies
        if copies is not None and copies.a.dtype == x_MI.dtype and not torch.is_grad_enabled():
            a, b = copies.a, copies.b
        else:
            a, b = self.lora_A.to(x_MI.dtype), self.lora_B.to(x_MI.dtype)
        h_MR = grouped_linear(self.lora_dropout(x_MI), counts, a)
        return grouped_linear(h_MR, counts, b) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """s * B_e @ A_e for every expert: [E, Out, In] fp32."""
        return torch.bmm(self.lora_B.float(), self.lora_A.float()) * self.scale


# ---- attaching, listing, merging ---------------------------------------------------------------------
def lora_linears(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(module path, LoRALinear) of every wrapped linear, in model order."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, LoRALinear)]


def expert_loras(model: nn.Module) -> list[tuple[str, str, ExpertLoRA]]:
    """(experts module path, projection name w1/w2/w3, ExpertLoRA) of every adapted expert projection."""
    out = []
    for path, m in model.named_modules():
        if isinstance(m, RoutedExperts) and m.lora is not None:
            out.extend((path, name, m.lora[name]) for name in EXPERT_PROJS if name in m.lora)
    return out


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze every base tensor and attach adapters for `cfg.targets`; returns the adapted paths in model
    order (experts as `<experts path>.w1` etc.). Linears are matched by the last component of their path;
    w1/w2/w3 attach an ExpertLoRA to every RoutedExperts. Raises ValueError for an invalid config, a model
    that already has LoRA, or a target that matches nothing in this model."""
    cfg.validate()
    if lora_linears(model) or expert_loras(model):
        raise ValueError("model already has LoRA adapters; apply_lora once per model "
                         "(remove_lora to start over)")
    linear_names = [t for t in cfg.targets if t in LINEAR_TARGETS]
    expert_names = [t for t in cfg.targets if t in EXPERT_TARGETS]
    linears = [(path, m) for path, m in model.named_modules()
               if isinstance(m, nn.Linear) and path.rsplit(".", 1)[-1] in linear_names]
    experts = [(path, m) for path, m in model.named_modules() if isinstance(m, RoutedExperts)]
    matched = {path.rsplit(".", 1)[-1] for path, _ in linears} | (set(expert_names) if experts else set())
    missing = [t for t in cfg.targets if t not in matched]
    if missing:
        raise ValueError(f"targets: {missing} match no module of this model (w1/w2/w3 need MoE layers); "
                         "remove them from lora.targets")
    model.requires_grad_(False)
    adapted = []
    for path, lin in linears:
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path), child,
                LoRALinear(lin, cfg.rank, cfg.alpha, cfg.dropout, cfg.use_rslora))
        adapted.append(path)
    for path, m in experts if expert_names else []:
        m.lora = nn.ModuleDict({name: _expert_lora(m, name, cfg) for name in expert_names})
        adapted.extend(f"{path}.{name}" for name in expert_names)
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted(adapted, key=lambda p: order[p] if p in order else order[p.rpartition(".")[0]])


def _expert_lora(experts: RoutedExperts, name: str, cfg: LoRAConfig) -> ExpertLoRA:
    out_f, in_f = experts.proj_shape(name)
    stored = experts.w1 if experts.expert_format == "bf16" else experts.w1_packed
    return ExpertLoRA(experts.num_experts, in_f, out_f, cfg.rank, cfg.alpha, cfg.dropout, cfg.use_rslora,
                      stored.device)


def applied_lora_config(model: nn.Module) -> LoRAConfig | None:
    """The LoRAConfig the model's adapters were built with (targets in ALLOWED_TARGETS order), or None if it
    has none. Dropout is read back too (it does not affect the weights)."""
    mods = [(path.rsplit(".", 1)[-1], m) for path, m in lora_linears(model)]
    mods += [(name, m) for _, name, m in expert_loras(model)]
    if not mods:
        return None
    settings = {(m.rank, m.alpha, m.use_rslora, m.dropout_p) for _, m in mods}
    assert len(settings) == 1, f"adapters built with different settings: {settings}"
    rank, alpha, use_rslora, dropout = settings.pop()
    names = {name for name, _ in mods}
    return LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora,
                      targets=[t for t in ALLOWED_TARGETS if t in names])


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block every LoRA delta of `model` is skipped: the model computes the frozen base alone (the
    reference policy of a KL term, without a second copy of the model). Restored on exit, also on error."""
    modules = [m for m in model.modules() if isinstance(m, (LoRALinear, ExpertLoRA))]
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in zip(modules, before):
            m.enabled = was


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Adapter Parameters only, by state-dict name (`...q_proj.lora_A.weight`, `...experts.lora.w1.lora_A`;
    the experts' stacked [E, r, In] / [E, Out, r] tensors)."""
    params = {}
    for path, m in lora_linears(model):
        params[f"{path}.lora_A.weight"] = m.lora_A.weight
        params[f"{path}.lora_B.weight"] = m.lora_B.weight
    for path, name, m in expert_loras(model):
        params[f"{path}.lora.{name}.lora_A"] = m.lora_A
        params[f"{path}.lora.{name}.lora_B"] = m.lora_B
    return params


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors only (detached, sharing storage with the Parameters), by state-dict name."""
    return {name: p.detach() for name, p in lora_parameters(model).items()}


def adapter_num_params(model: nn.Module) -> int:
    """Number of adapter parameters of a model with LoRA applied (works on the meta device)."""
    return sum(p.numel() for p in lora_parameters(model).values())


def remove_lora(model: nn.Module) -> list[str]:
    """Detach every adapter without merging: LoRALinears become plain nn.Linears holding the same weight
    Parameter, experts' `lora` becomes None. Returns the paths that had adapters. Base tensors are untouched
    (and stay frozen)."""
    removed = []
    for path, m in lora_linears(model):
        plain = nn.Linear(m.in_features, m.out_features, bias=False, device="meta")
        plain.weight, plain.bias = m.weight, m.bias
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path), child, plain)
        removed.append(path)
    for path, name, _ in expert_loras(model):
        removed.append(f"{path}.{name}")
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.lora = None
    return removed


@torch.no_grad()
def merge_lora_into_bf16(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight in place (W <- round(W + s * B @ A), summed in fp32) and
    remove the adapters; returns the merged paths. Needs bf16 (unquantized) experts when experts carry LoRA:
    merging into MXFP4 would re-quantize, and MXFP4's rounding error (~11% RMS of the weights) is far larger
    than a LoRA update, which would mostly be rounded away. Non-destructive alternatives: `merged_weight` /
    `delta_weight` of each adapter module, or merging a deep copy of the model."""
    experts = expert_loras(model)
    for path, _, _ in experts:
        if model.get_submodule(path).expert_format != "bf16":
            raise ValueError(f"{path}: experts are stored as MXFP4; merging would re-quantize and round the "
                             "LoRA update away (MXFP4 rounding error is ~11% RMS of the weights, the update "
                             "far smaller). Load the base with experts in bf16 (expert_format=bf16), then "
                             "merge")
    for _, m in lora_linears(model):
        m.weight.copy_(m.merged_weight())
    for path, name, m in experts:
        w = getattr(model.get_submodule(path), name)
        w.copy_((w.float() + m.delta_weight()).to(w.dtype))
    return remove_lora(model)
