"""Kept state in the native engine (`generate(keep_state=..., states=...)`, `rollout/kept_state.py`) on k3_tiny
(fp32, CPU, eager decode): a multi-turn conversation whose turns continue on the kept KDA state and latent pages
gives the tokens, routes and (within LOGPROB_ATOL) log-probs of re-prefilling the whole conversation every turn, and
prefills only each turn's new tokens (hand-counted). Parked states give way when the pools are short, a push or a
memory release makes the next turn recompute, and bad continuations are refused naming the kept state."""
import pytest
import torch
from engine_helpers import random_adapter, small_engine

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
    random_adapter(m, LORA, seed=1)
    return m


def _engine(model, **kw) -> RolloutEngine:
    engine = small_engine(model, LORA, **{"decode": "eager", "eos_token_ids": [], **kw})
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
        engine.release_states([r["meta_info"]["state_id"] for r in first[1:]])
    for k, obs in enumerate(OBS, start=2):
        ids = ids + obs
        states = [turns[-1]["meta_info"]["state_id"]] if keep else None
        (out,) = engine.generate(input_ids=[ids], sampling_params=_params(k), keep_state=keep, states=states,
                                 **kw)
        assert "error" not in out, out
        turns.append(out)
        ids = ids + out["output_ids"]
    return turns, ids


def _assert_same_turns(got, want, atol=LOGPROB_ATOL):
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert max(abs(a - b) for (a, _), (b, _) in zip(gl, wl)) < atol
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
    assert full.kept_state_stats["prefill_tokens"] == 33 and kept.kept_state_stats["prefill_tokens"] == 10
    s = kept.kept_state_stats
    assert (s["parked"], s["continued"], s["kept_tokens"], s["dropped"], s["recomputed"]) == (4, 2, 23, 0, 0)
    assert [t["meta_info"]["cached_tokens"] for t in got[1:]] == [8, 15]
    assert [t["meta_info"]["state_id"] for t in got] == [0, 0, 0]
    assert not _pools_free(kept)  # the last turn's state is parked ...
    kept.release_states([0])
    assert _pools_free(kept)  # ... until its kept state is released
    assert [t["meta_info"]["routed_experts"].shape[0] for t in got] == [8, 15, 22]  # every position but the last


def test_parked_states_give_way_when_slots_are_short_and_the_conversation_recomputes(model):
    """Two slots: the first turn's two samples park both; a new two-sample prompt takes their slots (both give way,
    oldest first); kept state 0's next turn recomputes its whole conversation: the same tokens as a full re-prefill."""
    want, _ = _conversation(_engine(model), keep=False)
    engine = _engine(model, num_slots=2)
    first = engine.generate(input_ids=[PROMPT], sampling_params=_params(1), n=2, lora="policy", keep_state=True,
                            return_routed_experts=True)
    engine.generate(input_ids=[[7, 8, 9]], sampling_params=_params(9), n=2, lora="policy")
    assert engine.kept_state_stats["dropped"] == 2 and _pools_free(engine)
    ids = PROMPT + first[0]["output_ids"] + OBS[0]
    before = engine.kept_state_stats["prefill_tokens"]
    (out,) = engine.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", keep_state=True,
                             states=[0], return_routed_experts=True)
    assert engine.kept_state_stats["prefill_tokens"] - before == len(ids) - 1 == 11
    assert engine.kept_state_stats["recomputed"] == 1 and out["meta_info"]["state_id"] == 0
    _assert_same_turns([first[0], out], want[:2])


PROMPTS = [[1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]]
SLOT_BYTES = 6 * (4 * 32 * 32 * 4 + 384 * 3 * 4)
"""k3_tiny's KDA state per request: 6 KDA layers x (recurrent 4 heads x 32 x 32 fp32 + conv window 384 channels x 3
fp32) = 125,952 bytes."""


@pytest.fixture(scope="module")
def four_reprefilled(model):
    return _four_conversations(_engine(model), keep=False)


