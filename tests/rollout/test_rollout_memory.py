"""The rollout state pools on k3_tiny (fp32, CPU): model equivalence, fork/copy-on-write, exhaustion, sizing."""
import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.kda import KDAAttention
from miles_k3.model.mla import MLAAttention
from miles_k3.model.state import KDALayerState
from miles_k3.rollout.memory import (
    KDAStatePool,
    PagedLatentCache,
    page_bytes,
    plan_memory,
    pooled_state,
    slot_bytes,
    store_state,
)

CFG = K3Config.from_name("k3_tiny")
F32 = torch.float32


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = K3ForCausalLM(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)  # non-uniform AttnRes mixing, as in test_model.py
    return model.eval().requires_grad_(False)


def _pools(num_slots=4, num_pages=16, page_size=4):
    return KDAStatePool(CFG, num_slots, "cpu", F32), PagedLatentCache(CFG, num_pages, page_size, "cpu", F32)


def _assert_pools_hold(state, kda, slots, cache, rids):
    """The pools' contents equal a contiguous model state (latents compared at valid positions only)."""
    pooled = pooled_state(CFG, kda, slots, cache, rids)
    assert pooled.seq_lens.tolist() == state.seq_lens.tolist()
    for i, (got, want) in enumerate(zip(pooled.layers, state.layers)):
        if CFG.is_mla_layer(i):
            for b, n in enumerate(state.seq_lens.tolist()):
                assert torch.equal(got.latent_BSL[b, :n], want.latent_BSL[b, :n])
        else:
            assert torch.equal(got.conv_BCW, want.conv_BCW) and torch.equal(got.recurrent_BHKV, want.recurrent_BHKV)


def test_decode_from_pools_equals_decode_from_contiguous_state(tiny):
    lens = [7, 3, 5]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (3, 7), generator=g)
    ref = tiny(ids, seq_lens=torch.tensor(lens), return_state=True).state
    kda, cache = _pools()
    taken = [kda.alloc() for _ in range(4)]
    kda.free(taken[1])
    slots = torch.tensor([taken[3], taken[0], taken[2]])  # non-contiguous, out of order
    rids = ["a", "b", "c"]
    for r in rids:
        cache.new_request(r)
        assert cache.reserve(r, 1)  # interleaved pages: no request's table is contiguous
    assert store_state(CFG, ref, kda, slots, cache, rids)
    assert [cache.seq_len(r) for r in rids] == lens
    _assert_pools_hold(ref, kda, slots, cache, rids)
    for _ in range(5):
        tok = torch.randint(0, CFG.vocab_size, (3,), generator=g)
        want = tiny.step(tok, ref)
        got = tiny.step(tok, pooled_state(CFG, kda, slots, cache, rids))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
        assert store_state(CFG, got.state, kda, slots, cache, rids)
        ref = want.state
        # the pooled step is the same computation on the same values, so the pools match the model exactly
        _assert_pools_hold(ref, kda, slots, cache, rids)
    assert [cache.seq_len(r) for r in rids] == [n + 5 for n in lens]


def _fill(cache, kda, rid, n, seed=1):
    """A request of n tokens with random latents in every MLA layer and a random KDA slot."""
    g = torch.Generator().manual_seed(seed)
    cache.new_request(rid)
    assert cache.reserve(rid, n)
    for m in range(len(CFG.mla_layer_ids)):
        cache.write(m, [rid], [0], torch.randn(1, n, cache.storage_MGZL.shape[-1], generator=g))
    cache.advance(rid, n)
    slot = kda.alloc()
    states = [KDALayerState(torch.randn(1, *c.shape[1:], generator=g), torch.randn(1, *r.shape[1:], generator=g))
              for c, r in zip(kda.conv_NCW, kda.recurrent_NHKV)]
    kda.write(torch.tensor([slot]), states)
    return slot


def _latents(cache, rid):
    return [cache.gather(m, [rid])[0][0].clone() for m in range(len(CFG.mla_layer_ids))]


def test_fork_shares_full_pages_and_copies_on_write():
    kda, cache = _pools(num_slots=5, num_pages=12, page_size=4)
    src = _fill(cache, kda, "p", 10)  # pages: 2 full + 1 partial (2 of 4 tokens)
    source = _latents(cache, "p")
    free_before = cache.num_free_pages
    assert cache.fork("p", ["c1", "c2", "c3"])
    assert cache.num_free_pages == free_before - 3  # only the partial page is copied, once per child
    full = cache.page_table("p")[:2]
    assert all(cache.refcount(p) == 4 for p in full)
    for c in ("c1", "c2", "c3"):
        assert cache.page_table(c)[:2] == full and cache.page_table(c)[2] != cache.page_table("p")[2]
        assert cache.seq_len(c) == 10
        assert all(torch.equal(a, b) for a, b in zip(_latents(cache, c), source))
    children = kda.fork(src, 3)
    for child in children:
        for a, b in zip(kda.read(torch.tensor([child])), kda.read(torch.tensor([src]))):
            assert torch.equal(a.conv_BCW, b.conv_BCW) and torch.equal(a.recurrent_BHKV, b.recurrent_BHKV)

    # c1 appends at its next position (its private partial page); c2 overwrites a shared full page (CoW)
    assert cache.reserve("c1", 1)
    cache.write(0, ["c1"], [10], torch.full((1, 1, source[0].shape[-1]), 7.0))
    cache.advance("c1", 1)
    cache.write(1, ["c2"], [1], torch.full((1, 1, source[0].shape[-1]), 9.0))
    assert cache.page_table("c2")[0] != full[0] and cache.refcount(full[0]) == 3
    assert (cache.gather(0, ["c1"])[0][0, 10] == 7).all() and (cache.gather(1, ["c2"])[0][0, 1] == 9).all()
    for rid in ("p", "c3"):
        assert all(torch.equal(a, b) for a, b in zip(_latents(cache, rid), source))
    assert torch.equal(_latents(cache, "c1")[0][:10], source[0])
    kda.reset(torch.tensor([children[0]]))
    assert kda.read(torch.tensor([src]))[0].recurrent_BHKV.abs().sum() > 0  # the source's slot is its own

    cache.free("p")
    kda.free(src)
    assert all(torch.equal(a, b) for a, b in zip(_latents(cache, "c3"), source))
    assert cache.refcount(full[1]) == 3
    for c in ("c1", "c2", "c3"):
        cache.free(c)
    assert cache.num_free_pages == cache.num_pages and all(cache.refcount(p) == 0 for p in range(12))


