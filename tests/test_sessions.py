"""Sessions in the native engine (`generate(keep_state=..., sessions=...)`, `rollout/sessions.py`) on k3_tiny (fp32,
CPU, eager decode): a multi-turn conversation whose turns continue on the kept KDA state and latent pages gives the
tokens, routes and (within LOGPROB_ATOL) log-probs of re-prefilling the whole conversation every turn, and
prefills only each turn's new tokens (hand-counted). Parked states give way when the pools are short, a push or a
memory release makes the next turn recompute, and bad continuations are refused naming the session."""
import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.rollout.engine import EngineConfig, RolloutEngine

LORA = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "w1"])
PROMPT = [1, 2, 3, 4, 5]
OBS = [[200, 201, 202], [210, 211, 212]]  # the observations after turns 1 and 2
NEW = 4  # max_new_tokens, no stop token: every turn samples exactly 4
LOGPROB_ATOL = 1e-5  # fp32: the kept state and the re-prefill compute the same positions in other chunkings
EPISODE_ATOL = 5e-5  # the same over episodes of up to 128 tokens (seen: 1.4e-5)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval().requires_grad_(False)
    with torch.no_grad():  # non-zero AttnRes queries so the mixers are exercised
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    apply_lora(m, LORA)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_parameters(m).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _engine(model, **kw) -> RolloutEngine:
    cfg = {"memory_budget_bytes": 4 * 2**20, "max_context": 64, "page_size": 4, "prefill_chunk": 4,
           "decode": "eager", "eos_token_ids": [], **kw}
    engine = RolloutEngine(model, EngineConfig(**cfg), lora=LORA)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    engine.empty_pools = (engine.kda.num_free, engine.cache.num_free_pages)  # a static decoder holds a padding slot
    return engine


def _params(turn: int) -> dict:
    return {"temperature": 1.0, "max_new_tokens": NEW, "sampling_seed": 100 + turn}


def _conversation(engine, keep: bool, n_first: int = 2):
    """Three turns of sample 0 of a first turn of n_first samples (the others closed or never kept); returns the
    turns' records and the conversation's tokens."""
    kw = {"lora": "policy", "return_routed_experts": True}
    first = engine.generate(input_ids=[PROMPT], sampling_params=_params(1), n=n_first, keep_state=keep, **kw)
    turns, ids = [first[0]], PROMPT + first[0]["output_ids"]
    if keep:
        engine.close_sessions([r["meta_info"]["session_id"] for r in first[1:]])
    for k, obs in enumerate(OBS, start=2):
        ids = ids + obs
        sessions = [turns[-1]["meta_info"]["session_id"]] if keep else None
        (out,) = engine.generate(input_ids=[ids], sampling_params=_params(k), keep_state=keep, sessions=sessions,
                                 **kw)
        assert "error" not in out, out
        turns.append(out)
        ids = ids + out["output_ids"]
    return turns, ids


def _assert_same_turns(got, want):
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert max(abs(a - b) for (a, _), (b, _) in zip(gl, wl)) < LOGPROB_ATOL
        assert torch.equal(g["meta_info"]["routed_experts"], w["meta_info"]["routed_experts"])


def _pools_free(engine) -> bool:
    return (engine.kda.num_free, engine.cache.num_free_pages) == engine.empty_pools


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_turns_on_kept_state_equal_a_full_reprefill_and_prefill_only_the_new_tokens(model, decode):
    """Hand count. Re-prefill: turn 1 prefills the 5-token prompt but its last (4), turn 2 the 5 + 4 + 3 = 12
    tokens but the last (11), turn 3 12 + 4 + 3 = 19 but the last (18): 33. Kept state: 4, then only what the state
    does not cover: the previous turn's last sampled token and the observation but its last token (3 each): 10; the
    continued turns skip 8 and 15 kept positions."""
    want, want_ids = _conversation(full := _engine(model), keep=False)
    got, got_ids = _conversation(kept := _engine(model, decode=decode), keep=True)
    _assert_same_turns(got, want)
    assert got_ids == want_ids and len(got_ids) == 5 + 3 * NEW + 6
    assert full.session_stats["prefill_tokens"] == 33 and kept.session_stats["prefill_tokens"] == 10
    s = kept.session_stats
    assert (s["parked"], s["continued"], s["kept_tokens"], s["dropped"], s["recomputed"]) == (4, 2, 23, 0, 0)
    assert [t["meta_info"]["cached_tokens"] for t in got[1:]] == [8, 15]
    assert [t["meta_info"]["session_id"] for t in got] == [0, 0, 0]
    assert not _pools_free(kept)  # the last turn's state is parked ...
    kept.close_sessions([0])
    assert _pools_free(kept)  # ... until its session is closed
    assert [t["meta_info"]["routed_experts"].shape[0] for t in got] == [8, 15, 22]  # every position but the last


