"""CUDA path (fla-core Triton kernels, bf16) against the CPU reference path (torch chunked KDA, fp32).

Run on a GPU: `python -m pytest -m gpu tests`. Errors are relative L2 norms, ||got - ref|| / ||ref||; each test
prints what it measured. Tolerances: fp32 kernel vs fp32 reference 5e-3 (Triton's tl.dot runs fp32 as TF32: ~2e-3 seen);
bf16 kernel inputs vs fp32 reference 2e-2 (bf16 has 8 mantissa bits: ~4e-3 per rounding); every k3_m sublayer in bf16 on CUDA
vs fp32 on CPU, on identical inputs: 3e-2 (the same comparison with the CPU path in bf16 measures <= 1.2e-2).
"""
import pytest
import torch
from parity import layerwise_errors, reference_model, rel
from repo_helpers import REPO

from miles_k3.model.kda_ops import resolve_kda_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fla Triton kernels)")]


def _kda_inputs(b=2, t=300, h=8, k=128, seed=0):  # k3_m's KDA shape: kernels compile once
    g = torch.Generator().manual_seed(seed)
    q, kk, v = (torch.randn(b, t, h, k, generator=g) for _ in range(3))
    gate = -5 * torch.sigmoid(torch.randn(b, t, h, k, generator=g))
    beta = torch.sigmoid(torch.randn(b, t, h, generator=g))
    h0 = torch.randn(b, h, k, k, generator=g) * 0.1
    return q, kk, v, gate, beta, h0


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)], ids=["float32_inputs", "bfloat16_inputs"])
def test_fla_prefill_matches_torch_chunk_forward_and_backward(dtype, tol):
    ref_b, fla_b = resolve_kda_backend("torch_chunk", "cpu"), resolve_kda_backend("fla", "cuda")
    inputs = _kda_inputs()
    ref_in = [x.clone().requires_grad_(True) for x in inputs]
    cuda_in = [(x.to(dtype) if i < 3 else x).cuda().requires_grad_(True) for i, x in enumerate(inputs)]
    o_ref, s_ref = ref_b.prefill(*ref_in[:5], initial_state=ref_in[5], output_final_state=True)
    o, s = fla_b.prefill(*cuda_in[:5], initial_state=cuda_in[5], output_final_state=True)
    errs = {"o": rel(o, o_ref), "state": rel(s, s_ref)}
    weights = [torch.randn_like(o_ref), torch.randn_like(s_ref)]
    ((o_ref * weights[0]).sum() + (s_ref * weights[1]).sum()).backward()
    ((o.float() * weights[0].cuda()).sum() + (s * weights[1].cuda()).sum()).backward()
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), cuda_in, ref_in):
        errs[name] = rel(a.grad, b.grad)
    print(f"fla chunk_kda {dtype} vs torch_chunk fp32:", {k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) < tol, errs


_IEEE_PROBE = """
import json, sys, torch
sys.path[:0] = ['tests', 'tests/model']  # parity, and this module
from miles_k3.utils.runtime import set_fp32_dots
set_fp32_dots('ieee')
import test_gpu_parity as t
from parity import rel
from miles_k3.model.kda_ops import resolve_kda_backend
ref = resolve_kda_backend('torch_chunk', 'cpu')
x = t._kda_inputs()
xb = [y.bfloat16().float() if i in (0, 1, 2, 4) else y for i, y in enumerate(x)]  # what bf16 activations hold
out = {}
for name, inputs, cast in (('fla_fp32in', x, None), ('fla_fp32', xb, torch.bfloat16)):
    o_ref, s_ref = ref.prefill(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    dev = [y.cuda() if cast is None or i == 3 else y.cuda().to(cast) for i, y in enumerate(inputs[:5])]
    b = resolve_kda_backend('fla' if name == 'fla_fp32in' else name, 'cuda')
    o, s = b.prefill(*dev, initial_state=inputs[5].cuda(), output_final_state=True)
    out[name] = {'o': rel(o, o_ref), 'state': rel(s, s_ref)}
print(json.dumps(out))
"""


def test_fp32_dots_ieee_and_fla_fp32_bring_the_chunked_form_to_fp32_accuracy():
    """model.fp32_dots=ieee (TRITON_F32_DEFAULT, process-wide: a fresh process) compiles fla's fp32 dots as plain
    fp32 products: fp32 inputs land far inside the TF32 tolerance above (5e-3). With bf16 activations, fla_fp32
    (fla on the fp32 values of the bf16 inputs) matches the fp32 torch form on the same values up to the one bf16
    rounding of its output; its final state, never rounded, to fp32 accuracy."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_F32_DEFAULT"}
    out = subprocess.run([sys.executable, "-c", _IEEE_PROBE], check=False, capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    errs = json.loads(out.stdout.strip().splitlines()[-1])
    print("fla chunk_kda with fp32_dots=ieee vs torch_chunk fp32:", errs)
    assert max(errs["fla_fp32in"].values()) < 1e-4, errs
    assert errs["fla_fp32"]["state"] < 1e-4 and errs["fla_fp32"]["o"] < 3e-3, errs


def test_fla_decode_matches_torch_decode():
    ref_b, fla_b = resolve_kda_backend("torch_chunk", "cpu"), resolve_kda_backend("fla", "cuda")
    q, k, v, g, beta, h0 = _kda_inputs(b=64, t=1)
    o_ref, s_ref = ref_b.decode(q, k, v, g, beta, h0)
    o, s = fla_b.decode(*(x.cuda() for x in (q, k, v, g, beta, h0)))
    errs = {"o": rel(o, o_ref), "state": rel(s, s_ref)}
    print("fla fused_recurrent_kda fp32 vs torch decode:", errs)
    assert max(errs.values()) < 1e-5, errs  # the same fp32 recurrence, no matmul rounding


def test_fla_in_place_pool_decode_matches_the_gathered_reference():
    """The engine's decode: fla reads and writes rows slots[b] of a state pool in place (ssm_state_indices) and
    computes the lower-bound gate and sigmoid(beta) from the raw projections inside its kernel. Against the
    reference (fla's naive gate in torch, torch decode of the gathered rows): outputs and updated rows agree,
    rows no request owns are left bit for bit, padding rows that share one scratch slot disturb nothing else."""
    ref_b, fla_b = resolve_kda_backend("torch_chunk", "cpu"), resolve_kda_backend("fla", "cuda")
    gen = torch.Generator().manual_seed(2)
    q, k, v, _, _, _ = _kda_inputs(b=64, t=1)
    q, k, v = torch.cat([q, k, v], dim=-1).cuda().chunk(3, dim=-1)  # strided views, as the model passes them
    f = torch.randn(64, 1, 8, 128, generator=gen).to(torch.bfloat16)  # f_b_proj output (activation dtype)
    beta_logit = torch.randn(64, 1, 8, generator=gen).to(torch.bfloat16)  # b_proj output
    a_log, dt_bias = torch.rand(8, generator=gen).add(1).log(), torch.randn(8 * 128, generator=gen) * 0.1
    pool = torch.randn(100, 8, 128, 128, generator=gen) * 0.1
    slots = torch.randperm(99, generator=gen)[:61]
    slots = torch.cat([slots, torch.full((3,), 99)])  # 3 padding rows on scratch slot 99
    ref_pool = pool.clone()
    o_ref = ref_b.decode_into(q.cpu(), k.cpu(), v.cpu(), f, beta_logit, a_log, dt_bias, -5.0, ref_pool, slots)
    pool_cuda = pool.cuda()
    o = fla_b.decode_into(q, k, v, f.cuda(), beta_logit.cuda(), a_log.cuda(), dt_bias.cuda(), -5.0, pool_cuda,
                          slots.cuda())
    got = pool_cuda.cpu()
    errs = {"o": rel(o[:61], o_ref[:61]), "state": rel(got[slots[:61]], ref_pool[slots[:61]])}
    print("fla in-place pool decode (in-kernel gate) vs torch reference of gathered rows:", errs)
    assert max(errs.values()) < 1e-5, errs
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got[untouched], pool[untouched])


def test_fla_prefill_pads_the_batch_to_a_bucket_and_tunes_each_bucket_once():
    """fla compiles and tunes chunk_kda's cumsums per batch size (a tl.constexpr there), new Triton cache entries
    each time (the premise of `fla_batch_bucket`: a bare chunk_kda call with a batch size it has not seen adds
    entries). Through the
    backend, 9 and then 13 rows both run as 16: the second call adds none, and its rows equal the bare call's on
    the same 13 rows (the padding reaches nothing)."""
    from fla.ops.kda import chunk_kda

    from miles_k3.utils.runtime import triton_cache_dirs

    fla_b = resolve_kda_backend("fla", "cuda")
    q, k, v, g, beta, h0 = (x.cuda() for x in _kda_inputs(b=13, t=96, seed=5))
    fla_b.prefill(q[:9], k[:9], v[:9], g[:9], beta[:9], initial_state=h0[:9], output_final_state=True)
    before = triton_cache_dirs()
    assert before is not None, "the Triton cache directory is not readable"
    o, s = fla_b.prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    assert set(triton_cache_dirs()) == set(before), "13 rows tuned kernels again after 9 (both bucket 16)"
    o_bare, s_bare = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    torch.cuda.synchronize()
    added = set(triton_cache_dirs()) - set(before)
    print(f"bare chunk_kda at 13 rows added {len(added)} Triton cache entries")
    assert added, "a bare call with a new batch size added nothing: fla no longer tunes per batch size"
    errs = {"o": rel(o, o_bare), "state": rel(s, s_bare)}
    print("fla prefill padded to 16 rows vs bare chunk_kda on 13:", errs)
    assert max(errs.values()) < 1e-4, errs  # the two may tune different cumsum blocks: fp32 order, not padding


def test_k3m_layerwise_cuda_bf16_matches_cpu_fp32_reference():
    """Every sublayer of k3_m on CUDA (fla kernels, bf16) against the fp32 CPU reference, on identical inputs:
    forward, input and weight gradients, and a decode step (see tests/parity.py for why layer-wise)."""
    ref = reference_model("k3_m")
    ids = torch.randint(0, ref.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    errs = layerwise_errors(ref, "cuda", torch.bfloat16, "fla", ids)
    print("k3_m layer-wise cuda bf16 (fla) vs cpu fp32 (torch_chunk):", {k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) < 3e-2, errs
