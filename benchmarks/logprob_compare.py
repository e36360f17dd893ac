"""What the K3 comparison benchmarks share (bench_sglang_k3.py, bench_rounding_floor.py): the log-prob and agreement
math (pure; checked on the CPU), seeded random prompts, our argmax, and the route-pinned copy of a checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch

PIN_BIAS = 10.0
"""What --pin-routes adds to the selection bias of the pinned experts: above the 1.0 any sigmoid score difference
can make up."""


def _strip_first(ours: list, theirs: list) -> list:
    """SGLang's per-position list with its None first entry (the first prompt token has no log-prob) dropped."""
    if len(theirs) == len(ours) + 1 and theirs[0] is None:
        theirs = theirs[1:]
    if len(theirs) != len(ours) or any(v is None for v in theirs):
        raise ValueError(f"{len(theirs)} SGLang positions (None ones: {sum(v is None for v in theirs)}) for "
                         f"{len(ours)} of ours")
    return theirs


def logprob_gap(ours: list[list[float]], theirs: list[list[float | None]]) -> dict:
    """|ours - theirs| per position over all prompts (nats/token): {mean, max, tokens}. `theirs[i]` may carry SGLang's
    None first entry (len(ours[i]) + 1 values); it is skipped."""
    diffs = [abs(a - b) for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, _strip_first(o, t))]
    if not diffs:
        raise ValueError("no positions to compare (prompts of one token?)")
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "tokens": len(diffs)}


def spread(values: list[list[float]]) -> float:
    """Mean |v - mean(v)| over all positions: how much the log-probs vary (a gap's scale)."""
    flat = [v for row in values for v in row]
    mean = sum(flat) / len(flat)
    return sum(abs(v - mean) for v in flat) / len(flat)


def argmax_agreement(ours: list[list[int]], theirs: list[list[int | None]]) -> float:
    """The share of positions whose top-1 token ids agree (theirs may carry SGLang's None first entry)."""
    pairs = [(a, b) for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, _strip_first(o, t))]
    return sum(a == b for a, b in pairs) / len(pairs)


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token agreement of paired continuations, over max(len) positions per pair (a missing token disagrees):
    {prefix_frac: positions before the pair's first divergence / positions, overall_frac: equal positions / positions,
    identical: pairs equal throughout, sequences}."""
    positions = prefix = equal = identical = 0
    for x, y in zip(a, b, strict=True):
        n = max(len(x), len(y))
        same = [i < len(x) and i < len(y) and x[i] == y[i] for i in range(n)]
        first = same.index(False) if False in same else n
        positions += n
        prefix += first
        equal += sum(same)
        identical += first == n
    if positions == 0:
        raise ValueError("no generated tokens to compare")
    return {"prefix_frac": prefix / positions, "overall_frac": equal / positions, "identical": identical,
            "sequences": len(a)}


def top1_ids(rows: list) -> list[int | None]:
    """SGLang's input_top_logprobs (per position None or [(logprob, token_id, text), ...]) -> the top-1 ids."""
    return [None if r is None else int(r[0][1]) for r in rows]


def random_prompts(num: int, length: int, vocab_size: int, exclude: set[int], seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids drawn uniformly (seeded) from range(vocab_size) minus `exclude`."""
    allowed = torch.tensor(sorted(set(range(vocab_size)) - set(exclude)))
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(0, len(allowed), (num, length), generator=g)].tolist()


def pin_routes(src: str | Path, dst: str | Path, top_k: int, seed: int) -> dict[str, list[int]]:
    """Copy the checkpoint directory src to dst with every `*.e_score_correction_bias` raised by PIN_BIAS at top_k
    experts drawn per tensor (seeded); returns {tensor name: pinned expert ids}. Other files and tensors unchanged."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError(f"--pin-routes: {dst} is the model directory itself; name another directory")
    dst.mkdir(parents=True, exist_ok=True)
    pinned: dict[str, list[int]] = {}
    g = torch.Generator().manual_seed(seed)
    for f in sorted(src.iterdir()):
        if f.suffix != ".safetensors":
            if f.is_file():
                shutil.copy2(f, dst / f.name)
            continue
        with safe_open(f, "pt") as fh:
            names, meta = list(fh.keys()), fh.metadata()
            if not any(n.endswith(".e_score_correction_bias") for n in names):
                shutil.copy2(f, dst / f.name)
                continue
            tensors = {n: fh.get_tensor(n) for n in names}
        for n in sorted(tensors):
            if n.endswith(".e_score_correction_bias"):
                ids = torch.randperm(tensors[n].numel(), generator=g)[:top_k]
                tensors[n] = tensors[n].clone()
                tensors[n][ids] += PIN_BIAS
                pinned[n] = sorted(ids.tolist())
        save_file(tensors, dst / f.name, metadata=meta)
    if not pinned:
        raise ValueError(f"--pin-routes: {src} has no e_score_correction_bias tensors (no MoE layers to pin)")
    return pinned


@torch.no_grad()
def our_argmax(model, ids: list[int]) -> list[int]:
    """Our top-1 token id after each prefix ids[:i], i = 1 .. len(ids) - 1 (the positions of ids[1:])."""
    device = next(model.parameters()).device
    x = torch.tensor([ids[:-1]], device=device)
    return model(x, seq_lens=torch.tensor([len(ids) - 1], device=device)).logits[0].argmax(-1).tolist()
