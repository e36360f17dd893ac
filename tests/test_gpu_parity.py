"""CUDA path (fla-core Triton kernels, bf16) against the CPU reference path (torch chunked KDA, fp32).

Run on a GPU: `python -m pytest -m gpu tests`. Errors are relative L2 norms, ||got - ref|| / ||ref||; each test
prints what it measured. Tolerances: fp32 kernel vs fp32 reference 5e-3 (Triton's tl.dot runs fp32 as TF32: ~2e-3 seen);
bf16 kernel inputs vs fp32 reference 2e-2 (bf16 has 8 mantissa bits: ~4e-3 per rounding); the whole k3_m in bf16
vs fp32: 5e-2 on logits and 1.5e-1 on weight gradients (17 layers of bf16 activations and rare top-k flips).
"""
import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.kda_ops import resolve_kda_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fla Triton kernels)")]


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _kda_inputs(b=2, t=300, h=8, k=128, seed=0):  # k3_m's KDA shape: kernels compile once
    g = torch.Generator().manual_seed(seed)
    q, kk, v = (torch.randn(b, t, h, k, generator=g) for _ in range(3))
    gate = -5 * torch.sigmoid(torch.randn(b, t, h, k, generator=g))
    beta = torch.sigmoid(torch.randn(b, t, h, generator=g))
    h0 = torch.randn(b, h, k, k, generator=g) * 0.1
    return q, kk, v, gate, beta, h0


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
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


def test_fla_decode_matches_torch_decode():
    ref_b, fla_b = resolve_kda_backend("torch_chunk", "cpu"), resolve_kda_backend("fla", "cuda")
    q, k, v, g, beta, h0 = _kda_inputs(b=64, t=1)
    o_ref, s_ref = ref_b.decode(q, k, v, g, beta, h0)
    o, s = fla_b.decode(*(x.cuda() for x in (q, k, v, g, beta, h0)))
    errs = {"o": rel(o, o_ref), "state": rel(s, s_ref)}
    print("fla fused_recurrent_kda fp32 vs torch decode:", errs)
    assert max(errs.values()) < 1e-5, errs  # the same fp32 recurrence, no matmul rounding


def _k3m_pair():
    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_m")
    ref = K3ForCausalLM(cfg, kda_backend="torch_chunk")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.02)
    gpu = K3ForCausalLM(cfg, kda_backend="fla").cuda().cast(torch.bfloat16)
    gpu.load_state_dict(ref.state_dict())
    return ref, gpu


def test_k3m_model_cuda_bf16_matches_cpu_fp32_forward_and_backward():
    ref, gpu = _k3m_pair()
    ids = torch.randint(0, ref.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(1))
    names = ["model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.A_log",
             "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.5.block_sparse_moe.shared_experts.up_proj.weight",
             "model.layers.16.self_attention_res_proj.weight", "lm_head.weight"]
    grads, logits = {}, {}
    for label, model, x in (("ref", ref, ids), ("gpu", gpu, ids.cuda())):
        out = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        params = dict(model.named_parameters())
        grads[label] = {n: params[n].grad.float().cpu() for n in names}
        logits[label] = out.detach().cpu()
    errs = {"logits": rel(logits["gpu"], logits["ref"])}
    errs.update({n.removeprefix("model."): rel(grads["gpu"][n], grads["ref"][n]) for n in names})
    print("k3_m cuda bf16 (fla) vs cpu fp32 (torch_chunk):", {k: f"{v:.1e}" for k, v in errs.items()})
    assert errs.pop("logits") < 5e-2
    assert max(errs.values()) < 1.5e-1, errs


@torch.no_grad()
def test_k3m_cuda_decode_matches_full_forward():
    _, gpu = _k3m_pair()
    ids = torch.randint(0, gpu.config.vocab_size, (4, 96), generator=torch.Generator().manual_seed(2)).cuda()
    full = gpu(ids).logits.float()
    out = gpu(ids[:, :64], return_state=True)
    errs = []
    for t in range(64, 96):
        out = gpu.step(ids[:, t], out.state)
        errs.append(rel(out.logits.float(), full[:, t]))
    print(f"k3_m cuda bf16 decode vs full forward: max rel err {max(errs):.1e}")
    assert max(errs) < 3e-2
