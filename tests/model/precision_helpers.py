"""Shared by the tests of the gap's precision switches (`model.fp32_lm_head`, `model.fp32_residual`)."""
import json
from pathlib import Path

from repo_helpers import REPO

BASE = REPO / "miles_k3" / "model" / "bases" / "k3_nano_chain_sum"
"""The shipped trained k3_nano (chain_sum)."""


def final_hidden(model, ids):
    """(the normed hidden state the lm_head reads: the final RMSNorm's output, captured by a hook; the logits)."""
    seen = []
    handle = model.model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        logits = model(ids).logits
    finally:
        handle.remove()
    return seen[0], logits


def write_problems(path: Path, n: int = 8) -> Path:
    """n chain-sum problems of the base's kind as id / problem / answer rows, for bench_gap_sources."""
    path.write_text("".join(json.dumps({"id": str(i), "problem": f"{3 * i % 97} + {7 * i % 89} - {i}",
                                        "answer": str(3 * i % 97 + 7 * i % 89 - i)}) + "\n" for i in range(n)))
    return path