def test_parked_states_give_way_when_slots_are_short_and_the_session_recomputes(model):
    """Two slots: the first turn's two samples park both; a new two-sample prompt takes their slots (both give way,
    oldest first); session 0's next turn recomputes its whole conversation: the same tokens as a full re-prefill."""
    want, _ = _conversation(_engine(model), keep=False)
    engine = _engine(model, num_slots=2)
    first = engine.generate(input_ids=[PROMPT], sampling_params=_params(1), n=2, lora="policy", keep_state=True,
                            return_routed_experts=True)
    engine.generate(input_ids=[[7, 8, 9]], sampling_params=_params(9), n=2, lora="policy")
    assert engine.session_stats["dropped"] == 2 and _pools_free(engine)
    ids = PROMPT + first[0]["output_ids"] + OBS[0]
    before = engine.session_stats["prefill_tokens"]
    (out,) = engine.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", keep_state=True,
                             sessions=[0], return_routed_experts=True)
    assert engine.session_stats["prefill_tokens"] - before == len(ids) - 1 == 11
    assert engine.session_stats["recomputed"] == 1 and out["meta_info"]["session_id"] == 0
    _assert_same_turns([first[0], out], want[:2])


def test_a_push_between_turns_recomputes_under_the_new_weights(model):
    """A push changes the weights: the kept state (computed by the old ones) is not reused; the turn equals a
    re-prefill in an engine that got the same push."""
    push = {k: v * 1.5 for k, v in lora_state_dict(model).items()}
    a, b = _engine(model), _engine(model)
    (first,) = a.generate(input_ids=[PROMPT], sampling_params=_params(1), lora="policy", keep_state=True,
                          return_routed_experts=True)
    (ref1,) = b.generate(input_ids=[PROMPT], sampling_params=_params(1), lora="policy", return_routed_experts=True)
    for e in (a, b):
        e.update_weights_from_tensor(push, lora_name="policy")
    ids = PROMPT + first["output_ids"] + OBS[0]
    (got,) = a.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", sessions=[0],
                        return_routed_experts=True)
    (want,) = b.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", return_routed_experts=True)
    _assert_same_turns([first, got], [ref1, want])
    assert a.session_stats["recomputed"] == 1 and a.session_stats["continued"] == 0
    assert "session_id" not in got["meta_info"] and _pools_free(a)  # continued without keep_state: it ended
    with pytest.raises(ValueError, match="session 0 is not open"):
        a.close_sessions([0])


def test_a_memory_release_forgets_the_states_and_the_sessions_recompute(model):
    engine = _engine(model)
    (first,) = engine.generate(input_ids=[PROMPT], sampling_params=_params(1), lora="policy", keep_state=True)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert _pools_free(engine)
    ids = PROMPT + first["output_ids"] + OBS[0]
    (out,) = engine.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", keep_state=True,
                             sessions=[0])
    assert "error" not in out and engine.session_stats["recomputed"] == 1


def test_bad_continuations_are_refused_naming_the_session_and_the_rest_are_served(model):
    engine = _engine(model)
    (first,) = engine.generate(input_ids=[PROMPT], sampling_params=_params(1), lora="policy", keep_state=True)
    ids = PROMPT + first["output_ids"]
    changed = [9] + ids[1:] + OBS[0]
    out = engine.generate(input_ids=[changed, ids, PROMPT, ids + OBS[0]], sampling_params=_params(2),
                          lora="policy", keep_state=True, sessions=[0, 0, 41, None])
    assert "does not extend session 0's tokens (they differ from position 0 of 9)" in out[0]["error"]
    assert "adds no token" in out[1]["error"]
    assert "session 41 is not open" in out[2]["error"]
    assert "error" not in out[3] and out[3]["meta_info"]["session_id"] == 1  # a new session
    (two,) = engine.generate(input_ids=[ids + OBS[0]], sampling_params=_params(2), n=2, lora="policy",
                             sessions=[0])[:1]
    assert "takes n=1" in two["error"]
    again = engine.generate(input_ids=[ids + OBS[0]] * 2, sampling_params=_params(2), lora="policy",
                            keep_state=True, sessions=[0, 0])
    assert "error" not in again[0] and "session 0 has a turn running" in again[1]["error"]
    with pytest.raises(ValueError, match="one entry per prompt"):
        engine.generate(input_ids=[ids], sessions=[0, 1])