def _four_conversations(engine, keep: bool):
    """Four one-sample prompts, then a second turn of all four in one call; returns both turns, the kept-state
    counters after turn 1 and the positions turn 2 prefilled."""
    kw = {"lora": "policy", "return_routed_experts": True, "keep_state": keep}
    first = engine.generate(input_ids=PROMPTS, sampling_params=_params(1), **kw)
    after_first = dict(engine.kept_state_stats)
    ids = [p + r["output_ids"] + OBS[0] for p, r in zip(PROMPTS, first)]
    before = engine.kept_state_stats["prefill_tokens"]
    second = engine.generate(input_ids=ids, sampling_params=_params(2), states=[0, 1, 2, 3] if keep else None,
                             **kw)
    return first, second, after_first, engine.kept_state_stats["prefill_tokens"] - before


@pytest.mark.parametrize("budget_slots, turn1, turn2", [
    (4, (2, 0), (6, 4, 0, 0, 4, 12)),
    (2, (2, 0), (4, 2, 2, 2, 2, 28)),
    (0, (0, 2), (0, 0, 6, 4, 0, 44)),
])
def test_more_conversations_than_slots_snapshot_their_states_or_drop_them_and_match_a_full_reprefill(
        model, four_reprefilled, budget_slots, turn1, turn2):
    """Two slots, four conversations, a snapshot budget of `budget_slots` states. Hand run: turn 1 admits states 0
    and 1, which park; 2 and 3 take their slots (the oldest first), snapshotting (turn1 = (snapshotted, dropped)) or, with
    no budget, dropping them. Turn 2 continues all four in one call: 0 and 1 (queued first) take the slots that 2 and
    3 hold (from the back: 3, then 2), which snapshot while the budget has room (2 states are counted already:
    0's and 1's, until restored) and are dropped otherwise; 0 and 1 restore (or recompute), park, and give their
    slots to 2 and 3 the same way. turn2 = (snapshotted, restored, dropped, recomputed, continued in all, turn-2
    prefill). A continued turn prefills 3 positions (the last sampled token and the observation but its last), a
    recomputed one 5 + 4 + 3 - 1 = 11. Either way the tokens, routes and (within EPISODE_ATOL: the reference runs
    the four in one batch, these two at a time) log-probs of re-prefilling every turn."""
    want1, want2, _, full_prefill = four_reprefilled
    engine = _engine(model, num_slots=2, state_snapshot_bytes=budget_slots * SLOT_BYTES)
    got1, got2, s1, prefill = _four_conversations(engine, keep=True)
    for g in zip(got1, got2):
        assert "error" not in g[1], g[1]
    for i in range(4):
        _assert_same_turns([got1[i], got2[i]], [want1[i], want2[i]], EPISODE_ATOL)
    assert full_prefill == 4 * 11
    assert (s1["snapshotted"], s1["dropped"]) == turn1
    assert s1["snapshot_bytes"] == turn1[0] * SLOT_BYTES
    s = engine.kept_state_stats
    assert (s["snapshotted"], s["restored"], s["dropped"], s["recomputed"], s["continued"], prefill) == turn2
    assert s["kept_tokens"] == 8 * s["continued"]  # 5 + 4 - 1 positions each
    assert s["snapshot_bytes"] == (2 * SLOT_BYTES if budget_slots else 0)  # 0 and 1, snapshotted for 2 and 3
    engine.release_states([0, 1, 2, 3])
    assert _pools_free(engine) and engine.kept_state_stats["snapshot_bytes"] == 0


