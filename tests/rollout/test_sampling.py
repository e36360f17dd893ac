"""CPU tests for `miles_k3.rollout.sampling`: filtering, logprob conventions, seeding and batch
invariance, request validation and finish reasons."""

import math

import pytest
import torch

from miles_k3.rollout.sampling import (
    FinishReason,
    SamplingParams,
    check_stop,
    filtered_logprobs,
    filters,
    sample,
    stop_window,
    unfiltered_logprobs,
)

# Probabilities of a hand-built 5-token distribution (sum 1), in shuffled id order.
PROBS = [0.10, 0.40, 0.05, 0.25, 0.20]


def _logits(probs=PROBS) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()[None, :]


def _kp(num: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise keys and positions of `num` rows: one key, positions 0..num-1 (independent draws)."""
    return torch.full((num,), seed), torch.arange(num)


def _draw(logits_1V, p: SamplingParams, num: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`num` samples of one row, batched as `num` identical rows at successive positions of one key."""
    return sample(logits_1V.expand(num, -1), [p] * num, *_kp(num, seed))


def test_greedy_is_argmax_with_raw_logprob():
    torch.manual_seed(0)
    logits_BV = torch.randn(6, 50)
    ids, logp = sample(logits_BV, [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 6, *_kp(6))
    assert torch.equal(ids, logits_BV.argmax(-1))
    ref = torch.log_softmax(logits_BV, -1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(logp, ref, rtol=0, atol=0)


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    ids, _ = sample(logits, [SamplingParams(temperature=0.0)], *_kp(1))
    assert ids.tolist() == [1]


def test_temperature_logprob_matches_hand_computed():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for t in (0.5, 1.0, 2.0):
        ids, logp = sample(logits, [SamplingParams(temperature=t)], *_kp(1, seed=1))
        z = [v / t for v in logits[0].tolist()]
        hand = z[ids.item()] - math.log(sum(math.exp(v) for v in z))
        assert logp.item() == pytest.approx(hand, abs=1e-6)


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    logits_BV = torch.randn(8, 100)
    ids, logp = sample(logits_BV, [SamplingParams(temperature=1.5, top_k=1)] * 8, torch.arange(8),
                       torch.zeros(8, dtype=torch.long))
    assert torch.equal(ids, logits_BV.argmax(-1))
    # The filtered distribution is a point mass, so its logprob is exactly 0.
    assert torch.all(logp == 0)


def test_top_k_keeps_k_largest():
    ids, logp = _draw(_logits(), SamplingParams(top_k=2), 2000)
    assert set(ids.tolist()) == {1, 3}
    torch.testing.assert_close(logp[ids == 1], torch.full_like(logp[ids == 1], math.log(0.40 / 0.65)))


def test_top_p_keeps_smallest_nucleus():
    # Sorted: 0.40 (id1), 0.25 (id3), 0.20 (id4), ... cum 0.40, 0.65, 0.85. (p=0.65 exactly is left out:
    # equality at the boundary is decided by fp32 rounding.)
    for top_p, nucleus in ((0.6, {1, 3}), (0.7, {1, 3, 4}), (0.3, {1}), (1.0, {0, 1, 2, 3, 4})):
        ids, logp = _draw(_logits(), SamplingParams(top_p=top_p), 3000, seed=7)
        assert set(ids.tolist()) == nucleus, top_p
        mass = sum(PROBS[i] for i in nucleus)
        expect = torch.tensor([math.log(PROBS[i] / mass) for i in ids.tolist()])
        torch.testing.assert_close(logp, expect, rtol=0, atol=1e-5)


def test_min_p_filters_relative_to_max():
    # max prob 0.40: min_p=0.45 -> threshold 0.18 keeps {1, 3, 4}; min_p=0.55 -> 0.22 keeps {1, 3}.
    # (Thresholds sit away from a token's prob: exactly-equal is decided by fp32 rounding.)
    for min_p, kept_ids in ((0.45, {1, 3, 4}), (0.55, {1, 3}), (0.0, {0, 1, 2, 3, 4})):
        logp_V = filtered_logprobs(_logits(), [SamplingParams(min_p=min_p)])[0]
        assert set(torch.nonzero(torch.isfinite(logp_V)).flatten().tolist()) == kept_ids, min_p
        ids, logp = _draw(_logits(), SamplingParams(min_p=min_p), 3000, seed=3)
        assert set(ids.tolist()) == kept_ids, min_p
        mass = sum(PROBS[i] for i in kept_ids)
        expect = torch.tensor([math.log(PROBS[i] / mass) for i in ids.tolist()])
        torch.testing.assert_close(logp, expect, rtol=0, atol=1e-5)


def test_filter_order_temperature_then_top_p():
    # At temperature 2 the distribution flattens, so top_p=0.6 needs more tokens than at temperature 1.
    logp_V = filtered_logprobs(_logits(), [SamplingParams(temperature=2.0, top_p=0.6)])[0]
    z = torch.tensor(PROBS).log() / 2.0
    q = torch.softmax(z, -1)
    order = torch.argsort(q, descending=True)
    cum = torch.cumsum(q[order], 0)
    n_keep = int((cum < 0.6).sum()) + 1
    assert set(torch.nonzero(torch.isfinite(logp_V)).flatten().tolist()) == set(order[:n_keep].tolist())
    assert n_keep == 3


def test_frequencies_match_filtered_distribution():
    num = 20_000
    p = SamplingParams(temperature=1.0, top_k=4)  # drops id 2 (0.05)
    ids, _ = _draw(_logits(), p, num, seed=123)
    counts = torch.bincount(ids, minlength=5).double()
    assert counts[2] == 0
    expect = torch.tensor([PROBS[i] if i != 2 else 0.0 for i in range(5)], dtype=torch.float64)
    expect = expect / expect.sum() * num
    keep = expect > 0
    chi2 = (((counts - expect) ** 2)[keep] / expect[keep]).sum().item()
    # 3 degrees of freedom: P(chi2 > 16.3) ~ 0.001.
    assert chi2 < 16.3, (counts.tolist(), expect.tolist())


def test_seed_determinism_and_batch_independence():
    torch.manual_seed(2)
    V = 257
    row_V = torch.randn(V) * 3
    p = SamplingParams(temperature=0.8, top_p=0.9, sampling_seed=42)
    key, pos = torch.tensor([42]), torch.tensor([3])
    alone = [sample(row_V[None], [p], key, pos)[0].item() for _ in range(2)]
    assert alone[0] == alone[1]
    # Same row in the middle of a batch of different rows, params and keys.
    others = torch.randn(4, V)
    batch = torch.cat([others[:2], row_V[None], others[2:]])
    ps = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), p, SamplingParams(min_p=0.1),
          SamplingParams(temperature=2.0)]
    ids, logp = sample(batch, ps, torch.tensor([1, 7, 42, 3, 9]), torch.tensor([0, 4, 3, 1, 2]))
    alone_ids, alone_logp = sample(row_V[None], [p], key, pos)
    assert ids[2].item() == alone_ids.item() == alone[0]
    assert logp[2].item() == alone_logp.item()
    # A sequence of positions of one key is reproducible step by step, alone or next to another row.
    seq1 = [sample(row_V[None], [p], key, torch.tensor([i]))[0].item() for i in range(20)]
    pair = torch.stack([others[0], row_V])
    seq2 = [sample(pair, [p, p], torch.tensor([5, 42]), torch.tensor([0, i]))[0][1].item() for i in range(20)]
    assert seq1 == seq2
    assert len(set(seq1)) > 1


def test_logprobs_fp32_for_bf16_logits():
    logits = torch.randn(3, 64).to(torch.bfloat16)
    ps = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.5)]
    ids, logp = sample(logits, ps, *_kp(3))
    assert ids.dtype == torch.int64 and logp.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1)[0, ids[0]]
    assert logp[0].item() == ref.item()


