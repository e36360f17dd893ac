"""The KDA decode recurrence kernel (`miles_k3.kernels.kda_decode.kda_recurrent_step`) on CPU: its pure-torch
reference against the model's in-place decode (`KDABackend.decode_into` of the torch backends: fla's naive gate,
then the recurrence on gathered rows, scattered back), and the kernel under the Triton interpreter against the
reference. The GPU parity tests are in tests/kernels/test_gpu_kda_recurrent.py.

Tolerances: reference vs model decode, fp32 state and fp32 outputs within 1e-5 relative + 1e-6 absolute (the
same fp32 operations, einsum vs the model's reduction order). Kernel (interpreter, numpy fp32) vs reference:
the same within 1e-5 relative + 1e-6; every pool row that no real row names is untouched (bitwise).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreted

from miles_k3.kernels.kda_decode import kda_recurrent_step_reference
from miles_k3.model.kda_ops import resolve_kda_backend


def make_inputs(b, h, hv, kd, vd, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    q, k = r(b, 1, h, kd).to(dtype), r(b, 1, h, kd).to(dtype)
    v, f = r(b, 1, hv, vd).to(dtype), r(b, 1, hv, kd).to(dtype)
    beta = r(b, 1, hv).to(dtype)
    a_log = torch.rand(hv, generator=g).mul(2).add(0.1).log()
    dt_bias = r(hv * kd) * 0.5
    pool = r(n, hv, kd, vd)
    slots = torch.randperm(n, generator=g)[:b]
    return q, k, v, f, beta, a_log, dt_bias, pool, slots


@pytest.mark.parametrize("backend", ["torch_chunk", "naive_recurrent"])
def test_reference_matches_the_model_decode_into(backend):
    be = resolve_kda_backend(backend, torch.device("cpu"), -5.0)
    q, k, v, f, beta, a_log, dt_bias, pool, slots = make_inputs(6, 2, 4, 16, 32, 9)
    pool_ref = pool.clone()
    o = kda_recurrent_step_reference(q, k, v, f, beta, a_log, dt_bias, -5.0, pool, slots)
    o_model = be.decode_into(q, k, v, f, beta, a_log, dt_bias, -5.0, pool_ref, slots)
    torch.testing.assert_close(o, o_model.to(o.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-5, atol=1e-6)


_CASE = r"""
import torch
from miles_k3.kernels.kda_decode import kda_recurrent_step, kda_recurrent_step_reference
from test_kda_recurrent_kernel import make_inputs
for (b, h, hv, kd, vd, n, bv, dtype) in [(5, 2, 4, 16, 32, 8, 16, torch.float32), (3, 1, 1, 24, 20, 4, 32, torch.float32),
                                         (4, 2, 2, 16, 16, 6, 16, torch.bfloat16)]:
    q, k, v, f, beta, a_log, dt_bias, pool, slots = make_inputs(b, h, hv, kd, vd, n, dtype)
    pool_k = pool.clone()
    o_ref = kda_recurrent_step_reference(q, k, v, f, beta, a_log, dt_bias, -5.0, pool, slots)
    o = kda_recurrent_step(q, k, v, f, beta, a_log, dt_bias, -5.0, pool_k, slots, block_v=bv, num_warps=1)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(o.float(), o_ref.float(), **tol)
    torch.testing.assert_close(pool_k, pool, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool_k[untouched], pool[untouched])
print("KDA_STEP_OK")
"""


def test_kernel_under_interpreter_matches_reference():
    assert "KDA_STEP_OK" in interpreted(_CASE)