def test_kept_states_snapshot_within_the_budget_and_free_them_once():
    """KeptStates alone, with counting pools: four parked states, a budget of two snapshots of 10 bytes."""
    from miles_k3.rollout.kept_state import KeptStates, Parked

    slots, pages, copies = [], [], []
    store = KeptStates(slots.append, pages.append, lambda slot: copies.append(slot) or [f"state of {slot}"],
                       slot_bytes=10, snapshot_budget=20)
    for sid in range(4):
        assert store.new_id() == sid
        store.park(sid, Parked(rid=100 + sid, slot=sid, tokens=[1, 2, 3], versions={0}, lora=None, record=False))
    assert store.num_parked_slots == 4
    assert store.give_slot() and store.give_slot() and store.give_slot()  # 0, 1 snapshotted; 2 dropped (no room)
    assert (copies, slots, pages) == ([0, 1], [0, 1, 2], [102])
    assert (store.stats.snapshotted, store.stats.dropped, store.stats.snapshot_bytes) == (2, 1, 20)
    assert store.num_parked == 3 and store.num_parked_slots == 1 and store.peek(2) is None
    assert store.peek(0).snapshot == ["state of 0"] and store.peek(0).slot is None
    assert store.give_way()  # short pages: the oldest parked goes, snapshot and all
    assert (pages, store.stats.snapshot_bytes, store.stats.dropped) == ([102, 100], 10, 2)
    p = store.claim(1)  # its snapshot goes with the turn, still counted until restored or freed
    assert p.snapshot == ["state of 1"] and store.stats.snapshot_bytes == 10
    store.free(p)  # a stale state: freed, its bytes returned
    assert (pages[-1], store.stats.snapshot_bytes) == (101, 0)
    store.release(3)
    assert (slots[-1], pages[-1], store.num_parked) == (3, 103, 0)
    assert not store.give_slot() and not store.give_way()
    store.park(1, Parked(rid=101, slot=1, tokens=[1, 2], versions={0}, lora=None, record=False))
    assert store.give_slot() and store.stats.snapshot_bytes == 10
    store.forget_states()  # the pools were released: the snapshot goes with its pages
    assert store.stats.snapshot_bytes == 0 and store.num_parked == 0 and store.known(1)


@pytest.mark.parametrize("overrides, message", [
    (["engine.state_snapshot_bytes=-1"], r"must be >= 0 \(0: no snapshots\), got -1$"),
    (["engine.backend=sglang", "model.hf_path=/ckpt/qwen3", "engine.state_snapshot_bytes=1024"],
     r"does nothing with backend=sglang .* use backend=native$"),
])
def test_bad_snapshot_budgets_are_refused_naming_the_field(overrides, message):
    from miles_k3.config import ConfigFieldError, compose_config

    with pytest.raises(ConfigFieldError, match=r"^engine.state_snapshot_bytes: " + message):
        compose_config("train", overrides)


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
    (got,) = a.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", states=[0],
                        return_routed_experts=True)
    (want,) = b.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", return_routed_experts=True)
    _assert_same_turns([first, got], [ref1, want])
    assert a.kept_state_stats["recomputed"] == 1 and a.kept_state_stats["continued"] == 0
    assert "state_id" not in got["meta_info"] and _pools_free(a)  # continued without keep_state: it ended
    with pytest.raises(ValueError, match="kept state 0 is not open"):
        a.release_states([0])


def test_a_memory_release_forgets_the_states_and_their_turns_recompute(model):
    engine = _engine(model)
    (first,) = engine.generate(input_ids=[PROMPT], sampling_params=_params(1), lora="policy", keep_state=True)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert _pools_free(engine)
    ids = PROMPT + first["output_ids"] + OBS[0]
    (out,) = engine.generate(input_ids=[ids], sampling_params=_params(2), lora="policy", keep_state=True,
                             states=[0])
    assert "error" not in out and engine.kept_state_stats["recomputed"] == 1


def test_bad_continuations_are_refused_naming_the_kept_state_and_the_rest_are_served(model):
    engine = _engine(model)
    (first,) = engine.generate(input_ids=[PROMPT], sampling_params=_params(1), lora="policy", keep_state=True)
    ids = PROMPT + first["output_ids"]
    changed = [9] + ids[1:] + OBS[0]
    out = engine.generate(input_ids=[changed, ids, PROMPT, ids + OBS[0]], sampling_params=_params(2),
                          lora="policy", keep_state=True, states=[0, 0, 41, None])
    assert "does not extend kept state 0's tokens (they differ from position 0 of 9)" in out[0]["error"]
    assert "adds no token" in out[1]["error"]
    assert "kept state 41 is not open" in out[2]["error"]
    assert "error" not in out[3] and out[3]["meta_info"]["state_id"] == 1  # a new kept state
    (two,) = engine.generate(input_ids=[ids + OBS[0]], sampling_params=_params(2), n=2, lora="policy",
                             states=[0])[:1]
    assert "takes n=1" in two["error"]
    again = engine.generate(input_ids=[ids + OBS[0]] * 2, sampling_params=_params(2), lora="policy",
                            keep_state=True, states=[0, 0])
    assert "error" not in again[0] and "kept state 0 has a turn running" in again[1]["error"]
    with pytest.raises(ValueError, match="one entry per prompt"):
        engine.generate(input_ids=[ids], states=[0, 1])


