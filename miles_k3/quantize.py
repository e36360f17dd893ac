"""`python -m miles_k3.quantize SRC DST [--scale-rule floor|ceil] [--max-shard-bytes N] [--overwrite]`: turn
a bf16 K3 checkpoint directory into a native MXFP4 one, as published. Only the routed experts change:
`…experts.{e}.w{1,2,3}.weight` [out, in] becomes `.weight_packed` uint8 [out, in/2] + `.weight_scale` uint8
E8M0 [out, in/32] (group 32); every other tensor (vision ones included) is copied byte for byte, `config.json`
gains the compressed-tensors `quantization_config` under `text_config` (a flat source config is rewritten in
the published nested form; `miles_k3.model.weight_writer.config_with_quantization`), and every other file
(tokenizer, code, ...) is copied. Scale rules (`miles_k3.kernels.mxfp4`): `floor` (the default)
is the OCP rule that compressed-tensors uses, X = 2^(floor(log2 amax) - 2), so a block's largest values may
clip to 6 X; `ceil`, X = 2^ceil(log2(amax / 6)), never clips but may give up one binade of resolution. The
source is validated first (names, shapes, dtypes); it streams one source shard at a time (output shards never
span source shards, so memory is bounded by one source shard), and the destination is written atomically (a
temporary sibling directory renamed into place when complete).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from miles_k3.kernels.mxfp4 import SCALE_RULES, quantize_mxfp4
from miles_k3.model.weight_files import (
    CONFIG_FILE,
    EXPERT_NAME,
    INDEX_FILE,
    WeightsError,
    inspect_weights,
    open_safetensors,
)
from miles_k3.model.weight_writer import WeightWriter, config_with_quantization

log = logging.getLogger("miles_k3.quantize")

# Not copied as "other files": the weights, and the files that are rewritten; `.cache` is huggingface_hub's.
_SKIPPED_FILES = (CONFIG_FILE, INDEX_FILE, ".cache")


def quantize_checkpoint(src: str | Path, dst: str | Path, scale_rule: str = "floor",
                        max_shard_bytes: int | None = None, overwrite: bool = False,
                        device: torch.device | None = None) -> Path:
    """Write the MXFP4 version of bf16 checkpoint `src` to `dst`; returns `dst`. See the module docstring.
    `device` (e.g. CUDA): where the experts are quantized (the bytes are the same on every device: the rounding
    is comparisons and power-of-two products)."""
    src, dst = Path(src), Path(dst)
    if scale_rule not in SCALE_RULES:
        raise WeightsError(f"scale_rule: '{scale_rule}' is not one of {', '.join(SCALE_RULES)}")
    if dst.resolve() == src.resolve():
        raise WeightsError(f"DST {dst} is SRC; write the MXFP4 copy to another directory")
    info = inspect_weights(src)
    if info.expert_format != "bf16":
        example = next(n for n in info.tensors if n.endswith(".weight_packed"))
        raise WeightsError(f"{src}: the routed experts are already MXFP4 (e.g. '{example}'); nothing to "
                              "do")
    names_by_file: dict[Path, list[str]] = {}
    for name, (file, _) in info.tensors.items():
        names_by_file.setdefault(file, []).append(name)
    for name, file in info.other_tensors.items():
        names_by_file.setdefault(file, []).append(name)
    n_experts = 0
    with WeightWriter(dst, overwrite=overwrite, max_shard_bytes=max_shard_bytes) as writer:
        writer.write_json(CONFIG_FILE, config_with_quantization(info.raw_config))
        for entry in sorted(src.iterdir()):
            if entry.name not in _SKIPPED_FILES and not entry.name.endswith(".safetensors"):
                writer.copy_in(entry, entry.name)
        for file in sorted(names_by_file):
            with open_safetensors(file, names_by_file[file]) as f:
                for name in sorted(names_by_file[file]):
                    m = EXPERT_NAME.match(name) if name in info.tensors else None
                    if m is None:
                        writer.add({name: f.get_tensor(name)})
                        continue
                    w = f.get_tensor(name)
                    packed, scale = quantize_mxfp4(w if device is None else w.to(device), scale_rule)
                    packed, scale = packed.cpu(), scale.cpu()
                    writer.add({f"{m['base']}.weight_packed": packed, f"{m['base']}.weight_scale": scale})
                    n_experts += 1
            writer.flush()  # one source shard -> its own output shard(s)
            log.info("quantized %s", file.name)
    log.info("wrote %s: %d expert projections in MXFP4 (scale rule %s)", dst, n_experts, scale_rule)
    return dst


def main(argv: list[str]) -> Path:
    parser = argparse.ArgumentParser(prog="python -m miles_k3.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="bf16 K3 checkpoint directory")
    parser.add_argument("dst", help="output directory (written atomically)")
    parser.add_argument("--scale-rule", choices=SCALE_RULES, default="floor",
                        help="E8M0 scale rule: floor (OCP, compressed-tensors; the default) or ceil "
                             "(never clips)")
    parser.add_argument("--max-shard-bytes", type=int, default=None,
                        help="split output shards above this size (default: one output shard per source "
                             "shard)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)
    try:
        return quantize_checkpoint(args.src, args.dst, args.scale_rule, args.max_shard_bytes, args.overwrite)
    except ValueError as e:  # WeightsError, ConfigError
        raise SystemExit(f"miles_k3.quantize: {e}") from None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(main(sys.argv[1:]))