def test_guess_episodes_as_sessions_equal_recomputed_ones_and_prefill_only_the_observations(model):
    """collect_rollouts with env=guess on the real engine, keep_state on and off: the same samples (tokens, masks;
    log-probs within LOGPROB_ATOL). Prefill counted from the samples' own structure: each group prefills its prompt
    but the last token once; after that a kept-state turn prefills the previous turn's last token and the
    observation but its last (= the observation's length), a recomputed turn everything before it but the last.
    Log-probs within EPISODE_ATOL."""
    from miles_k3.envs.env import EnvConfig, build_env
    from miles_k3.evals.problems import Problem
    from miles_k3.evals.rewards import RewardResult
    from miles_k3.model.tokenizer import small_tokenizer
    from miles_k3.trainer.rollouts import PromptStream, RolloutConfig, collect_rollouts

    tok = small_tokenizer(512)
    problems = [Problem(f"g{i}", f"Guess my number from 1 to 9: {i}", str(i)) for i in range(1, 3)]
    rcfg = RolloutConfig(prompts_per_step=2, group_size=2, template="plain", dynamic_sampling=False,
                         max_new_tokens=NEW)

    def run(keep: bool):
        engine = _engine(model, max_context=128)
        env_cfg = EnvConfig(name="guess", max_turns=3, keep_state=keep)
        samples, m = collect_rollouts(engine, tok, PromptStream(problems, 0), lambda r, g: [
            RewardResult(0.0, False, {}) for _ in r], rcfg, "policy", env=(build_env(env_cfg), env_cfg))
        assert _pools_free(engine)  # every episode's session closed
        return samples, m

    (kept, mk), (full, mf) = run(True), run(False)
    for a, b in zip(kept, full, strict=True):
        assert (a.prompt_ids, a.response_ids, a.loss_mask) == (b.prompt_ids, b.response_ids, b.loss_mask)
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) < EPISODE_ATOL
    turns = [[i for i in range(len(s.loss_mask)) if s.loss_mask[i] and (i == 0 or not s.loss_mask[i - 1])]
             for s in kept]  # where each turn's tokens start in the response
    assert sum(map(len, turns)) > len(kept)  # the episodes went past one turn
    first = sum(len(s.prompt_ids) - 1 for s in kept[::2])
    want_kept = first + sum(_obs_before(s.loss_mask, t) for s, ts in zip(kept, turns) for t in ts[1:])
    want_full = first + sum(len(s.prompt_ids) + t - 1 for s, ts in zip(kept, turns) for t in ts[1:])
    n = len(kept)
    assert mk["env/prefill_tokens_mean"] == pytest.approx(want_kept / n)
    assert mf["env/prefill_tokens_mean"] == pytest.approx(want_full / n)
    assert mk["env/kept_tokens_mean"] > 0 and mf["env/kept_tokens_mean"] == 0.0


def _obs_before(mask: list[int], t: int) -> int:
    """The length of the observation that ends right before position t (the zeros of the mask before it)."""
    k = t
    while k > 0 and mask[k - 1] == 0:
        k -= 1
    return t - k


GPU_LOGPROB_ATOL = 0.1  # bf16: engine log-probs vs a bf16 teacher-forced forward, at any sampled position


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_state_turns_under_cuda_graph_decode_score_like_a_full_forward():
    """k3_tiny in bf16 with fla's KDA kernels and CUDA-graph decode: the three-turn conversation on kept state
    prefills the hand-counted 10 tokens (re-prefill: 33), and every sampled token's engine log-prob matches a
    teacher-forced forward of the whole final conversation as closely as the re-prefilled conversation's do (bf16
    samples drift apart between the two modes, so each is checked against its own forward)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(K3Config.from_name("k3_tiny"), kda_backend="fla", expert_format="mxfp4")
        model = model.cast(torch.bfloat16).eval().requires_grad_(False)
    apply_lora(model, LORA)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.2)

    def engine():
        e = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=64, page_size=16,
                                              decode="graph", eos_token_ids=[]), lora=LORA)
        e.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
        return e

    gaps = {}
    for keep in (True, False):
        e = engine()
        turns, ids = _conversation(e, keep=keep)
        assert e.session_stats["prefill_tokens"] == (10 if keep else 33)
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
        ref = torch.log_softmax(logits, -1)
        pos, gap = len(PROMPT), []
        for k, t in enumerate(turns):
            for j, (lp, tok) in enumerate(t["meta_info"]["output_token_logprobs"]):
                assert tok == ids[pos + j]
                gap.append(abs(lp - ref[pos + j - 1, tok].item()))
            pos += NEW + (len(OBS[k]) if k < len(OBS) else 0)
        assert pos == len(ids)
        gaps[keep] = gap
    print(f"max |engine - forward| log-prob: kept {max(gaps[True]):.4f}, re-prefill {max(gaps[False]):.4f}")
    assert max(gaps[True]) < GPU_LOGPROB_ATOL and max(gaps[False]) < GPU_LOGPROB_ATOL