def test_guess_episodes_on_kept_state_equal_recomputed_ones_and_prefill_only_the_observations(model):
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
        assert _pools_free(engine)  # every episode's kept state released
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


def _gpu_model():
    """k3_tiny in bf16 on CUDA with fla's KDA kernels and a random LoRA."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(K3Config.from_name("k3_tiny"), kda_backend="fla", expert_format="mxfp4")
        model = model.cast(torch.bfloat16).eval().requires_grad_(False)
    apply_lora(model, LORA)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model


def _gpu_engine(model, **kw) -> RolloutEngine:
    e = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=64, page_size=16,
                                          decode="graph", eos_token_ids=[], **kw), lora=LORA)
    e.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    return e


def _forward_gaps(model, prompt: list[int], turns: list[dict], ids: list[int]) -> list[float]:
    """|engine log-prob - teacher-forced bf16 forward| of every sampled token of a conversation `ids` whose turns
    `turns` followed `prompt`, each turn but the last followed by the observation OBS[k]."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
    pos, gap = len(prompt), []
    for k, t in enumerate(turns):
        for j, (lp, tok) in enumerate(t["meta_info"]["output_token_logprobs"]):
            assert tok == ids[pos + j]
            gap.append(abs(lp - ref[pos + j - 1, tok].item()))
        pos += NEW + (len(OBS[k]) if k < len(turns) - 1 else 0)
    assert pos == len(ids)
    return gap


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_state_turns_under_cuda_graph_decode_score_like_a_full_forward():
    """k3_tiny in bf16 with fla's KDA kernels and CUDA-graph decode: the three-turn conversation on kept state
    prefills the hand-counted 10 tokens (re-prefill: 33), and every sampled token's engine log-prob matches a
    teacher-forced forward of the whole final conversation as closely as the re-prefilled conversation's do (bf16
    samples drift apart between the two modes, so each is checked against its own forward)."""
    model = _gpu_model()
    gaps = {}
    for keep in (True, False):
        e = _gpu_engine(model)
        turns, ids = _conversation(e, keep=keep)
        assert e.kept_state_stats["prefill_tokens"] == (10 if keep else 33)
        gaps[keep] = _forward_gaps(model, PROMPT, turns, ids)
    print(f"max |engine - forward| log-prob: kept {max(gaps[True]):.4f}, re-prefill {max(gaps[False]):.4f}")
    assert max(gaps[True]) < GPU_LOGPROB_ATOL and max(gaps[False]) < GPU_LOGPROB_ATOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshotted_states_under_cuda_graph_decode_score_like_a_full_forward():
    """The four-conversations-on-two-slots run (hand counts as in the CPU test: 6 snapshots, 4 restores, turn 2
    prefilling 4 x 3 positions) in bf16 under CUDA-graph decode: states copied to the host and back into the pools
    the captured graphs read; every sampled token's log-prob within GPU_LOGPROB_ATOL of a teacher-forced forward of
    its conversation."""
    model = _gpu_model()
    e = _gpu_engine(model, num_slots=2, state_snapshot_bytes=64 * 2**20)
    first, second, _, prefill = _four_conversations(e, keep=True)
    s = e.kept_state_stats
    assert (s["snapshotted"], s["restored"], s["dropped"], s["recomputed"], prefill) == (6, 4, 0, 0, 12)
    gaps = [g for p, a, b in zip(PROMPTS, first, second)
            for g in _forward_gaps(model, p, [a, b], p + a["output_ids"] + OBS[0] + b["output_ids"])]
    print(f"max |engine - forward| log-prob over 4 snapshotted states: {max(gaps):.4f}")
    assert max(gaps) < GPU_LOGPROB_ATOL