def test_from_dict_defaults_and_normalisation():
    p = SamplingParams.from_dict({"top_k": 0, "stop": "###", "temperature": 0}, where="request 0")
    assert p.top_k == -1 and p.stop == ["###"] and p.greedy and p.max_new_tokens == 128
    assert SamplingParams.from_dict(None, where="request 1") == SamplingParams()


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("max_new_tokens", 0),
        ("max_new_tokens", True),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 5),
        ("ignore_eos", "yes"),
        ("sampling_seed", 1.5),
    ],
)
def test_validation_errors_name_field_value_and_request(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({field: value}, where="request 3")
    msg = str(e.value)
    assert "request 3" in msg and f"sampling_params.{field}=" in msg and repr(value) in msg
    assert "expected" in msg


def test_unknown_key_rejected():
    with pytest.raises(ValueError, match=r"request 2: unknown sampling_params key\(s\) \['temprature'\]"):
        SamplingParams.from_dict({"temprature": 0.5}, where="request 2")


def test_validate_stop_ids_against_vocab():
    p = SamplingParams.from_dict({"stop_token_ids": [3, 10]}, where="request 4")
    p.validate(vocab_size=11, where="request 4")
    with pytest.raises(ValueError, match=r"request 4: sampling_params.stop_token_ids=\[3, 10\].*\[0, 10\)"):
        p.validate(vocab_size=10, where="request 4")


def test_finish_stop_token_and_eos():
    p = SamplingParams(stop_token_ids=[7], max_new_tokens=10)
    assert check_stop([], p) is None
    assert check_stop([1, 2], p, eos_ids=[2]) == FinishReason("stop", 2)
    assert check_stop([1, 7], p) == FinishReason("stop", 7)
    assert check_stop([1, 3], p, eos_ids=[2]) is None
    assert FinishReason("stop", 2).to_dict() == {"type": "stop", "matched": 2}


def test_finish_ignore_eos_keeps_going_but_stop_ids_still_stop():
    p = SamplingParams(ignore_eos=True, stop_token_ids=[7], max_new_tokens=4)
    assert check_stop([1, 2], p, eos_ids=[2]) is None
    assert check_stop([1, 7], p, eos_ids=[2]) == FinishReason("stop", 7)
    assert check_stop([1, 2, 2, 2], p, eos_ids=[2]) == FinishReason("length")


def test_finish_length_and_stop_beats_length():
    p = SamplingParams(max_new_tokens=3)
    assert check_stop([5, 5], p, eos_ids=[2]) is None
    assert check_stop([5, 5, 5], p, eos_ids=[2]) == FinishReason("length", None)
    assert check_stop([5, 5, 2], p, eos_ids=[2]) == FinishReason("stop", 2)
    assert FinishReason("length").to_dict() == {"type": "length", "matched": None}


def test_finish_stop_string_with_toy_detokenizer():
    vocab = {0: "Hel", 1: "lo", 2: " wor", 3: "ld", 4: "##", 5: "#", 6: "!"}

    def text_fn(ids):
        return "".join(vocab[i] for i in ids)

    p = SamplingParams(stop=["###", "world"], max_new_tokens=50)
    assert check_stop([0, 1, 2], p, text_fn=text_fn) is None
    # "world" is completed by token 3, which is kept; the caller stops here.
    assert check_stop([0, 1, 2, 3], p, text_fn=text_fn) == FinishReason("stop", "world")
    # A stop string that spans a token boundary ("##" + "#") is found too.
    assert check_stop([0, 4], p, text_fn=text_fn) is None
    assert check_stop([0, 4, 5], p, text_fn=text_fn) == FinishReason("stop", "###")
    with pytest.raises(ValueError, match="detokenizer"):
        check_stop([0], p)


def test_stop_strings_decode_a_tail_window_and_stop_where_the_whole_output_did():
    """A long output of filler tokens, then "##" + "#": the same stop at the same token as decoding everything,
    while every call decodes at most 4 * 3 + 8 = 20 tokens (the longest stop string, "###", is 3 characters)."""
    vocab = {0: "ab", 4: "##", 5: "#", 7: "x"}
    decoded = []

    def text_fn(ids):
        decoded.append(len(ids))
        return "".join(vocab[i] for i in ids)

    p = SamplingParams(stop=["###", "#x"], max_new_tokens=1000)
    out = [0] * 300 + [4]
    assert check_stop(out, p, text_fn=text_fn) is None
    assert check_stop(out + [5], p, text_fn=text_fn) == FinishReason("stop", "###")
    assert decoded == [20, 20]
    assert stop_window(["###", "#x"]) == 20
    # every token from the first to the 500th: the decoded length stops growing at the window
    decoded.clear()
    for length in range(1, 501):
        assert check_stop([0] * length, p, text_fn=text_fn) is None
    assert decoded[:3] == [1, 2, 3] and max(decoded) == 20 and sum(decoded) == sum(range(1, 21)) + 480 * 20


# ---- counter-based (keyed) sampling: the engine's batched hot path ---------------------------------------
def test_keyed_sampling_is_batch_invariant_and_deterministic():
    from miles_k3.rollout.sampling import sample

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=t, top_k=k) for t, k in
              [(1.0, -1), (0.7, 10), (0, -1), (1.3, 5), (1.0, -1), (0.9, -1)]]
    keys, pos = torch.tensor([11, 12, 13, 14, 11, 2**40 + 3]), torch.tensor([0, 5, 2, 9, 1, 0])
    ids, lps = sample(logits, params, keys, pos)
    for b in range(6):
        one_id, one_lp = sample(logits[b:b + 1], params[b:b + 1], keys[b:b + 1], pos[b:b + 1])
        assert one_id.item() == ids[b].item() and one_lp.item() == lps[b].item()
    again = sample(logits, params, keys, pos)
    assert torch.equal(again[0], ids) and torch.equal(again[1], lps)
    assert ids[2].item() == logits[2].argmax().item()  # greedy rows ignore the noise


