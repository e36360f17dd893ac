"""GPU parity of the KDA decode recurrence kernel (`miles_k3.kernels.kda_decode.kda_recurrent_step`) at K3 width
(H = HV = 96 heads, K = V = 128, bf16 activations, fp32 state pool), against its pure-torch reference (run on CPU
copies: plain fp32, no TF32) and against fla's fused_recurrent_kda in the engine's in-place form
(`kda_ops._decode_into_fla`, the decode path before this kernel became the engine default), for every tile config the benchmark tries; plus CUDA-graph
capture and replay.

    python -m pytest -m gpu tests/kernels/test_gpu_kda_recurrent.py

Tolerances: the new state (fp32) within 1e-5 relative + 1e-5 absolute (state entries are O(1); the kernel sums K
in another order and uses the GPU's exp / sigmoid / sqrt approximations, each ~1e-7 relative); o (bf16) within
one bf16 ulp relative (2^-7) + 1e-3 absolute. Pool rows no real row names are bitwise untouched; the padding
rows' shared scratch slot is undefined and not compared. Graph replay is bitwise equal to eager calls.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import gpu_test

from miles_k3.kernels.kda_decode import kda_recurrent_step, kda_recurrent_step_reference

CONFIGS = [(32, 4), (64, 4), (64, 8), (128, 8), (None, None)]  # (block_v, num_warps); None: KDA_STEP_CONFIG


def k3_inputs(b=64, pad=4, h=96, kd=128, vd=128, n=80, seed=0):
    """Real rows on distinct slots, then `pad` padding rows that all name slot n - 1 (the scratch slot)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")
    rows = b + pad
    q, k = r(rows, 1, h, kd).bfloat16(), r(rows, 1, h, kd).bfloat16()
    v, f = r(rows, 1, h, vd).bfloat16(), r(rows, 1, h, kd).bfloat16()
    beta = r(rows, 1, h).bfloat16()
    a_log = torch.rand(h, generator=g, device="cuda").mul(15).add(1).log()  # log U(1, 16), as the model's init
    dt_bias = r(h * kd) * 0.5
    pool = r(n, h, kd, vd)
    slots = torch.cat([torch.randperm(n - 1, generator=g, device="cuda")[:b],
                       torch.full((pad,), n - 1, device="cuda")])
    return q, k, v, f, beta, a_log, dt_bias, pool, slots


def _compare(o, pool, o_ref, pool_ref, slots, b, n):
    torch.testing.assert_close(o[:b].float(), o_ref[:b].float(), rtol=2 ** -7, atol=1e-3)
    keep = torch.ones(n, dtype=torch.bool, device=pool.device)
    keep[n - 1] = False  # the scratch slot of the padding rows: undefined
    torch.testing.assert_close(pool[keep], pool_ref[keep], rtol=1e-5, atol=1e-5)
    untouched = keep.clone()
    untouched[slots] = False
    assert torch.equal(pool[untouched], pool_ref[untouched])


@gpu_test
@pytest.mark.parametrize("block_v,num_warps", CONFIGS)
def test_gpu_kda_step_matches_reference_k3_width(block_v, num_warps):
    q, k, v, f, beta, a_log, dt_bias, pool, slots = k3_inputs()
    cpu = [t.cpu() for t in (q, k, v, f, beta, a_log, dt_bias, pool, slots)]
    o_ref = kda_recurrent_step_reference(*cpu[:7], -5.0, cpu[7], cpu[8])
    o = kda_recurrent_step(q, k, v, f, beta, a_log, dt_bias, -5.0, pool, slots, block_v=block_v,
                           num_warps=num_warps)
    torch.cuda.synchronize()
    _compare(o.cpu(), pool.cpu(), o_ref, cpu[7], cpu[8], 64, pool.shape[0])


@gpu_test
@pytest.mark.parametrize("block_v,num_warps", CONFIGS)
def test_gpu_kda_step_matches_fla_in_place_decode(block_v, num_warps):
    pytest.importorskip("fla")
    from miles_k3.model.kda_ops import _decode_into_fla

    q, k, v, f, beta, a_log, dt_bias, pool, slots = k3_inputs(seed=1)
    pool_fla = pool.clone()
    o_fla = _decode_into_fla(q, k, v, f, beta, a_log, dt_bias, -5.0, pool_fla, slots)
    o = kda_recurrent_step(q, k, v, f, beta, a_log, dt_bias, -5.0, pool, slots, block_v=block_v,
                           num_warps=num_warps)
    _compare(o, pool, o_fla, pool_fla, slots, 64, pool.shape[0])


@gpu_test
def test_gpu_kda_step_cuda_graph_replay_is_bitwise_eager():
    q, k, v, f, beta, a_log, dt_bias, pool, slots = k3_inputs(b=32, pad=0, seed=2)
    pool_eager = pool.clone()
    eager = [kda_recurrent_step(q, k, v, f, beta, a_log, dt_bias, -5.0, pool_eager, slots) for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) on a scratch pool
        kda_recurrent_step(q, k, v, f, beta, a_log, dt_bias, -5.0, pool.clone(), slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_recurrent_step(q, k, v, f, beta, a_log, dt_bias, -5.0, pool, slots)
    for i in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[i])
    assert torch.equal(pool, pool_eager)
