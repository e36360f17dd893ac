"""MXFP4 -> bf16 dequant throughput on one GPU: eager torch reference vs the Triton kernel vs a plain bf16 copy.

    python benchmarks/bench_mxfp4_gpu.py [--iters 50] [--warmup 10] [--dtype bf16|fp32] [--json out.json]

Shapes: [3072, 3584] (a K3 routed expert's w1/w3) and [5760, 2880] (gpt-oss gate_up). Each method is timed with
CUDA events around one call, after warmup; the median of --iters calls is reported. GB/s counts bytes read +
written: dequant reads packed (K/2 B per row) + scales (K/32 B) and writes the output; the baseline copies a bf16
(or fp32) tensor of the output's size (reads and writes it: 2x its bytes). Also checks that the Triton output is
bitwise equal to the reference's.
"""
from __future__ import annotations

import argparse

import torch
from gpu_measure import timed_ms
from record import write_result

from miles_k3.kernels.mxfp4 import dequantize_mxfp4_reference, dequantize_mxfp4_triton

SHAPES = [(3072, 3584), (5760, 2880)]


def bench_shape(n: int, k: int, dtype: torch.dtype, iters: int, warmup: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=g)
    scale = torch.randint(110, 140, (n, k // 32), device="cuda", dtype=torch.uint8, generator=g)
    out = torch.empty(n, k, device="cuda", dtype=dtype)
    src = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    dst = torch.empty_like(src)
    ref = dequantize_mxfp4_reference(packed, scale, dtype)
    tri = dequantize_mxfp4_triton(packed, scale, dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    bitwise_equal = torch.equal(ref.view(bits), tri.view(bits))
    del ref, tri
    out_bytes = out.numel() * out.element_size()
    dq_bytes = packed.numel() + scale.numel() + out_bytes
    methods = {
        "reference": (lambda: dequantize_mxfp4_reference(packed, scale, dtype), dq_bytes),
        "triton": (lambda: dequantize_mxfp4_triton(packed, scale, dtype, out=out), dq_bytes),
        "copy_baseline": (lambda: dst.copy_(src), 2 * out_bytes),
    }
    res: dict = {"shape": [n, k], "dtype": str(dtype).removeprefix("torch."), "bitwise_equal": bitwise_equal}
    for name, (fn, nbytes) in methods.items():
        us = timed_ms(fn, iters, warmup) * 1e3
        res[name] = {"us": round(us, 2), "GB_per_s": round(nbytes / us / 1e3, 1), "bytes": nbytes}
    res["speedup_triton_over_reference"] = round(res["reference"]["us"] / res["triton"]["us"], 2)
    res["triton_time_over_reference"] = round(res["triton"]["us"] / res["reference"]["us"], 4)
    res["triton_bw_over_copy_bw"] = round(res["triton"]["GB_per_s"] / res["copy_baseline"]["GB_per_s"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mxfp4_gpu.py needs a CUDA device")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    for n, k in SHAPES:
        r = bench_shape(n, k, dtype, args.iters, args.warmup)
        results["shapes"].append(r)
        print(f"[{n}, {k}] -> {r['dtype']}  bitwise_equal={r['bitwise_equal']}")
        for name in ("reference", "triton", "copy_baseline"):
            print(f"  {name:14s} {r[name]['us']:9.1f} us  {r[name]['GB_per_s']:8.1f} GB/s")
        print(f"  triton/reference time {r['triton_time_over_reference']:.4f} "
              f"(speedup {r['speedup_triton_over_reference']:.1f}x); triton/copy bandwidth "
              f"{r['triton_bw_over_copy_bw']:.2f}", flush=True)
    write_result("bench_mxfp4_gpu", results, out=args.json)


if __name__ == "__main__":
    main()