def test_keyed_sampling_matches_the_distribution_and_positions_are_independent():
    from miles_k3.rollout.sampling import sample

    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 20000
    logits = probs.log().expand(n, 5)
    params = [SamplingParams(temperature=1.0)] * n
    ids, _ = sample(logits, params, torch.full((n,), 7), torch.arange(n))
    counts = torch.bincount(ids, minlength=5).float()
    chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum().item()
    assert chi2 < 18.5, chi2  # 4 degrees of freedom: p ~ 0.001
    # consecutive positions of one key: pair frequencies match the product distribution (2 x 2 cells)
    half = torch.tensor([0.5, 0.5]).log().expand(n, 2)
    bits, _ = sample(half, params, torch.full((n,), 99), torch.arange(n))
    pairs = torch.bincount(bits[:-1] * 2 + bits[1:], minlength=4).float()
    chi2_pairs = ((pairs - (n - 1) / 4) ** 2 / ((n - 1) / 4)).sum().item()
    assert chi2_pairs < 16.3, chi2_pairs  # 3 degrees of freedom: p ~ 0.001
    # different keys at the same position are different streams
    other, _ = sample(half, params, torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert 0.47 < other.float().mean().item() < 0.53


def test_unfiltered_fast_path_equals_the_sorted_path_bitwise():
    """Rows without top-k/top-p/min-p skip the sort; in a batch where another row filters (so every row goes
    through the sorted path) the same rows give the same fp32 values bit for bit."""
    torch.manual_seed(3)
    logits_BV = torch.randn(4, 300, dtype=torch.bfloat16)
    plain = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.3)] + [SamplingParams(temperature=0.0)]
    fast = filtered_logprobs(logits_BV, plain)
    sorted_path = filtered_logprobs(torch.cat([logits_BV, logits_BV[:1]]), plain + [SamplingParams(top_k=5)])
    assert torch.equal(fast, sorted_path[:4])
    assert torch.equal(fast[1], torch.log_softmax(logits_BV[1].float() / 0.7, -1))
    assert torch.isinf(sorted_path[4]).sum() == 300 - 5


