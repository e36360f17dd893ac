"""Shared helpers of the kernel tests (`kernels/`, `miles_k3.kernels`): running Triton kernels on CPU under the Triton interpreter,
the `gpu` marker, and ulp distances of 16-bit floats.

TRITON_INTERPRET=1 must be set before a kernel module is imported, so a test file runs its cases in a subprocess
of itself: the file defines INTERPRETER_CASES {name: (check_fn, kwargs)} and ends with
`if __name__ == "__main__": print_results(INTERPRETER_CASES)`; the `interpreter_results` fixture (conftest.py)
runs it through `results_of`, and one parametrized test per case asserts `results[case] == "ok"`. Single-script
checks call `interpreted(code)` directly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from repo_helpers import pythonpath

_PREFIX = "RESULTS "


def print_results(cases: dict) -> None:
    """In the subprocess: run every case on CPU (each `check_fn("cpu", **kwargs)`), print 'ok' or the failure."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    out = {}
    for name, (fn, kw) in cases.items():
        try:
            fn("cpu", **kw)
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per case by the parent test
            out[name] = f"{type(e).__name__}: {e}"
    print(_PREFIX + json.dumps(out), flush=True)


def interpreted(code: str, timeout: int = 600) -> str:
    """Run python `code` in a subprocess under the Triton interpreter (the test modules and helpers importable by
    name); its stdout. Fails the calling test, with the subprocess's stderr tail, when the code exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath()}
    proc = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"interpreter run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}" \
                                 f"{proc.stderr[-4000:]}"
    return proc.stdout


def results_of(test_file: str, timeout: int = 600) -> dict[str, str]:
    """Run `test_file` as a script under the interpreter; the per-case results it printed."""
    code = f"import runpy; runpy.run_path({test_file!r}, run_name='__main__')"
    lines = [ln for ln in interpreted(code, timeout).splitlines() if ln.startswith(_PREFIX)]
    assert lines, f"{test_file} printed no {_PREFIX.strip()} line"
    return json.loads(lines[-1][len(_PREFIX):])


def gpu_test(fn):
    """Marks a test `gpu` and skips it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The fused kernels' activation dtypes by the names their tests are parametrized with."""


HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""An upper bound on half an ulp relative to |value|, per output dtype: the last rounding of a 16-bit result
(fp32 results are compared against their own bounds)."""
SUBNORMAL_FLOOR = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 2.0**-25}
"""An absolute floor for the same comparisons: fp16's subnormal step is 2^-24."""


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with `seed` (inputs drawn on the CPU, then moved, are the same on every device)."""
    return torch.Generator().manual_seed(seed)


# SiTU-GLU inputs that reach every branch of the fused kernels: large magnitudes (saturation), the 0.3 switch of
# their tanh, tiny values and signed zeros
SITU_SPECIALS = [1e4, -1e4, 3e3, -3e3, 200.0, -200.0, 100.0, -100.0, 88.0, -88.0, 40.0, -40.0, 1.2, -1.2, 0.6,
                 -0.6, 0.3, -0.3, 0.29, -0.29, 1e-3, -1e-3, 1e-20, -1e-20, 0.0, -0.0]


def ordered16(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers that count ulps across zero (+0 and -0 both map to 0)."""
    i = t.view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def ulps16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps, elementwise, for two 16-bit float tensors of one dtype."""
    return (ordered16(a) - ordered16(b)).abs()


def assert_ulps16(got: torch.Tensor, ref: torch.Tensor, max_ulps: int = 1, ref32: torch.Tensor | None = None,
                  floor: float = 0.0, what: str = "") -> None:
    """16-bit `got` within `max_ulps` of `ref`, except elements within `floor` of the fp32 value `ref32`."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype, got.shape, ref.shape)
    assert not bool(got.isnan().any()), f"{what}: NaN in output"
    d = ulps16(got, ref)
    bad = d > max_ulps
    if ref32 is not None:
        bad &= (got.float() - ref32).abs() > floor
    if bool(bad.any()):
        idx = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} outputs more than {max_ulps} ulp apart "
                             f"(max {int(d.max())}); first at {idx}: got {got.reshape(-1)[idx].item()!r}, "
                             f"ref {ref.reshape(-1)[idx].item()!r}")


def cuda_kernels(fn) -> list[str]:
    """Names of the CUDA kernels one call of `fn` launches (torch.profiler); a first call, outside the profile,
    compiles / warms up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def capture(step, warmups: int = 1):
    """Run `step()` `warmups` times on a side stream (kernels compile, allocations settle), then capture one call
    in a CUDA graph; returns (graph, the captured call's outputs). Call under torch.no_grad() as needed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs
