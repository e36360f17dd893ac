"""Partial rollouts in the native engine (`RolloutEngine.queue`: submit / run / cancel / queue_state) on k3_tiny
(fp32, CPU, eager decode): a run that stops after K groups retracts the rest, which continue in the next run exactly
as an uninterrupted `generate` (same weights), record the weight version of every token across a push, survive a
memory release and a save / load into a fresh engine, and never mix with `generate`."""
import io

import pytest
import torch
from engine_helpers import random_adapter, small_engine

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.rollout.engine import EngineConfig, RolloutEngine

LORA = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "w1"])
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [300, 301]]
LONG, SHORT = 12, 3  # max_new_tokens: prompts 0 and 2 run long, prompt 1 finishes after 3 tokens


def _params(seed: int, max_new: int, **kw) -> dict:
    return {"temperature": 1.0, "max_new_tokens": max_new, "sampling_seed": seed, **kw}


PARAMS = [_params(11, LONG), _params(22, SHORT), _params(33, LONG)]


@pytest.fixture(scope="module")
def trainer():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval().requires_grad_(False)
    with torch.no_grad():  # non-zero AttnRes queries so the mixers are exercised
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    random_adapter(model, LORA, seed=1)
    return model


def _engine(model, **kw) -> RolloutEngine:
    engine = small_engine(model, LORA, **{"decode": "eager", **kw})
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    return engine


def _submit(engine, prompts=PROMPTS, params=PARAMS):
    return engine.queue.submit(prompts, params, n=2, lora="policy", return_routed_experts=True)


def _generate(engine, prompts=PROMPTS, params=PARAMS):
    return engine.generate(input_ids=prompts, sampling_params=params, n=2, lora="policy",
                           return_routed_experts=True)


def _pools_free(engine) -> bool:
    """Every KDA slot and latent page free but, under static / graph decode, the one scratch slot and the one
    scratch page its padding rows hold for the engine's life."""
    scratch = int(engine.runner.decode_mode != "eager")
    return (engine.kda.num_free == engine.kda.num_slots - scratch
            and engine.cache.num_free_pages == engine.cache.num_pages - scratch)


def _assert_same(got: dict, want: dict, logprobs_exact: bool = True) -> None:
    assert got["output_ids"] == want["output_ids"]
    g, w = got["meta_info"], want["meta_info"]
    if logprobs_exact:
        assert g["output_token_logprobs"] == w["output_token_logprobs"]
    else:  # recomputed state: the same math in another order (test_engine's LOGPROB_ATOL)
        assert [t for _, t in g["output_token_logprobs"]] == [t for _, t in w["output_token_logprobs"]]
        assert max(abs(a - b) for (a, _), (b, _) in zip(g["output_token_logprobs"], w["output_token_logprobs"])) < 1e-5
    assert torch.equal(g["routed_experts"], w["routed_experts"])
    for key in ("finish_reason", "prompt_tokens", "completion_tokens", "weight_versions",
                "output_token_weight_versions"):
        assert g[key] == w[key], key


def _by_group(results):
    return {gid: records for gid, records in results}


def test_a_run_stops_after_k_groups_and_the_next_continues_the_rest_as_one_generate(trainer):
    engine = _engine(trainer)
    assert _submit(engine) == [0, 1, 2]
    first = engine.queue.run(finished_groups=1)
    # the short prompt's group finishes first (3 tokens); the others are retracted: nothing held
    assert [gid for gid, _ in first] == [1] and len(first[0][1]) == 2
    assert engine.queue.queued_groups() == [0, 2]
    assert _pools_free(engine) and engine.runner.route_log.num_rows == 0
    rest = engine.queue.run()
    assert [gid for gid, _ in rest] in ([0, 2], [2, 0]) and engine.queue.queued_groups() == []
    want = _generate(engine)  # the same weights, uninterrupted
    got = {**_by_group(first), **_by_group(rest)}
    for gid in range(3):
        assert len(got[gid]) == 2
        for j, record in enumerate(got[gid]):
            _assert_same(record, want[2 * gid + j], logprobs_exact=gid == 1)
            assert record["meta_info"]["completion_tokens"] == PARAMS[gid]["max_new_tokens"]
    assert _pools_free(engine)


def test_the_stop_counts_what_it_retracted_tokens_to_recompute_and_bytes_held(trainer):
    """Hand-worked: group 1 finishes with its third token, so groups 0 and 2 (two samples each) have three tokens
    and their state covers prompt + 2 fed tokens: 13 tokens for prompt 0 (11 long), 4 for prompt 2. With 4-token
    pages, a sample of group 0 holds 4 pages, the first two (8 prompt tokens) shared with its sibling (a fork copies
    the partial third): 2 + 2 x 2 = 6 pages; group 2's samples hold one page each, unshared (a 2-token prompt's only
    page is partial): 2. So 4 requests, 2 x 13 + 2 x 4 = 34 tokens, 4 slots and 8 pages."""
    from miles_k3.rollout.memory import page_bytes, slot_bytes

    engine = _engine(trainer)
    _submit(engine)
    engine.queue.run(finished_groups=1)
    r, cfg = engine.queue.retracted, trainer.config
    assert (r.requests, r.tokens) == (4, 34)
    assert r.bytes == 4 * slot_bytes(cfg, torch.float32) + 8 * page_bytes(cfg, 4, torch.float32)
    engine.queue.run()  # ran to the end: nothing retracted
    r = engine.queue.retracted
    assert (r.requests, r.tokens, r.bytes) == (0, 0, 0)


def _push(engine, trainer, scale=0.2):
    g = torch.Generator().manual_seed(5)
    tensors = {k: v + torch.randn(v.shape, generator=g) * scale for k, v in lora_state_dict(trainer).items()}
    engine.update_weights_from_tensor(tensors, lora_name="policy")


def test_each_output_token_records_the_version_that_sampled_it_across_a_push(trainer):
    engine = _engine(trainer)
    _submit(engine, PROMPTS[:2], PARAMS[:2])
    assert [gid for gid, _ in engine.queue.run(finished_groups=1)] == [1]
    _push(engine, trainer)  # version 0 -> 1 between the runs
    assert engine.weight_version == 1
    (late,) = _submit(engine, PROMPTS[2:], PARAMS[2:])
    done = _by_group(engine.queue.run())
    for record in done[0]:  # 3 tokens sampled under 0 (while group 1 ran), the rest under 1
        meta = record["meta_info"]
        assert meta["output_token_weight_versions"] == [0] * SHORT + [1] * (LONG - SHORT)
        assert meta["weight_versions"] == [0, 1] and meta["weight_version"] == 1
    for record in done[late]:
        meta = record["meta_info"]
        assert meta["output_token_weight_versions"] == [1] * LONG and meta["weight_versions"] == [1]


def test_memory_released_between_runs_and_resumed_changes_nothing(trainer):
    plain, released = _engine(trainer), _engine(trainer)
    for engine in (plain, released):
        _submit(engine)
        engine.queue.run(finished_groups=1)
    released.release_memory_occupation(["kv_cache"])
    assert released.cache.storage_MGZL.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        released.queue.run()
    released.resume_memory_occupation(["kv_cache"])
    want, got = _by_group(plain.queue.run()), _by_group(released.queue.run())
    assert sorted(got) == sorted(want) == [0, 2]
    for gid in want:
        for g, w in zip(got[gid], want[gid], strict=True):
            _assert_same(g, w)


def test_the_queue_saved_and_loaded_into_a_fresh_engine_continues_exactly(trainer):
    # sample 0 of prompt 0 stops at its first token (a stop token id), sample 1 runs on: the saved state holds a
    # finished sample of an unfinished group besides the retracted ones
    probe = _generate(_engine(trainer), PROMPTS[:1], PARAMS[:1])
    stop_id = probe[0]["output_ids"][0]
    assert stop_id not in probe[1]["output_ids"]
    params = [_params(11, LONG, stop_token_ids=[stop_id]), *PARAMS[1:]]
    first = _engine(trainer)
    _submit(first, params=params)
    assert [gid for gid, _ in first.queue.run(finished_groups=1)] == [1]
    state = first.queue.queue_state()
    assert [r["output"] for r in state["requests"] if r["finish"] is not None] == [[stop_id]]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    second = _engine(trainer)
    second.queue.load_queue_state(torch.load(buf, weights_only=True))
    assert second.queue.queued_groups() == first.queue.queued_groups() == [0, 2]
    with pytest.raises(RuntimeError, match="queue is not empty"):
        second.queue.load_queue_state(state)
    want, got = first.queue.run(), second.queue.run()
    assert [gid for gid, _ in got] == [gid for gid, _ in want]
    for (_, gs), (_, ws) in zip(got, want, strict=True):
        for g, w in zip(gs, ws, strict=True):
            _assert_same(g, w)
    assert _by_group(got)[0][0]["output_ids"] == [stop_id]
    assert _submit(second) == [3, 4, 5]  # group ids go on from the saved counter


def test_cancel_must_finish_and_bad_submits(trainer):
    engine = _engine(trainer)
    _submit(engine)
    assert engine.queue.run(finished_groups=0) == []  # the condition holds before any step: nothing runs
    engine.queue.cancel([1])
    assert engine.queue.queued_groups() == [0, 2]
    with pytest.raises(ValueError, match=r"groups \[7\] are not queued"):
        engine.queue.cancel([0, 7])
    assert engine.queue.queued_groups() == [0, 2]
    with pytest.raises(ValueError, match=r"request 1: empty prompt"):
        engine.queue.submit([[1, 2], []], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"request 2: token ids \[100000\] outside the vocabulary"):
        engine.queue.submit([[1, 2], [3], [4, 100000]], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"request 0: prompt \(3 tokens\) \+ max_new_tokens \(62\) exceeds"):
        engine.queue.submit([[1, 2, 3]], {"max_new_tokens": 62})
    assert engine.queue.queued_groups() == [0, 2]
    with pytest.raises(RuntimeError, match="queue is not empty"):
        engine.queue.load_queue_state({"next_group": 0, "groups": [], "requests": [], "entries": []})
    with pytest.raises(ValueError, match=r"must_finish groups \[1\] are not queued"):
        engine.queue.run(must_finish=[1])
    # groups 0 and 2 run side by side and finish in the same step, 0's samples first (running order)
    assert [gid for gid, _ in engine.queue.run(finished_groups=0, must_finish=[2])] == [0, 2]
    assert engine.queue.queued_groups() == [] and engine.queue.run() == []


