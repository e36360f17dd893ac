"""The rollout engine on k3_tiny (fp32, CPU): greedy output and logprobs against the plain full-sequence model,
group fork against independent requests, preemption, release/resume, in-place LoRA updates, bad requests."""
import pytest
import torch
from engine_helpers import random_adapter, small_engine

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.rollout.engine import EngineConfig

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [300]]
# fp32 logprobs of the same tokens through the engine (chunked prefill + pooled decode steps) and through one
# full-sequence forward: two evaluation orders of the same math, observed <= 1e-6.
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    model = K3ForCausalLM(cfg, expert_format="mxfp4").eval().requires_grad_(False)
    with torch.no_grad():  # non-zero AttnRes queries so the mixers are exercised
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    return model


@torch.no_grad()
def _greedy_loop(model, prompt, steps):
    tokens, out = list(prompt), []
    for _ in range(steps):
        nxt = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
        out.append(nxt)
        tokens.append(nxt)
    return out


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_greedy_output_and_logprobs_equal_the_full_sequence_model(base, decode):
    res = small_engine(base, decode=decode).generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 6})
    for prompt, r in zip(PROMPTS, res):
        assert r["output_ids"] == _greedy_loop(base, prompt, 6)
        with torch.no_grad():
            logp = torch.log_softmax(base(torch.tensor([prompt + r["output_ids"]])).logits[0].float(), -1)
        ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r["output_ids"])]
        got = [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, ref)) < LOGPROB_ATOL
        meta = r["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "matched": None}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (len(prompt), 6, 0)


def test_group_fork_equals_independent_requests_with_the_same_seeds(base):
    engine = small_engine(base)
    params = {"temperature": 1.0, "top_k": 50, "max_new_tokens": 5, "sampling_seed": 7}
    forked = engine.generate(input_ids=[PROMPTS[0]], sampling_params=params, n=3)
    alone = [engine.generate(input_ids=[PROMPTS[0]], sampling_params={**params, "sampling_seed": 7 + j})[0]
             for j in range(3)]
    assert [r["output_ids"] for r in forked] == [r["output_ids"] for r in alone]
    assert len({tuple(r["output_ids"]) for r in forked}) > 1  # different seeds, different samples
    for f, a in zip(forked, alone):
        lp_f = [lp for lp, _ in f["meta_info"]["output_token_logprobs"]]
        lp_a = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_f, lp_a)) < LOGPROB_ATOL
    # the prompt was prefilled once: the other samples reused its len - 1 tokens
    assert [r["meta_info"]["cached_tokens"] for r in forked] == [0, 10, 10]
    assert engine.kda.num_free == engine.kda.num_slots and engine.cache.num_free_pages == engine.cache.num_pages


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_preemption_under_a_tiny_page_budget_completes_every_request_unchanged(base, decode):
    params = {"temperature": 0, "max_new_tokens": 8}
    roomy = small_engine(base).generate(input_ids=PROMPTS, sampling_params=params, n=2)
    # 6 pages of 4 tokens for 6 requests of up to 19 tokens (static decode keeps one page for padding rows)
    tight = small_engine(base, max_context=20, num_pages=6 + (decode == "static"), decode=decode)
    got = tight.generate(input_ids=PROMPTS, sampling_params=params, n=2)
    assert tight.num_preempted > 0
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in roomy]
    assert tight.cache.num_free_pages == 6


