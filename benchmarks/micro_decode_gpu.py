"""Two micro-measurements behind the decode-step figures of docs/concepts/engine.md (one GPU):

    python benchmarks/micro_decode_gpu.py [--json out.json]

* launch floor: a CUDA graph of N dependent `add_` kernels (N = 100, 846) on a [1] and a [256, 768] bf16 tensor,
  replayed 50 times; microseconds per kernel. (846 = kernels in one k3_m decode step at batch 256.)
* short conv step (`kernels/kda_decode.py`) at B = 256, C = 3072, W = 4, 2016 pool slots, for each channel tile
  (`block_c`), against its torch reference and a plain gather + `index_copy_` of the same pool rows; microseconds
  per call, 10 calls per graph replay, 200 replays.
"""
import argparse
import json

import torch
from gpu_measure import capture
from record import write_result

from miles_k3.kernels.kda_decode import short_conv_step, short_conv_step_reference


def us_per_call(fn, calls: int = 10, replays: int = 200) -> float:
    """Microseconds per `fn()` inside a captured graph of `calls` calls (launch overheads as in a decode graph)."""
    g, _ = capture(lambda: [fn() for _ in range(calls)])
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    for shape in ((1,), (256, 768)):
        t = torch.zeros(*shape, device="cuda", dtype=torch.bfloat16)
        for n in (100, 846):
            out[f"launch floor: graph of {n} add_ on {list(shape)}, us per kernel"] = us_per_call(
                lambda t=t: t.add_(1), calls=n, replays=50)
    b, c, w, n = 256, 3072, 4, 2016
    pool = torch.randn(n, c, w - 1, device="cuda").to(torch.bfloat16)
    x = torch.randn(b, c, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(n, device="cuda")[:b]
    weights = [torch.randn(c // 3, 1, w, device="cuda").to(torch.bfloat16) for _ in range(3)]
    for block in (32, 64, 128, 256, 512, 1024):
        out[f"short conv step, block_c {block}: us"] = us_per_call(
            lambda block=block: short_conv_step(x, pool, slots, weights, block_c=block))
    out["short conv step, torch reference: us"] = us_per_call(lambda: short_conv_step_reference(x, pool, slots,
                                                                                                weights))
    out["gather + index_copy_ of the pool rows: us"] = us_per_call(lambda: pool.index_copy_(0, slots, pool[slots]))
    print(json.dumps(out, indent=1))
    write_result("micro_decode_gpu", out, out=args.json)


if __name__ == "__main__":
    main()
