"""Paged absorbed-MLA decode attention (`miles_k3.kernels.paged_mla`): the reference against the model's own
absorbed attention over gathered latents, the Triton kernel against the reference (on CPU through the Triton
interpreter, in a subprocess because the interpreter is chosen at import; on the H200 in bf16 at k3_m shapes),
and the model's paged decode step against its contiguous one.

Tolerances: fp32 kernel vs fp32 reference 1e-5 (same math, other summation order); fp16 inputs 2e-3 (the
softmax weights are rounded to fp16 before the value product, as in the kernel's tl.dot); bf16 on the GPU 2e-2
relative L2 (8 mantissa bits: the model's own bf16 path differs by as much). The interpreter does not run bf16
dots correctly (it handles fp32 and fp16), so bf16 is checked on the GPU only.
"""
import textwrap

import pytest
import torch
from kernel_testing import interpreted

from miles_k3.kernels.paged_mla import paged_latent_attention, paged_latent_attention_reference
from miles_k3.model import K3Config
from miles_k3.model.mla import MLAAttention
from miles_k3.model.state import MLALayerState


def _case(b=3, h=4, r=32, p=8, z=4, g=20, t=5, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(g, z, r + p, generator=gen).to(dtype)
    table = torch.stack([torch.randperm(g, generator=gen)[:t] for _ in range(b)])
    q_lat, q_rope = torch.randn(b, h, r, generator=gen).to(dtype), torch.randn(b, h, p, generator=gen).to(dtype)
    return q_lat, q_rope, storage, table


def test_reference_equals_the_models_absorbed_attention_over_gathered_latents():
    torch.manual_seed(0)
    mla = MLAAttention(K3Config.from_name("k3_tiny"))
    _, q_rope, storage, table = _case(h=mla.num_heads, r=mla.rank, p=mla.rope)
    q_nope = torch.randn(3, mla.num_heads, mla.nope)
    lens = torch.tensor([1, 9, 20])  # one position; across a page boundary; the whole table
    latent_BSL = storage[table].flatten(1, 2)
    valid_BS = torch.arange(latent_BSL.shape[1]) < lens[:, None]
    w_uk, w_uv = mla._absorbed_weights()
    with torch.no_grad():
        want_o = mla.absorbed_attention(q_nope, q_rope, latent_BSL, valid_BS)
        got = paged_latent_attention_reference(torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_rope, storage, table,
                                               lens, mla.scale)
        torch.testing.assert_close(torch.einsum("bhr,hvr->bhv", got, w_uv), want_o, rtol=1e-4, atol=1e-5)


_INTERPRETED = textwrap.dedent("""
    import torch
    from miles_k3.kernels.paged_mla import _launch, paged_latent_attention_reference
    from test_paged_mla import _case
    worst = {}
    for dtype in (torch.float32, torch.float16):
        for b, h, r, p, z, t, lens in ((3, 4, 32, 8, 4, 5, [1, 9, 20]), (2, 20, 64, 16, 16, 3, [48, 17])):
            q_lat, q_rope, storage, table = _case(b, h, r, p, z, 40, t, dtype)
            lens = torch.tensor(lens)
            ref = paged_latent_attention_reference(q_lat, q_rope, storage, table, lens, 0.3)
            for splits in (1, 2, 3):
                got = _launch(q_lat, q_rope, storage, table, lens, 0.3, splits)
                assert got.dtype == dtype and got.shape == ref.shape
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
    print(worst)
    assert worst["torch.float32"] < 1e-5 and worst["torch.float16"] < 2e-3, worst
""")


@pytest.mark.slow
def test_kernel_matches_the_reference_under_the_triton_interpreter():
    """fp32 and fp16; heads fewer than and more than one 16-head block; 1, 2 and 3 position splits (one split
    empty when a request is short); pages in random order; lengths 1, across pages, and the full table."""
    interpreted(_INTERPRETED, timeout=300)  # the script asserts its own tolerances


def test_paged_decode_step_equals_the_contiguous_step():
    """MLAAttention.step over a paged pool (new latent written in place into its page) gives the output and the
    latents of the step over the same latents held contiguously."""
    torch.manual_seed(1)
    cfg = K3Config.from_name("k3_tiny")
    mla = MLAAttention(cfg).eval()
    z, width = 4, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    pool = torch.randn(12, z, width)
    table = torch.tensor([[3, 7, 1], [10, 0, 5]])
    past = torch.tensor([6, 9])  # the new token goes to page slot 2 of page 7, and slot 1 of page 5
    x = torch.randn(2, 1, cfg.hidden_size)
    contiguous = MLALayerState(pool[table].flatten(1, 2).clone())
    with torch.no_grad():
        want, want_state = mla.step(x, contiguous, past)
        got, got_state = mla.step(x, MLALayerState(pool, table), past)
    assert got_state.latent_BSL is pool
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[table].flatten(1, 2)[[0, 1], past], want_state.latent_BSL[[0, 1], past])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("b, h, r, p, z, t, splits", [(256, 8, 512, 64, 64, 17, None), (4, 8, 512, 64, 64, 64, None),
                                                     (4, 8, 512, 64, 64, 64, 1), (4, 4, 32, 8, 16, 4, None)],
                         ids=["k3m_b256", "k3m_long", "k3m_long_1split", "k3tiny"])
def test_gpu_kernel_matches_the_reference_in_bf16(b, h, r, p, z, t, splits):
    """k3_m (8 heads, R 512, P 64, pages of 64) and k3_tiny (4 heads, R 32, P 8: padded to the 16-wide dot)
    shapes; random lengths up to the whole table."""
    q_lat, q_rope, storage, table = (x.cuda() for x in _case(b, h, r, p, z, 4096, t, torch.bfloat16))
    lens = torch.randint(1, t * z + 1, (b,), generator=torch.Generator().manual_seed(1)).cuda()
    ref = paged_latent_attention_reference(q_lat, q_rope, storage, table, lens, 0.07)
    got = paged_latent_attention(q_lat, q_rope, storage, table, lens, 0.07, num_splits=splits)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    print(f"paged MLA kernel bf16 vs fp32 reference, B={b} H={h} R={r} T={t} splits={splits}: rel L2 {err:.1e}")
    assert got.dtype == torch.bfloat16 and err < 2e-2
