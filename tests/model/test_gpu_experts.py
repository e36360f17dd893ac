"""Routed experts on CUDA: the torch._grouped_mm path against the CPU per-expert reference, MXFP4 storage
against its dequantized bf16 reference (bitwise on the torch backend: dequantize + grouped_mm; the fused triton
backend is checked within accumulation tolerance in tests/kernels/test_gpu_mxfp4_moe.py), and the peak memory of a frozen MXFP4 experts layer's
forward+backward against the bf16 bytes of the same weights. Run with `python -m pytest -m gpu tests`."""
import pytest
import torch

from miles_k3.model.experts import PROJS, RoutedExperts, grouped_linear, mxfp4_experts_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _routing(n_tok, num_experts, top_k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n_tok, num_experts, generator=g)
    scores[:, 5] = -1  # expert 5 never chosen: an empty group
    ids = scores.topk(top_k, dim=-1).indices
    w = torch.rand(n_tok, top_k, generator=g)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def test_grouped_mm_matches_cpu_reference_forward_and_backward():
    torch.manual_seed(0)
    counts = [37, 0, 128, 5, 64, 0, 1, 300]
    x = torch.randn(sum(counts), 256)
    w = torch.randn(8, 384, 256) * 0.05
    xc, wc = (t.cuda().bfloat16().requires_grad_() for t in (x, w))
    xr, wr = (t.clone().requires_grad_() for t in (x, w))
    y, y_ref = grouped_linear(xc, counts, wc), grouped_linear(xr, counts, wr)
    g = torch.randn_like(y_ref)
    y.float().mul(g.cuda()).sum().backward()
    (y_ref * g).sum().backward()
    errs = {name: ((a.float().cpu() - b).norm() / b.norm()).item()
            for name, a, b in (("y", y, y_ref), ("dx", xc.grad, xr.grad), ("dw", wc.grad, wr.grad))}
    print("grouped_mm bf16 vs CPU fp32:", errs)
    assert max(errs.values()) < 1e-2, errs  # bf16 inputs: ~3e-3 per rounding


def test_mxfp4_experts_equal_dequantized_bf16_on_cuda():
    torch.manual_seed(0)
    with torch.device("cuda"):
        q = RoutedExperts(16, 256, 128, 4.0, 25.0, expert_format="mxfp4")
        q.reset_parameters(std=0.05)
        ref = RoutedExperts(16, 256, 128, 4.0, 25.0, expert_format="bf16").bfloat16().requires_grad_(False)
    with torch.no_grad():
        for n in PROJS:
            getattr(ref, n).copy_(q.dequantized(n))
    ids, w = _routing(512, 16, 4, "cuda")
    z = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    zq, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    with mxfp4_experts_backend("torch"):
        out_q, out_r = q(zq, ids, w), ref(zr, ids, w)
        assert torch.equal(out_q, out_r)
        grad = torch.randn_like(out_q)
        out_q.backward(grad)
        out_r.backward(grad)
    assert torch.equal(zq.grad, zr.grad)