def test_generate_between_two_runs_leaves_the_queue_alone(trainer):
    engine = _engine(trainer)
    _submit(engine)
    engine.queue.run(finished_groups=1)
    queued = engine.queue.queued_groups()
    solo = engine.generate(input_ids=[[9, 8, 7]], sampling_params=_params(5, 4), lora="policy")
    assert engine.queue.queued_groups() == queued == [0, 2]
    assert solo == _engine(trainer).generate(input_ids=[[9, 8, 7]], sampling_params=_params(5, 4), lora="policy")
    rest = _by_group(engine.queue.run())
    want = _generate(_engine(trainer))
    for gid in (0, 2):
        for j, record in enumerate(rest[gid]):
            _assert_same(record, want[2 * gid + j], logprobs_exact=False)


def test_requests_preempted_before_the_stop_keep_their_routes_and_continue_unchanged(trainer):
    """6 pages of 4 tokens for 6 requests of up to 19 tokens (test_engine's preemption budget): requests are
    preempted while the first run goes on, and a preempted one still waiting when the run stops keeps its decode
    steps' routes through the route log's clear."""
    params = [_params(11, 8), _params(22, SHORT), _params(33, 8)]
    want = _generate(_engine(trainer), params=params)
    tight = _engine(trainer, max_context=20, num_pages=6)
    _submit(tight, params=params)
    first = tight.queue.run(finished_groups=1)
    assert tight.num_preempted > 0 and _pools_free(tight)
    got = {**_by_group(first), **_by_group(tight.queue.run())}
    for gid in range(3):
        for j, record in enumerate(got[gid]):
            _assert_same(record, want[2 * gid + j], logprobs_exact=False)


def _retract_release_reload(device: str, decode: str, kda_backend: str) -> None:
    """bf16, a padded decoder (its scratch slot and page held throughout): the group finished before the stop equals
    `generate`'s (the same steps); the retracted ones continue identically after a release of every tag and a
    resume (engine a), and in a fresh engine loaded from the saved queue (engine c): both start from zeroed pools.
    Engine b continues over its pools' stale rows (read only by the padding rows): the same tokens and routes."""
    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(K3Config.from_name("k3_tiny"), kda_backend=kda_backend, expert_format="mxfp4")
        model = model.cast(torch.bfloat16).eval().requires_grad_(False)
    apply_lora(model, LORA)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.2)

    def engine():
        e = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=128, page_size=16,
                                              decode=decode), lora=LORA)
        e.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
        return e

    want = _generate(engine())
    a, b = engine(), engine()
    for e in (a, b):
        _submit(e)
        (first,) = e.queue.run(finished_groups=1)
        assert first[0] == 1 and _pools_free(e) and e.queue.queued_groups() == [0, 2]
        for j, record in enumerate(first[1]):
            _assert_same(record, want[2 + j])
    a.release_memory_occupation()
    a.resume_memory_occupation()
    buf = io.BytesIO()
    torch.save(b.queue.queue_state(), buf)
    buf.seek(0)
    c = engine()
    c.queue.load_queue_state(torch.load(buf, weights_only=True))
    ra, rb, rc = (_by_group(e.queue.run()) for e in (a, b, c))
    assert sorted(ra) == sorted(rb) == sorted(rc) == [0, 2]
    for gid in (0, 2):
        for ga, gb, gc, w in zip(ra[gid], rb[gid], rc[gid], want[2 * gid:2 * gid + 2], strict=True):
            _assert_same(ga, gc)
            assert gb["output_ids"] == ga["output_ids"]
            assert torch.equal(gb["meta_info"]["routed_experts"], ga["meta_info"]["routed_experts"])
            assert ga["output_ids"][:SHORT] == w["output_ids"][:SHORT]  # sampled before the stop
            assert ga["meta_info"]["routed_experts"].shape[0] == len(PROMPTS[gid]) + LONG - 1
            assert ga["meta_info"]["output_token_weight_versions"] == [0] * LONG


def test_partial_runs_under_static_decode_retract_release_and_reload():
    """The CUDA-graph test's steps on the CPU with the static decoder (the same padded batches, uncaptured)."""
    _retract_release_reload("cpu", "static", "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_partial_runs_under_cuda_graph_decode_retract_release_and_reload():
    _retract_release_reload("cuda", "graph", "fla")