def _assert_same_samples(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        lp_g = [lp for lp, _ in g["meta_info"]["output_token_logprobs"]]
        lp_w = [lp for lp, _ in w["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp_g, lp_w)) < LOGPROB_ATOL


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_release_and_resume_leave_outputs_unchanged(base, decode):
    engine = small_engine(base, decode=decode)
    params = {"temperature": 0.8, "max_new_tokens": 4, "sampling_seed": 3}
    before = engine.generate(input_ids=PROMPTS, sampling_params=params)
    engine.release_memory_occupation(["kv_cache"])
    assert engine.cache.storage_MGZL.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        engine.generate(input_ids=PROMPTS, sampling_params=params)
    engine.resume_memory_occupation(["kv_cache"])
    assert engine.generate(input_ids=PROMPTS, sampling_params=params) == before
    # cuda_graph: the step graphs (static buffers here, captured graphs on CUDA) are dropped, rebuilt on use.
    # The pools now hold the previous requests' data (and the padding rows' scratch state): tokens repeat
    # exactly, logprobs to LOGPROB_ATOL (on CPU the expert matmuls' shapes follow the padding rows' routing).
    engine.release_memory_occupation(["cuda_graph"])
    if decode == "static":
        assert not engine.runner.graph._graphs
    with pytest.raises(RuntimeError, match=r"\['cuda_graph'\] is released"):
        engine.generate(input_ids=PROMPTS, sampling_params=params)
    engine.resume_memory_occupation(["cuda_graph"])
    _assert_same_samples(engine.generate(input_ids=PROMPTS, sampling_params=params), before)
    # no tags = every tag, as in SGLang; resuming only one of them still refuses to serve
    engine.release_memory_occupation()
    engine.resume_memory_occupation(["cuda_graph"])
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] is released"):
        engine.generate(input_ids=PROMPTS, sampling_params=params)
    engine.resume_memory_occupation()
    assert engine.generate(input_ids=PROMPTS, sampling_params=params) == before  # fresh pools: bitwise
    with pytest.raises(ValueError, match=r"weights.*supported.*\['kv_cache', 'cuda_graph'\]"):
        engine.release_memory_occupation(["weights"])


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_in_place_lora_update_gives_exactly_the_adapted_model(base, decode):
    params = {"temperature": 0, "max_new_tokens": 5}
    base_out = [_greedy_loop(base, p, 5) for p in PROMPTS]
    trainer = K3ForCausalLM(base.config, expert_format="mxfp4").eval()
    trainer.load_state_dict(base.state_dict())
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", "kv_b_proj", "w1", "w2", "w3"])
    apply_lora(trainer, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_parameters(trainer).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    engine = small_engine(trainer, lora=cfg, decode=decode)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(trainer), cfg)
    addresses = {n: t.data_ptr() for n, t in engine.adapters.buffers("policy").items()}

    def outputs(name):
        return [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=params, lora=name)]

    first = outputs("policy")
    assert first == [_greedy_loop(trainer, p, 5) for p in PROMPTS] and first != base_out
    assert outputs(None) == base_out  # the base model: no adapter
    with torch.no_grad():  # an optimizer step on the trainer side, then a push
        for name, p in lora_parameters(trainer).items():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    engine.update_weights_from_tensor(lora_state_dict(trainer), lora_name="policy")
    second = outputs("policy")
    assert second == [_greedy_loop(trainer, p, 5) for p in PROMPTS] and second != first
    assert engine.weight_version == 1
    assert {n: t.data_ptr() for n, t in engine.adapters.buffers("policy").items()} == addresses
    # a bad push (one NaN tensor among good ones) changes nothing
    bad = {n: t.clone() for n, t in lora_state_dict(trainer).items()}
    key = next(iter(bad))
    bad[key][0, 0] = float("nan")
    with pytest.raises(ValueError, match=f"{key}.*NaN"):
        engine.update_weights_from_tensor(bad, lora_name="policy")
    assert outputs("policy") == second and engine.weight_version == 1


def test_bad_requests_get_an_error_each_and_the_others_are_served(base):
    engine = small_engine(base)
    good = [5, 6, 7]
    res = engine.generate(
        input_ids=[good, [], [1] * 70, [9999], good, good],
        sampling_params=[{"temperature": 0, "max_new_tokens": 3}, {}, {}, {}, {"temperature": -1},
                         {"max_new_tokens": 3}],
        lora=[None, None, None, None, None, "nope"])
    assert res[0]["output_ids"] == _greedy_loop(base, good, 3)
    for r, needle in zip(res[1:], ["empty prompt", "max_context 64", "outside the vocabulary", "temperature",
                                   "unknown LoRA adapter"]):
        assert needle in r["error"] and r["meta_info"]["finish_reason"]["type"] == "abort", (needle, r)
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        engine.generate(sampling_params={})


def test_stop_token_ends_a_sample(base):
    out = _greedy_loop(base, PROMPTS[1], 6)
    engine = small_engine(base, eos_token_ids=[out[2]])
    r = engine.generate(input_ids=[PROMPTS[1]], sampling_params={"temperature": 0, "max_new_tokens": 6})[0]
    assert r["output_ids"] == out[:3]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[2]}


def test_pause_blocks_scheduling_and_release_is_refused_while_generate_runs(base):
    import threading

    engine = small_engine(base)
    params = {"temperature": 0, "max_new_tokens": 3}
    expected = engine.generate(input_ids=PROMPTS, sampling_params=params)
    engine.pause_generation()
    box = {}
    worker = threading.Thread(target=lambda: box.update(r=engine.generate(input_ids=PROMPTS,
                                                                          sampling_params=params)))
    worker.start()
    worker.join(timeout=1.0)
    assert worker.is_alive() and "r" not in box  # paused: no step was scheduled
    with pytest.raises(RuntimeError, match="generate\\(\\) is running"):
        engine.release_memory_occupation()
    assert engine.flush_cache()  # no step holds the scheduler now
    engine.continue_generation()
    worker.join(timeout=60)
    assert box["r"] == expected


def test_text_prompts_and_stop_strings_through_the_small_tokenizer(base, tmp_path):
    from miles_k3.model.tokenizer import load_tokenizer, save_small_tokenizer

    save_small_tokenizer(tmp_path, base.config.vocab_size)
    tok = load_tokenizer(tmp_path)
    engine = small_engine(base, prefill_chunk=EngineConfig.prefill_chunk, tokenizer=tok)  # whole-prompt prefill
    params = {"temperature": 0, "max_new_tokens": 8}
    free = engine.generate(prompts=["Hello, K3"], sampling_params=params)[0]
    assert free["output_ids"] == _greedy_loop(base, tok.encode("Hello, K3"), 8)
    stop = tok.decode(free["output_ids"][1:3])  # text that first completes at the third token
    assert stop and stop not in tok.decode(free["output_ids"][:2])
    stopped = engine.generate(prompts=["Hello, K3"], sampling_params={**params, "stop": [stop]})[0]
    assert stopped["output_ids"] == free["output_ids"][:3]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_prefill_packs_rows_by_the_chunk_width_and_splitting_changes_nothing(base):
    """max_prefill_tokens bounds rows x padded width of each prefill forward: five 3-token prompts (2 tokens to
    prefill each) fit one forward under a budget of 10 even with a 64-token chunk; a budget of 2 needs five."""
    prompts = [[7 + i, 8, 9] for i in range(5)]
    params = {"temperature": 0, "max_new_tokens": 3}
    outputs = {}
    for budget, forwards in ((10, 1), (2, 5)):
        engine = small_engine(base, prefill_chunk=64, max_prefill_tokens=budget)
        calls = []
        engine.model.register_forward_pre_hook(lambda m, a, kw, c=calls: c.append(a[0].shape), with_kwargs=True)
        outputs[budget] = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
        prefills = [s for s in calls if s[1] > 1]  # decode steps go through model.step, not forward
        assert len(prefills) == forwards and all(s[1] == 2 for s in prefills)
    assert outputs[10] == outputs[2]


def test_filtered_requests_also_report_the_unfiltered_logprobs_of_their_tokens(base):
    """top-k: output_token_logprobs are the filtered distribution's, output_token_logprobs_unfiltered the full
    one's (what the trainer computes); requests that do not filter carry no second list."""
    res = small_engine(base).generate(input_ids=PROMPTS[:2], sampling_params=[
        {"temperature": 1.0, "top_k": 3, "max_new_tokens": 5, "sampling_seed": 1},
        {"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 2}])
    filtered, plain = res
    assert "output_token_logprobs_unfiltered" not in plain["meta_info"]
    prompt, out = PROMPTS[0], filtered["output_ids"]
    with torch.no_grad():
        logits = base(torch.tensor([prompt + out])).logits[0].float()
    for i, t in enumerate(out):
        row = logits[len(prompt) - 1 + i]
        full = torch.log_softmax(row, -1)[t].item()
        top3 = row.topk(3).values
        kept = (row[t] - torch.logsumexp(top3, 0)).item()  # renormalised over the 3 survivors
        assert filtered["meta_info"]["output_token_logprobs_unfiltered"][i] == pytest.approx(full, abs=LOGPROB_ATOL)
        assert filtered["meta_info"]["output_token_logprobs"][i][0] == pytest.approx(kept, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_num_slots_requests_run_at_once_whatever_the_decode_mode(base, decode):
    """num_slots=3: three requests decode together (4 steps for 4 tokens each), also under static decode, whose
    padding rows use a slot of their own beside the three."""
    engine = small_engine(base, num_slots=3, decode=decode)
    steps = []
    real = engine.runner.step

    def spy(rids, *args, **kw):
        steps.append(len(rids))
        return real(rids, *args, **kw)
    engine.runner.step = spy
    engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert steps == [3, 3, 3, 3]
    assert engine.num_slots == 3 and engine.kda.num_slots == 3 + (decode == "static")
    with pytest.raises(ValueError, match="n=4 samples exceed the engine's 3 state slots"):
        bad = engine.generate(input_ids=[PROMPTS[1]], sampling_params={"max_new_tokens": 2}, n=4)
        raise ValueError(bad[0]["error"])


def test_static_decode_runs_a_pool_smaller_than_a_power_of_two_and_splits_batches_over_its_largest_bucket(base):
    """A 5-slot pool (6 KDA slots with the padding rows') has no bucket of 5 among the powers of two: its own size is
    the last bucket, so 5 requests decode in one step (this raised 'batch 5 exceeds the largest decode bucket 4').
    A batch above the largest bucket (forced to 2 here, as 600 requests against 512 on a big pool) runs in steps of
    at most 2 rows; samples, logprobs and routes equal the eager engine's."""
    prompts = [[3 + i, 40 + i, 7] for i in range(5)]
    sp = {"temperature": 0, "max_new_tokens": 4}

    def run(decode, buckets=None):
        engine = small_engine(base, num_slots=5, decode=decode)
        calls = []
        if buckets is not None:
            engine.runner.graph.buckets = buckets
        if engine.runner.graph is not None:
            real = engine.runner.graph.decode
            engine.runner.graph.decode = lambda ids, *a: calls.append(len(ids)) or real(ids, *a)
        return engine.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True), calls

    want, _ = run("eager")
    whole, calls = run("static")
    assert calls == [5, 5, 5, 5]  # one step of all 5 per new token
    split, calls = run("static", buckets=(1, 2))
    assert calls == [2, 2, 1] * 4
    for got in (whole, split):
        for g, w in zip(got, want, strict=True):
            assert g["output_ids"] == w["output_ids"]
            assert torch.equal(g["meta_info"]["routed_experts"], w["meta_info"]["routed_experts"])
            for (a, _), (b, _) in zip(g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]):
                assert a == pytest.approx(b, abs=LOGPROB_ATOL)


def test_a_push_between_prefill_and_first_decode_leaves_the_prefills_version_as_the_oldest(base):
    """The prefill runs under version 0; a push (version 1) lands before the first decode step. Both samples of the
    forked group report versions [0, 1] (the fork copied its head's prefill version), so the rollout's on-policy
    check (`weight_version=min(versions)`) sees 0, not 1."""
    from miles_k3.trainer.rollouts import RolloutConfig
    from miles_k3.trainer.scoring import to_sample as _sample

    cfg = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj"])
    trainer = K3ForCausalLM(base.config, expert_format="mxfp4").eval()
    trainer.load_state_dict(base.state_dict())
    apply_lora(trainer, cfg)
    engine = small_engine(trainer, lora=cfg)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(trainer), cfg)
    real, pushed = engine.runner.decode, []

    def push_then_decode(running):
        if not pushed:
            engine.update_weights_from_tensor(lora_state_dict(trainer), lora_name="policy")
            pushed.append(engine.weight_version)
        return real(running)

    engine.runner.decode = push_then_decode
    outs = engine.generate(input_ids=[PROMPTS[0]], sampling_params={"temperature": 0, "max_new_tokens": 3}, n=2,
                           lora="policy")
    assert pushed == [1]
    assert [(o["meta_info"]["weight_version"], o["meta_info"]["weight_versions"]) for o in outs] == [(1, [0, 1])] * 2
    sample = _sample(PROMPTS[0], outs[1], 0.0, RolloutConfig())
    assert (sample.weight_version, sample.weight_version_max) == (0, 1)


def test_lora_dropout_is_off_in_the_engine(base):
    """lora.dropout is a training regulariser: the engine's adapter modules run in eval mode, so an adapter sampled
    with dropout 0.5 gives exactly the logprobs of the same adapter with none (it randomised every rollout token)."""
    params = {"temperature": 0, "max_new_tokens": 5}
    trainer = K3ForCausalLM(base.config, expert_format="mxfp4").eval()
    trainer.load_state_dict(base.state_dict())
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", "w1"])
    random_adapter(trainer, cfg, seed=2)
    tensors = lora_state_dict(trainer)

    def logprobs(dropout):
        lora = LoRAConfig(rank=4, alpha=8.0, dropout=dropout, targets=cfg.targets)
        engine = small_engine(trainer, lora=lora)
        assert not any(m.training for m in engine.model.modules())
        engine.load_lora_adapter_from_tensors("policy", tensors, lora)
        out = engine.generate(input_ids=PROMPTS, sampling_params=params, lora="policy")
        return [[lp for lp, _ in r["meta_info"]["output_token_logprobs"]] for r in out]

    assert logprobs(0.5) == logprobs(0.0)


def _bf16_adapted(targets):
    torch.manual_seed(3)
    trainer = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval()
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=targets)
    random_adapter(trainer, cfg, seed=4)
    trainer.cast(torch.bfloat16)
    return trainer, cfg


