"""Rollout samples -> padded training tensors and token-budget micro-batches (`miles_k3.trainer.batch`)."""
import pytest
import torch

from miles_k3.trainer.batch import Sample, micro_batches, pack


def test_pack_aligns_targets_mask_and_rollout_logprobs():
    a = Sample([1, 2, 3], [4, 5], rollout_logprobs=[-0.5, -0.25], advantage=1.5)
    b = Sample([7], [8, 9, 10], rollout_logprobs=[-1.0, -2.0, -3.0], advantage=-0.5)
    batch = pack([a, b], pad_id=0, vocab_size=16)
    # a: sequence 1 2 3 4 5 -> inputs 1 2 3 4, targets 2 3 4 5; response targets 4, 5 at positions 2, 3
    # b: sequence 7 8 9 10 -> inputs 7 8 9, targets 8 9 10, all response; T = 5 - 1 = 4
    assert batch.input_ids_BT.tolist() == [[1, 2, 3, 4], [7, 8, 9, 0]]
    assert batch.targets_BT.tolist() == [[2, 3, 4, 5], [8, 9, 10, 0]]
    assert batch.mask_BT.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert batch.rollout_logp_BT.tolist() == [[0, 0, -0.5, -0.25], [-1.0, -2.0, -3.0, 0]]
    assert batch.seq_lens_B.tolist() == [4, 3] and batch.adv_B.tolist() == [1.5, -0.5]
    assert batch.num_tokens == 5


def test_pack_rejects_malformed_samples():
    with pytest.raises(ValueError, match="sample 1: needs a non-empty prompt and response"):
        pack([Sample([1], [2]), Sample([1], [])], 0, 16)
    with pytest.raises(ValueError, match="sample 0: 1 rollout logprobs for 2 response tokens"):
        pack([Sample([1], [2, 3], rollout_logprobs=[-1.0])], 0, 16)
    with pytest.raises(ValueError, match="no samples"):
        pack([], 0, 16)
    with pytest.raises(ValueError, match=r"sample 1: token id 16 at response position 1 is outside the model's "
                                         r"vocabulary \[0, 16\)"):
        pack([Sample([1], [2]), Sample([1, 2], [3, 16])], 0, 16)
    with pytest.raises(ValueError, match=r"sample 0: token id -1 at prompt position 0"):
        pack([Sample([-1], [2])], 0, 16)
    with pytest.raises(ValueError, match=r"pad_id 16 is outside the vocabulary \[0, 16\)"):
        pack([Sample([1], [2])], 16, 16)
    with pytest.raises(ValueError, match="sample 0: 1 unfiltered logprobs for 2 response tokens"):
        pack([Sample([1], [2, 3], unfiltered_logprobs=[-1.0])], 0, 16)


def test_pack_takes_the_unfiltered_engine_logprobs_when_the_engine_filtered():
    # top-k sampling: rollout_logprobs are the filtered distribution's, unfiltered_logprobs the whole vocabulary's,
    # which the trainer's log-probs are comparable with (old_logprobs=rollout, TIS, the gap metric)
    filtered = Sample([1], [2, 3], rollout_logprobs=[-0.1, -0.2], unfiltered_logprobs=[-0.5, -0.75])
    plain = Sample([1], [4], rollout_logprobs=[-0.25])
    batch = pack([filtered, plain], 0, 16)
    assert batch.rollout_logp_BT.tolist() == [[-0.5, -0.75], [-0.25, 0.0]]


def test_micro_batches_respect_the_padded_budget_in_order():
    lens = [5, 3, 9, 2, 2, 2, 20]  # sequence lengths (positions = length - 1)
    samples = [Sample([1] * (n - 1), [2]) for n in lens]
    groups = micro_batches(samples, max_tokens=16)
    assert [i for g in groups for i in g] == list(range(len(lens)))  # every sample once, in order
    for g in groups:
        padded = len(g) * max(lens[i] - 1 for i in g)
        assert padded <= 16 or len(g) == 1, (g, padded)
    # positions 4 2 8 1 1 1 19: [4, 2] 2x4=8; [8, 1] 2x8=16 (a third row: 24); [1, 1] 2; 19 alone (over budget)
    assert groups == [[0, 1], [2, 3], [4, 5], [6]]
    with pytest.raises(ValueError, match="max_tokens: must be >= 1"):
        micro_batches(samples, 0)


def test_packed_logits_score_each_response_token_like_the_unpadded_sequence():
    from miles_k3.model import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval()
    a, b = Sample([5, 6, 7], [8, 9]), Sample([11], [12, 13, 14, 15])
    batch = pack([a, b], pad_id=0, vocab_size=model.config.vocab_size)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch.input_ids_BT, seq_lens=batch.seq_lens_B).logits.float(), -1)
        for row, s in enumerate([a, b]):
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            alone = torch.log_softmax(model(seq).logits.float(), -1)[0]
            p = len(s.prompt_ids)
            want = [alone[p - 1 + j, tok].item() for j, tok in enumerate(s.response_ids)]
            got = logp[row].gather(-1, batch.targets_BT[row, :, None])[:, 0][batch.mask_BT[row].bool()].tolist()
            assert got == pytest.approx(want, abs=1e-5)
