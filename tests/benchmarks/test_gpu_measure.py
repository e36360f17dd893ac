"""benchmarks/gpu_measure.py's step profile on the CPU: it runs the step as many times as asked, inside the
profile, and its table names what the step ran (the GPU share needs CUDA: gpu-marked)."""
import torch
from bench_module import load_benchmark
from kernel_testing import gpu_test

gm = load_benchmark("gpu_measure")


def test_step_profile_runs_the_step_and_names_its_ops():
    calls = []
    a = torch.randn(64, 64)

    def step():
        calls.append(1)
        (a @ a).sum()

    table, busy = gm.step_profile(step, 3, on_cuda=False)
    assert len(calls) == 3 and busy is None
    assert "aten::mm" in table and "aten::sum" in table


@gpu_test
def test_gpu_step_profile_counts_the_kernels_of_a_step():
    """Three elementwise kernels per call (randn is outside): a step of x + 1, then * 2, then .neg()."""
    x = torch.randn(1 << 20, device="cuda")

    def step():
        ((x + 1) * 2).neg()
        torch.cuda.synchronize()

    step()
    _, busy = gm.step_profile(step, 4, on_cuda=True)
    assert busy["kernels_per_step"] == 3, busy
    assert 0 < busy["kernel_s"] <= busy["wall_s"] and 0 < busy["busy_share"] <= 1