def test_exhaustion_is_all_or_nothing():
    kda, cache = _pools(num_slots=2, num_pages=3, page_size=4)
    s0, s1 = kda.alloc(), kda.alloc()
    assert kda.alloc() is None and kda.fork(s0, 1) is None and kda.num_free == 0
    kda.free(s1)
    assert kda.fork(s0, 2) is None and kda.num_free == 1
    with pytest.raises(ValueError, match="not allocated"):
        kda.free(s1)
    with pytest.raises(ValueError, match="not allocated"):
        kda.free(7)

    cache.new_request("a")
    assert not cache.reserve("a", 13) and cache.num_free_pages == 3 and cache.page_table("a") == []
    assert cache.reserve("a", 6) and cache.num_free_pages == 1
    cache.advance("a", 6)
    cache.new_request("b")
    assert cache.reserve("b", 4) and not cache.reserve("b", 5) and cache.page_table("b") != []
    assert not cache.fork("a", ["x"]) and cache.num_free_pages == 0  # needs a page for the partial copy
    with pytest.raises(ValueError, match="unknown request"):
        cache.seq_len("x")
    cache.advance("b", 4)
    assert cache.fork("b", ["y"]) and cache.page_table("y") == cache.page_table("b")  # all full: no copy
    with pytest.raises(ValueError, match="reserved capacity"):
        cache.advance("a", 3)


def test_plan_memory_k3_and_tiny():
    k3 = K3Config.from_name("k3")
    with torch.device("meta"):
        kda_layer, mla_layer = KDAAttention(k3), MLAAttention(k3)
    recurrent = 69 * kda_layer.state_bytes_per_request()
    assert recurrent == 69 * 96 * 128 * 128 * 4 == 434_110_464
    conv = 69 * 3 * 96 * 128 * 3 * 2  # C x (W-1) bf16 per KDA layer
    assert slot_bytes(k3, torch.bfloat16) == recurrent + conv
    assert page_bytes(k3, 1, torch.bfloat16) == 24 * mla_layer.cache_bytes_per_token() == 27_648
    plan = plan_memory(k3, 100 * 2**30, page_size=64, max_context=32_768)
    per_request = recurrent + conv + 512 * 64 * 27_648
    assert plan.pages_per_request == 512 and plan.num_slots == 100 * 2**30 // per_request == 79
    assert plan.num_pages == 79 * 512 and plan.total_bytes == 79 * per_request <= 100 * 2**30
    assert plan.summary()["mem/num_slots"] == 79

    tiny = plan_memory(CFG, 1_000_000, page_size=16, max_context=100, dtype=F32)
    assert tiny.bytes_per_slot == 6 * (4 * 32 * 32 * 4 + 3 * 128 * 3 * 4)
    assert tiny.bytes_per_page == 3 * 16 * 40 * 4 and tiny.pages_per_request == 7
    kda = KDAStatePool(CFG, tiny.num_slots, "cpu", F32)
    cache = PagedLatentCache(CFG, tiny.num_pages, 16, "cpu", F32)
    allocated = sum(t.nbytes for t in [*kda.conv_NCW, *kda.recurrent_NHKV, cache.storage_MGZL])
    assert allocated == tiny.total_bytes <= 1_000_000 < tiny.total_bytes + tiny.bytes_per_slot + 7 * 7680
    with pytest.raises(ValueError, match="raise the budget or lower max_context"):
        plan_memory(k3, 10**9, page_size=64, max_context=32_768)


def test_release_and_resume():
    kda, cache = _pools()
    _fill(cache, kda, "a", 6)
    kda.release()
    cache.release()
    assert all(t.untyped_storage().nbytes() == 0 for t in [*kda.conv_NCW, cache.storage_MGZL])
    with pytest.raises(RuntimeError, match="resume"):
        kda.alloc()
    with pytest.raises(RuntimeError, match="resume"):
        cache.new_request("b")
    kda.resume()
    cache.resume()
    assert kda.num_free == 4 and cache.num_free_pages == 16
    assert cache.storage_MGZL.untyped_storage().nbytes() == cache.storage_MGZL.nbytes
    with pytest.raises(ValueError, match="unknown request"):
        cache.seq_len("a")  # requests were dropped
    slot = _fill(cache, kda, "b", 9, seed=5)
    g = torch.Generator().manual_seed(5)
    want = torch.randn(1, 9, cache.storage_MGZL.shape[-1], generator=g)
    latent_BSL, valid_BS = cache.gather(0, ["b"])
    assert torch.equal(latent_BSL, want) and valid_BS.all()
    assert kda.read(torch.tensor([slot]))[0].conv_BCW.abs().sum() > 0