def test_engine_adapters_are_cast_and_merged_once_per_version_with_the_same_bits(monkeypatch):
    """The engine keeps its adapters in the compute dtype (and kv_b_proj's merged weight, which MLA's absorbed
    decode reads), refreshed when an adapter is bound: a bf16 decode no longer casts A and B on every call, and
    gives the same tokens and logprobs, bit for bit, as the per-call casts, before and after a push."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from miles_k3.rollout import adapters

    trainer, cfg = _bf16_adapted(["q_proj", "o_proj", "kv_b_proj", "w1", "w2"])
    params = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 5}

    class Casts(TorchDispatchMode):  # casts of the engine's adapter parameters
        n, adapter = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            x = args[0] if args else None
            if (func.overloadpacket.__name__ == "_to_copy" and isinstance(x, torch.Tensor)
                    and x.data_ptr() in Casts.adapter):
                Casts.n += 1
            return func(*args, **(kwargs or {}))

    def run():  # fuse_projections off: on, the adapted linears add their delta inside the B GEMM (another rounding)
        engine = small_engine(trainer, lora=cfg, fuse_projections=False)
        engine.load_lora_adapter_from_tensors("policy", lora_state_dict(trainer), cfg)
        Casts.adapter = {p.data_ptr() for p in lora_parameters(engine.model).values()}
        Casts.n = 0
        with Casts():
            first = engine.generate(input_ids=PROMPTS, sampling_params=params, lora="policy")
        casts = Casts.n
        with torch.no_grad():  # a push: the next bind refreshes the copies
            tensors = {n: t + 0.05 for n, t in lora_state_dict(trainer).items()}
        engine.update_weights_from_tensor(tensors, lora_name="policy")
        second = engine.generate(input_ids=PROMPTS, sampling_params=params, lora="policy")
        return casts, [[(r["output_ids"], [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]) for r in out]
                       for out in (first, second)]

    casts, kept = run()
    assert casts == 0
    monkeypatch.setattr(adapters, "attach_inference_copies", lambda model, merge_lora=False: [])
    casts_per_call, per_call = run()
    assert casts_per_call > 0  # the test sees the casts it counts
    assert kept == per_call and kept[0] != kept[1]