def _peak_fwd_bwd(fmt, num_experts, latent, inter, ids, w):
    """Peak allocated bytes during one forward+backward, storage included, above what was allocated before."""
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        m = RoutedExperts(num_experts, latent, inter, 4.0, 25.0, expert_format=fmt)
        m.reset_parameters(std=0.02)
        m.bfloat16().requires_grad_(False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # the peak from here on: storage (still allocated) + fwd/bwd transients
    z = torch.randn(ids.shape[0], latent, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m(z, ids, w).float().square().sum().backward()
    torch.cuda.synchronize()
    stored = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    return torch.cuda.max_memory_allocated() - base, stored


def test_mxfp4_experts_peak_memory_well_below_bf16_weight_bytes():
    """A K3-layer-like experts block (256 experts of 1024 x 1024, top-4, 512 tokens: weights dominate, as in
    a real K3 layer): peak allocated memory of forward+backward, storage included, against the bf16 bytes of
    the same weights, and against the same block with bf16 experts."""
    num_experts, latent, inter = 256, 1024, 1024
    bf16_weight_bytes = num_experts * 3 * latent * inter * 2
    ids, w = _routing(512, num_experts, 4, "cuda")
    peak_q, stored_q = _peak_fwd_bwd("mxfp4", num_experts, latent, inter, ids, w)
    peak_b, stored_b = _peak_fwd_bwd("bf16", num_experts, latent, inter, ids, w)
    assert stored_b == bf16_weight_bytes and stored_q * 64 == bf16_weight_bytes * 17  # 4.25 bits vs 16
    ratio = peak_q / bf16_weight_bytes
    print(f"experts fwd+bwd peak: mxfp4 {peak_q / 2**20:.0f} MiB (storage {stored_q / 2**20:.0f} MiB), "
          f"bf16 {peak_b / 2**20:.0f} MiB (weights {bf16_weight_bytes / 2**20:.0f} MiB); "
          f"mxfp4 peak / bf16 weight bytes {ratio:.3f}, mxfp4 peak / bf16 peak {peak_q / peak_b:.3f}")
    assert ratio < 0.5, ratio


def test_expert_lora_on_cuda_mxfp4_equals_bf16_base_and_matches_cpu():
    """Per-expert LoRA (rank 16: the grouped_mm path) over MXFP4 experts on CUDA: bitwise equal to the same
    adapters over the dequantized bf16 experts, and close to the fp32 CPU reference (output and grads)."""
    from miles_k3.model.lora import LoRAConfig, _expert_lora

    torch.manual_seed(0)
    cfg = LoRAConfig(rank=16, alpha=32.0, targets=["w1", "w2", "w3"])
    with torch.device("cuda"):
        q = RoutedExperts(16, 256, 128, 4.0, 25.0, expert_format="mxfp4")
        q.reset_parameters(std=0.05)
        ref = RoutedExperts(16, 256, 128, 4.0, 25.0, expert_format="bf16").bfloat16().requires_grad_(False)
    with torch.no_grad():
        for n in PROJS:
            getattr(ref, n).copy_(q.dequantized(n))
    q.lora = torch.nn.ModuleDict({n: _expert_lora(q, n, cfg) for n in PROJS})
    with torch.no_grad():
        for m in q.lora.values():
            m.lora_B.normal_(0, 0.05)
    ref.lora = torch.nn.ModuleDict({n: _expert_lora(ref, n, cfg) for n in PROJS})
    ref.lora.load_state_dict(q.lora.state_dict())
    cpu = RoutedExperts(16, 256, 128, 4.0, 25.0, expert_format="bf16").requires_grad_(False)
    cpu.load_state_dict({k: v.float().cpu() for k, v in ref.state_dict().items()}, strict=False)
    cpu.lora = torch.nn.ModuleDict({n: _expert_lora(cpu, n, cfg) for n in PROJS})
    cpu.lora.load_state_dict({k: v.cpu() for k, v in q.lora.state_dict().items()})
    ids, w = _routing(256, 16, 4, "cuda")
    z = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    outs = {}
    with mxfp4_experts_backend("torch"):  # the bitwise mxfp4 == bf16 claim is the dequantizing path's
        for name, mod, zz, ii, ww, gg in (("mxfp4", q, z, ids, w, grad), ("bf16", ref, z, ids, w, grad),
                                           ("cpu", cpu, z.float().cpu(), ids.cpu(), w.cpu(), grad.float().cpu())):
            zz = zz.clone().requires_grad_()
            out = mod(zz, ii, ww)
            out.backward(gg)
            outs[name] = (out, zz.grad, [p.grad for p in mod.lora.parameters()])
    assert torch.equal(outs["mxfp4"][0], outs["bf16"][0]) and torch.equal(outs["mxfp4"][1], outs["bf16"][1])
    assert all(torch.equal(a, b) for a, b in zip(outs["mxfp4"][2], outs["bf16"][2]))

    def rel(a, b):
        return ((a.float().cpu() - b).norm() / b.norm()).item()

    errs = {"out": rel(outs["mxfp4"][0], outs["cpu"][0]), "dz": rel(outs["mxfp4"][1], outs["cpu"][1]),
            "dlora": max(rel(a, b) for a, b in zip(outs["mxfp4"][2], outs["cpu"][2]))}
    print("expert LoRA cuda bf16 vs cpu fp32:", errs)
    assert max(errs.values()) < 3e-2, errs  # bf16 activations through three matmul levels


def test_grouped_mm_with_unaligned_widths_is_one_capturable_kernel():
    """A LoRA rank of 2 on the experts gives widths that are not 16-byte aligned (O = 2; I = 20): the CUDA path pads
    them and stays torch._grouped_mm on device offsets, so a CUDA graph captures it (before, it fell back to a host
    list, which capture refuses) and its replay on new inputs matches the CPU per-expert reference; gradients too."""
    torch.manual_seed(0)
    counts = [3, 0, 5, 1]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    for o, i in ((2, 128), (24, 20), (3, 13)):
        w = torch.randn(4, o, i) * 0.1
        x0, x1 = torch.randn(sum(counts), i), torch.randn(sum(counts), i)
        wc, xc = w.cuda().bfloat16(), x0.cuda().bfloat16()
        grouped_linear(xc, ends, wc)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = grouped_linear(xc, ends, wc)
        xc.copy_(x1.bfloat16())
        graph.replay()
        ref = grouped_linear(x1.bfloat16().float(), counts, w.bfloat16().float())
        assert y.shape == (sum(counts), o)
        torch.testing.assert_close(y.float().cpu(), ref, atol=2e-2, rtol=2e-2)
        xg, wg = (t.cuda().bfloat16().requires_grad_() for t in (x1, w))
        xr, wr = (t.bfloat16().float().requires_grad_() for t in (x1, w))
        grouped_linear(xg, counts, wg).float().sum().backward()
        grouped_linear(xr, counts, wr).sum().backward()
        torch.testing.assert_close(xg.grad.float().cpu(), xr.grad, atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(wg.grad.float().cpu(), wr.grad, atol=5e-2, rtol=2e-2)


def test_bf16_experts_keep_row_counts_on_the_device_and_equal_the_host_list_path(monkeypatch):
    """A training forward of bf16 experts on CUDA (64 experts, one never routed to) groups its rows without a host
    sync: the cumulative row ends stay on the device (`RoutedExperts.device_row_ends`) and torch._grouped_mm reads
    them there. The offsets are the numbers the host list gives, so the output and every gradient (input and the
    three stacked weights) are bitwise those of the host-list path (`bincount(...).tolist()`, switched back on)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = RoutedExperts(64, 512, 256, 4.0, 25.0, expert_format="bf16")
        m.reset_parameters(std=0.05)
        m.bfloat16().requires_grad_(True)
    ids, w = _routing(1024, 64, 4, "cuda")
    z = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    assert m.device_row_ends(z) and not m.device_row_ends(z.float()) and not m.device_row_ends(z.cpu())

    def run():
        zz = z.clone().requires_grad_()
        out = m(zz, ids, w)
        out.backward(grad)
        grads = [zz.grad] + [getattr(m, n).grad.clone() for n in PROJS]
        m.zero_grad(set_to_none=True)
        return out, grads

    with monkeypatch.context() as patch:
        patch.setattr(RoutedExperts, "device_row_ends", lambda self, z_ND: False)
        host_out, host_grads = run()  # also compiles the SiTU-GLU kernel, whose autotuning synchronises
    zz = z.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync (.tolist(), .item()) in the forward raises
    try:
        out = m(zz, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, host_out)
    dev_out, dev_grads = run()
    assert torch.equal(dev_out, host_out)
    for name, a, b in zip(("z", *PROJS), dev_grads, host_grads):
        assert torch.equal(a, b), name
