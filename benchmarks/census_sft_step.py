"""Op census of one full-parameter SFT step of k3_m2's architecture (`recipe=reasoning_base`'s step): how many
ops of each name the step dispatches, split into batch (packing it, moving it to the device), forward, backward and
optimizer, and which source lines ask for the casts and copies. What it answers: how much host work a step asks
for, and where (a step on an H100 is bound by the host: dispatcher trips and kernel launches).

    python benchmarks/census_sft_step.py [--width reduced|full] [--dtype bf16|fp32] [--batch 32]
                                         [--micro-batch-tokens 16384] [--device cpu] [--top 15] [--out FILE]

The model is k3_m2's architecture from its random init (bf16 routed experts, every parameter trained, as
`recipe=reasoning_base` trains it): `--width full` is k3_m2 itself; `--width reduced` (the default, for CPU speed:
bf16 matmuls are slow on most CPUs) keeps every structural field (16 layers, the KDA/MLA pattern, 15 MoE layers,
64 experts, top-4, 2 shared experts, AttnRes blocks of 2, every flag) and narrows the widths and the vocabulary
(token ids are folded into it): the same ops, in smaller shapes. The batch is `--batch` worked_sum problems (the
recipe's task_args, tokenized by k3_m2's tokenizer, ~246 tokens each). One warm-up step (the optimizer's state is
created in it), then one counted step, run as `miles_k3.sft` runs one (`sft.sft_backward` +
`trainer.optim.optimizer_step` over `sft.build_full_optimizer`), under two modes:

* a TorchDispatchMode counts every aten op below autograd (`mm`, `_to_copy`, `copy_`, `clone`, ...: on CUDA each is
  a dispatcher trip and, mostly, a kernel launch); the composite ops above it (`aten::linear`, `aten::to`, ...) it
  does not see, nor what a CPU kernel calls inside itself (a GPU trace's table counts all of those);
* a TorchFunctionMode counts the Python-level torch calls, and marks a no-op one among `Tensor.to/float/bfloat16/
  type_as/contiguous/clone` (it returned its input: a dispatcher trip for nothing).

Each op is attributed to a source line: in forward, batch and optimizer the innermost frame in this repository;
in backward the autograd node that ran it and the forward line that created that node (anomaly mode's record,
NaN checks off). CPU and CUDA take different code in a few places; ops under them are marked `cpu_path` (on CUDA
each is one fused Triton kernel, one grouped matmul or fla's chunk_kda) and left out of the tables: the torch
references of RMSNorm, SiTU-GLU and the AttnRes mix, the KDA torch_chunk backend, and `experts.grouped_linear`
(per-expert matmuls on the CPU; one torch._grouped_mm on CUDA). Not marked, still CPU-specific: the MLA layers'
scaled_dot_product_attention (a CPU kernel; on CUDA flash attention) and a few backward copies that depend on the
layout of the gradients the CPU path returns (the q/k/v views of the KDA layers). The AdamW step is the
fused one, as on CUDA. Prints the tables and writes them
with `record.write_result` (`--out`, default benchmarks/results/census_sft_step.json). `--device cuda` marks
nothing as CPU path.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import torch
from bench_sft_gpu import worked_examples
from record import write_result
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from miles_k3 import sft
from miles_k3.model.build import ModelConfig, build_tokenizer
from miles_k3.model.config import K3Config
from miles_k3.model.weight_sources import RandomInit
from miles_k3.model.weights import build_k3
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.optim import OptimConfig, build_scheduler, optimizer_step

OPTIM = OptimConfig(lr=1e-3, betas=[0.9, 0.95], weight_decay=0.01, grad_clip=1.0)
REDUCED = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
           "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
           "intermediate_size": 128, "moe_intermediate_size": 16, "routed_expert_hidden_size": 32}
REDUCED_KDA = {"num_heads": 2, "head_dim": 32}
PHASES = ("batch", "forward", "backward", "optimizer")
CASTS = ("to", "float", "bfloat16", "half", "double", "type_as", "contiguous", "clone")
COPY_KERNELS = ("_to_copy", "copy_", "clone")
CPU_PATH_FUNCS = {"_rms_norm_torch", "_situ_glu_torch", "_attn_res_mix_torch", "_prefill_torch_chunk",
                  "grouped_linear"}  # emptied for --device cuda
ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()


def census_config(width: str) -> K3Config:
    """k3_m2, or k3_m2 with every width narrowed and every structural field kept (`--width reduced`)."""
    full = K3Config.from_name("k3_m2")
    if width == "full":
        return full
    kda = dataclasses.replace(full.linear_attn_config, **REDUCED_KDA)
    return dataclasses.replace(full, linear_attn_config=kda, **REDUCED)


def census_examples(batch: int, vocab_size: int) -> list[Sample]:
    """`batch` worked_sum examples as the recipe encodes them (k3_m2's tokenizer), ids folded into `vocab_size`."""
    tokenizer, stop_ids = build_tokenizer(ModelConfig(name="k3_m2"))
    examples = worked_examples(batch, tokenizer, stop_ids[0])
    return [Sample([i % vocab_size for i in e.prompt_ids], [i % vocab_size for i in e.response_ids])
            for e in examples]


@contextlib.contextmanager
def marked_forward(phase: list):
    """Within the block `sft.sft_loss` (the forward and the loss) sets phase[0] to forward when it starts and to
    backward when it returns: what `sft_backward` runs after it is `loss.backward()`."""
    real = sft.sft_loss

    def sft_loss(*args, **kwargs):
        phase[0] = "forward"
        loss = real(*args, **kwargs)
        phase[0] = "backward"
        return loss

    sft.sft_loss = sft_loss
    try:
        yield
    finally:
        sft.sft_loss = real


def _site(path: str, line, func: str) -> str | None:
    """"path:line func" of a frame in this repository (not this script, not the virtual environment), else None."""
    p = Path(path)
    if p == HERE or not p.is_relative_to(ROOT) or ".venv" in p.parts:
        return None
    return f"{p.relative_to(ROOT)}:{line} {func}"


def _frame_site(frame) -> tuple[str, bool]:
    """(the innermost frame in this repository, whether a CPU-path function is on the stack) of a live frame."""
    site, cpu_path = None, False
    while frame is not None:
        code = frame.f_code
        cpu_path = cpu_path or code.co_name in CPU_PATH_FUNCS
        site = site or _site(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return site or "(outside the repository)", cpu_path


def _node_site(node) -> tuple[str, bool]:
    """(the forward line that created autograd node `node`, whether a CPU-path function was on the stack), from
    anomaly mode's traceback of the node (`traceback.format_stack` entries, innermost last)."""
    site, cpu_path = None, False
    for entry in reversed(node.metadata.get("traceback_") or []):
        head = entry.strip().splitlines()[0] if entry.strip() else ""
        if not head.startswith('File "'):
            continue
        path, _, rest = head.removeprefix('File "').partition('", line ')
        line, _, func = rest.partition(", in ")
        cpu_path = cpu_path or func in CPU_PATH_FUNCS
        site = site or _site(path, line, func)
    return site or "(outside the repository)", cpu_path


class Census:
    """(phase, level, name, site, cpu_path, noop) -> count; level "aten" (below autograd) or "call" (Python)."""

    def __init__(self, phase: list):
        self.phase = phase
        self.rows: collections.Counter = collections.Counter()

    def add(self, level: str, name: str, noop: bool = False) -> None:
        if self.phase[0] is None:
            return
        node = torch._C._current_autograd_node() if self.phase[0] == "backward" else None
        if node is not None:
            where, cpu_path = _node_site(node)
            site = f"{type(node).__name__} <- {where}"
        else:
            site, cpu_path = _frame_site(sys._getframe(2))
        self.rows[(self.phase[0], level, name, site, cpu_path, noop)] += 1


class _Calls(TorchFunctionMode):
    def __init__(self, census: Census):
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", repr(func))
        if name not in ("__get__", "__set__"):  # attribute reads (.shape, .dtype, ...)
            noop = name in CASTS and bool(args) and out is args[0]
            self.census.add("call", name, noop)
        return out


class _Kernels(TorchDispatchMode):
    def __init__(self, census: Census):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.census.add("aten", func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sft_setup(cfg: K3Config, device: torch.device, dtype: torch.dtype):
    """(model, params, optimizer, scheduler) of a full-parameter SFT run of `cfg` from its random init (bf16
    experts, every parameter trained), the fused AdamW that `sft.build_full_optimizer` takes on CUDA."""
    model = build_k3(RandomInit(cfg, "bf16", 0), "bf16", device, dtype).requires_grad_(True)
    params = dict(model.named_parameters())
    opt = sft.build_full_optimizer(params, OPTIM, fused=True)
    return model, params, opt, build_scheduler(opt, OPTIM)


def counted_step(model, params, opt, sched, examples, device, micro) -> tuple[float, Census]:
    """One SFT step as `miles_k3.sft` runs it, every op counted (`Census`); returns (the loss, the census)."""
    phase: list = [None]
    census = Census(phase)
    with (marked_forward(phase), torch.autograd.set_detect_anomaly(True, check_nan=False), _Calls(census),
          _Kernels(census)):
        phase[0] = "batch"
        loss, _ = sft.sft_backward(model, examples, 0, device, micro, False)
        phase[0] = "optimizer"
        optimizer_step(opt, sched, params, OPTIM)
        phase[0] = None
    return loss, census


# ---- tables -----------------------------------------------------------------------------------------------
def _table(title: str, counts: collections.Counter, top: int) -> list[str]:
    lines = [title] + [f"  {n:>7,}  {name}" for name, n in counts.most_common(top)]
    return lines + [f"  {sum(counts.values()):>7,}  (all, {len(counts)} names)"]


def summarize(census: Census, top: int) -> tuple[dict, list[str]]:
    """The figures and the printed tables of a census; everything outside the CPU path unless said."""
    kernels = {p: collections.Counter() for p in PHASES}
    calls = {p: collections.Counter() for p in PHASES}
    cpu_path = collections.Counter()
    sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (p, level, name, site, on_cpu_path, noop), n in census.rows.items():
        if on_cpu_path:
            cpu_path[f"{level} {p}"] += n
            continue
        (kernels if level == "aten" else calls)[p][f"{name} (no-op)" if noop else name] += n
        if (level == "aten" and name in COPY_KERNELS) or (level == "call" and name in CASTS):
            sites[f"{level} {name}{' (no-op)' if noop else ''}"][f"{p}: {site}"] += n
    step_kernels = sum(kernels.values(), collections.Counter())
    lines = ["aten ops per phase: " + ", ".join(f"{p} {sum(kernels[p].values()):,}" for p in PHASES)
             + f"; step {sum(step_kernels.values()):,} (CPU path, left out: {cpu_path['aten forward']:,} forward,"
             f" {cpu_path['aten backward']:,} backward)",
             "Python calls per phase: " + ", ".join(f"{p} {sum(calls[p].values()):,}" for p in PHASES)]
    lines += _table(f"top {top} aten ops of the step", step_kernels, top)
    for p in PHASES:
        lines += _table(f"top {top} aten ops, {p}", kernels[p], top)
    casts = collections.Counter({k: v for c in calls.values() for k, v in c.items() if k.split()[0] in CASTS})
    lines += _table("casts and copies called from Python (all phases)", casts, len(casts))
    for kind in sorted(sites):
        lines += _table(f"{kind} by site", sites[kind], top)
    figures = {
        "aten_totals": {p: sum(kernels[p].values()) for p in PHASES},
        "call_totals": {p: sum(calls[p].values()) for p in PHASES},
        "cpu_path_left_out": dict(cpu_path),
        "aten": {p: dict(kernels[p].most_common()) for p in PHASES},
        "calls": {p: dict(calls[p].most_common()) for p in PHASES},
        "sites": {k: dict(v.most_common()) for k, v in sorted(sites.items())},
        "rows": [{"phase": p, "level": level, "name": name, "site": site, "noop": noop, "count": n}
                 for (p, level, name, site, on_cpu_path, noop), n in census.rows.most_common() if not on_cpu_path],
    }
    return figures, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", choices=("reduced", "full"), default="reduced")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type != "cpu":
        CPU_PATH_FUNCS.clear()
    cfg = census_config(args.width)
    model, params, opt, sched = sft_setup(cfg, device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    examples = census_examples(args.batch, cfg.vocab_size)
    t = time.perf_counter()
    warm, _ = sft.sft_backward(model, examples, 0, device, args.micro_batch_tokens, False)
    optimizer_step(opt, sched, params, OPTIM)
    print(f"warm-up step: loss {warm:.4f}, {time.perf_counter() - t:.1f} s", flush=True)
    loss, census = counted_step(model, params, opt, sched, examples, device, args.micro_batch_tokens)
    figures, lines = summarize(census, args.top)
    print("\n".join(lines))
    figures = {"model": "k3_m2", "width": args.width, "config": cfg.to_dict(), "dtype": args.dtype,
               "device": str(device), "batch": args.batch, "tokens": sum(e.length - 1 for e in examples),
               "micro_batch_tokens": args.micro_batch_tokens, "losses": [warm, loss],
               "params": sum(p.numel() for p in params.values()), **figures}
    write_result("census_sft_step", figures, out=args.out)


if __name__ == "__main__":
    main()
