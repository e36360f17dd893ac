"""GPU measuring helpers of the benchmarks (bench_k3_layers_gpu.py, profile_decode_gpu.py through it,
bench_sft_gpu.py, bench_train_step.py, bench_mxfp4_gpu.py, micro_decode_gpu.py): CUDA-event timing, the device's
copy bandwidth and bf16 GEMM rate (the bounds' denominators, measured in the same run), CUDA-graph capture, a
per-kernel profile, and a whole step's profile with how busy the GPU was. Need CUDA, except `step_profile` (on the
CPU: the CPU ops' table alone)."""
from __future__ import annotations

import statistics

import torch


def timed_ms(fn, iters: int = 3, warmup: int = 1) -> float:
    """Median CUDA-event time of fn() in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes moved (read + written) per second by a 4 GiB device-to-device copy."""
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), iters=5)
    return 2 * 2**31 / (ms / 1e3)


def gemm_rate() -> float:
    """bf16 FLOP/s of an 8192^3 torch.mm."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed_ms(lambda: a @ b, iters=10)
    return 2 * 8192**3 / (ms / 1e3)


def capture(step):
    """(graph, outputs) of step() captured after a warm-up on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def top_kernels(fn, n: int = 10) -> dict[str, float]:
    """GPU ms per kernel name (the n largest) of one fn() call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:90]] = per.get(e.name[:90], 0.0) + e.device_time_total / 1e3
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:n])


def step_profile(step, calls: int, on_cuda: bool, rows: int = 30) -> tuple[str, dict | None]:
    """torch.profiler over `calls` calls of step() (each synchronising before it returns; step() returns nothing
    needed): the table of the top `rows` ops and kernels by CUDA time (CPU time without CUDA), and, on CUDA, how busy
    the GPU was: the calls' wall seconds, the kernels' seconds, their ratio, and kernels launched per call. A step
    that keeps the GPU busy a small share of its wall time is bound by the host's launches, not by its kernels."""
    import time

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    wall = 0.0
    with profile(activities=acts) as prof:
        for _ in range(calls):
            t0 = time.perf_counter()
            step()
            wall += time.perf_counter() - t0
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total" if on_cuda else "cpu_time_total", row_limit=rows)
    if not on_cuda:
        return table, None
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    return table, {"wall_s": round(wall, 3), "kernel_s": round(busy, 3), "busy_share": round(busy / wall, 3),
                   "kernels_per_step": round(sum(e.count for e in kernels) / calls)}
