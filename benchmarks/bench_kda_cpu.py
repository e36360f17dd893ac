"""CPU timings of the KDA implementations that `resolve_kda_backend` can pick, at a K3-tiny RL batch shape.

Run: `python benchmarks/bench_kda_cpu.py [--batch 128 --seq 128 --heads 4 --dim 32 --repeats 5 --threads 2]`.
Prints forward (no grad) and forward+backward seconds for torch_chunk_kda (chunk 16 and 32), fla's
naive_recurrent_kda and naive_chunk_kda, plus one decode step, each the median of a few repeats after a
warmup, with the speed-up over naive_recurrent_kda measured in the same run. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from functools import partial

import torch

warnings.filterwarnings("ignore")  # fla warns that Triton has no GPU here

from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
from record import write_result

from miles_k3.model.kda_ops import l2norm, resolve_kda_backend, torch_chunk_kda, torch_decode_step


def make_inputs(batch: int, seq: int, heads: int, dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Realistic fp32 inputs: unit q/k, g in (-5, 0) (K3's gate bound), beta in (0, 1), a random state."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq, heads, dim)
    return {
        "q": l2norm(torch.randn(shape, generator=gen)), "k": l2norm(torch.randn(shape, generator=gen)),
        "v": torch.randn(shape, generator=gen), "g": -5 * torch.sigmoid(torch.randn(shape, generator=gen)),
        "beta": torch.sigmoid(torch.randn(shape[:3], generator=gen)),
        "initial_state": torch.randn(batch, heads, dim, dim, generator=gen)}


def time_it(fn, repeats: int) -> float:
    """Median wall seconds of `repeats` calls after one warmup call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward(kda, inputs):
    with torch.no_grad():
        kda(**inputs, output_final_state=True)


def forward_backward(kda, inputs):
    leaves = {name: t.clone().requires_grad_() for name, t in inputs.items()}
    o, state = kda(**leaves, output_final_state=True)
    (o.square().sum() + state.square().sum()).backward()


def bench_prefill(inputs, repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (forward s, forward+backward s). naive_chunk_kda is slow (Python loops over rows): 1 repeat."""
    impls = {
        "torch_chunk_kda C=16": (partial(torch_chunk_kda, chunk_size=16), repeats),
        "torch_chunk_kda C=32": (partial(torch_chunk_kda, chunk_size=32), repeats),
        "naive_recurrent_kda": (naive_recurrent_kda, repeats),
        "naive_chunk_kda C=64": (naive_chunk_kda, 1),
    }
    return {name: (time_it(partial(forward, fn, inputs), reps),
                   time_it(partial(forward_backward, fn, inputs), reps))
            for name, (fn, reps) in impls.items()}


def bench_decode(batch: int, heads: int, dim: int, repeats: int) -> dict[str, float]:
    """name -> seconds for one token of `batch` requests (raw q/k, as backends receive them)."""
    step = make_inputs(batch, 1, heads, dim, seed=1)
    args = (step["q"], step["k"], step["v"], step["g"], step["beta"], step["initial_state"])
    impls = {"torch_decode_step": torch_decode_step,
             "naive_recurrent_kda T=1": resolve_kda_backend("naive_recurrent", "cpu").decode}
    return {name: time_it(partial(fn, *args), repeats * 20) for name, fn in impls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32, help="K = V")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, B={args.batch} T={args.seq} "
          f"H={args.heads} K=V={args.dim}, median of {args.repeats} after a warmup")
    prefill = bench_prefill(make_inputs(args.batch, args.seq, args.heads, args.dim), args.repeats)
    ref_fwd, ref_both = prefill["naive_recurrent_kda"]
    print(f"\n{'prefill':24s} {'fwd s':>9s} {'fwd+bwd s':>10s} {'fwd x':>7s} {'fwd+bwd x':>10s}"
          "  (x: speed-up vs naive_recurrent)")
    for name, (fwd, both) in prefill.items():
        print(f"{name:24s} {fwd:9.4f} {both:10.4f} {ref_fwd / fwd:7.2f} {ref_both / both:10.2f}")
    decode = bench_decode(args.batch, args.heads, args.dim, args.repeats)
    ref = decode["naive_recurrent_kda T=1"]
    print(f"\n{'decode step, B=' + str(args.batch):24s} {'ms':>9s} {'x':>7s}")
    for name, secs in decode.items():
        print(f"{name:24s} {secs * 1e3:9.3f} {ref / secs:7.2f}")
    write_result("bench_kda_cpu", {"threads": args.threads, "batch": args.batch, "seq": args.seq, "heads": args.heads,
                                   "dim": args.dim, "prefill_fwd_fwdbwd_s": prefill, "decode_step_s": decode})


if __name__ == "__main__":
    main()