def test_keyed_noise_is_strictly_positive_and_finite():
    """u lives on 23-bit midpoints in [2^-24, 1 - 2^-24]: E = -log(u) is never 0 (which would force a token,
    whatever its probability) nor inf. Over 2^22 draws the extremes of the grid are reached closely."""
    from miles_k3.rollout.sampling import keyed_exp_noise

    e = keyed_exp_noise(torch.arange(128), torch.zeros(128, dtype=torch.long), 32768)
    assert (e > 0).all() and torch.isfinite(e).all()
    assert e.min() < 1e-5 and e.max() > 12  # both tails of Exp(1) are sampled
    e48 = keyed_exp_noise(torch.tensor([48]), torch.tensor([16]), 110)[0, 109]  # the top of the hash range
    assert 0 < e48 < 1e-6


def test_unfiltered_logprobs_of_the_drawn_tokens_hand_computed():
    # top-k 2 keeps ids 1 (0.40) and 3 (0.25): renormalised 0.40 / 0.65 and 0.25 / 0.65
    p = SamplingParams(top_k=2)
    ids, logp = _draw(_logits(), p, 64)
    raw = unfiltered_logprobs(_logits().expand(64, -1), [p] * 64, ids)
    assert set(ids.tolist()) == {1, 3}
    want_raw = {1: math.log(0.40), 3: math.log(0.25)}
    want_filtered = {1: math.log(0.40 / 0.65), 3: math.log(0.25 / 0.65)}
    for t, r, f in zip(ids.tolist(), raw.tolist(), logp.tolist()):
        assert r == pytest.approx(want_raw[t], abs=1e-6) and f == pytest.approx(want_filtered[t], abs=1e-6)
    # temperature 2 and greedy rows: over the whole vocabulary at the row's temperature (1 for greedy)
    hot, greedy = SamplingParams(temperature=2.0, top_p=0.5), SamplingParams(temperature=0.0)
    two = unfiltered_logprobs(_logits().expand(2, -1), [hot, greedy], torch.tensor([2, 2]))
    z = sum(q ** 0.5 for q in PROBS)  # softmax(log q / 2) = sqrt(q) / sum sqrt(q)
    assert two.tolist() == pytest.approx([math.log(0.05 ** 0.5 / z), math.log(0.05)], abs=1e-6)


def test_filters_names_the_requests_whose_logprobs_are_filtered():
    v = 5
    assert not filters(SamplingParams(), v) and not filters(SamplingParams(top_k=5), v)
    assert not filters(SamplingParams(temperature=0.0, top_p=0.5), v)  # greedy: raw log-probs
    assert filters(SamplingParams(top_k=4), v) and filters(SamplingParams(top_p=0.9), v)
    assert filters(SamplingParams(min_p=0.1), v)
