"""The rollout engine on CUDA: CUDA-graph decode replays exactly the static step it captured (tokens, logprobs and
recorded routes), its logprobs match the trainer-side full-sequence forward, and the route log's copies to the
host are queued without a wait yet read only once they have landed. Run with `python -m pytest -m gpu tests`."""
import copy

import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.rollout.engine import EngineConfig, RolloutEngine
from miles_k3.rollout.route_log import RouteLog

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [300], list(range(40, 70))]


@pytest.fixture(scope="module")
def trainer():
    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg, kda_backend="fla", expert_format="mxfp4").cast(torch.bfloat16).eval()
    lora = LoRAConfig(rank=8, alpha=16.0, targets=["q_proj", "o_proj", "kv_b_proj", "w1", "w2", "w3"])
    apply_lora(model, lora)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model, lora


def _engine(model, lora, decode):
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=128, page_size=16,
                                               decode=decode), lora=lora)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), lora)
    return engine


def test_graph_decode_replays_the_static_step_exactly(trainer):
    model, lora = trainer
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5}
    runs = {}
    for decode in ("static", "graph"):
        engine = _engine(model, lora, decode)
        runs[decode] = [engine.generate(input_ids=PROMPTS, sampling_params=params, n=2, lora=name)
                        for name in ("policy", None)]
        assert engine.decode_mode == decode
    assert runs["graph"] == runs["static"]  # same kernels, same inputs: bitwise equal tokens and logprobs


def test_graph_decode_with_fp32_logits_replays_the_static_step_exactly(trainer):
    """model.fp32_lm_head through the captured decode graph: graph and static steps agree bitwise, and their
    log-probs are not the bf16-logit ones (the fp32 product was captured, not the bf16 lm_head)."""
    model, lora = trainer
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5}
    runs = {}
    try:
        for head in (False, True):
            model.fp32_lm_head = head
            for decode in ("static", "graph"):
                engine = _engine(model, lora, decode)
                runs[head, decode] = engine.generate(input_ids=PROMPTS, sampling_params=params, n=2,
                                                     lora="policy", return_logprob=True)
    finally:
        model.fp32_lm_head = False
    assert runs[True, "graph"] == runs[True, "static"]
    logprobs = {head: [lp for o in runs[head, "graph"] for lp, _ in o["meta_info"]["output_token_logprobs"]]
                for head in (False, True)}
    assert logprobs[True] != logprobs[False]


def test_graph_decode_with_an_fp32_residual_replays_the_static_step_exactly(trainer):
    """model.fp32_residual (with fp32 logits and without) through the captured decode graph: the fused RMSNorm's fp32
    -> bf16 output and the fp32 depth mixes were captured; graph and static steps agree bitwise, and their log-probs
    are not the bf16-residual ones."""
    model, lora = trainer
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5}
    runs = {}
    try:
        for res, head in ((False, False), (True, False), (True, True)):
            model.model.fp32_residual, model.fp32_lm_head = res, head
            for decode in ("static", "graph"):
                engine = _engine(model, lora, decode)
                runs[res, head, decode] = engine.generate(input_ids=PROMPTS, sampling_params=params, n=2,
                                                          lora="policy", return_logprob=True)
    finally:
        model.model.fp32_residual, model.fp32_lm_head = False, False
    for res, head in ((True, False), (True, True)):
        assert runs[res, head, "graph"] == runs[res, head, "static"]
    logprobs = {key: [lp for o in runs[key + ("graph",)] for lp, _ in o["meta_info"]["output_token_logprobs"]]
                for key in ((False, False), (True, False))}
    assert logprobs[True, False] != logprobs[False, False]


def test_engine_logprobs_match_the_trainer_forward(trainer):
    """Sampled tokens (temperature 1: the logprob is the raw model logprob) scored again by the trainer-side
    full-sequence forward: in fp32 (the truth) and in bf16 (fla chunk kernels, naive MLA). bf16 on this tiny
    random model (LoRA B ~ N(0, 0.2): large logits) has a real error floor, so each engine mode (graph: paged
    MLA kernel with fp32 scores; eager: bf16 einsums) must stay within 2x the bf16 trainer's own error against
    fp32 plus 0.05 nats on the same tokens; a wrong state or position costs whole nats."""
    model, lora = trainer
    model32 = copy.deepcopy(model).cast(torch.float32)
    params = {"temperature": 1.0, "max_new_tokens": 10, "sampling_seed": 3}
    report = {}
    for decode in ("graph", "eager"):
        engine = _engine(model, lora, decode)
        assert engine.decode_mode == decode
        res = engine.generate(input_ids=PROMPTS, sampling_params=params, lora="policy")
        engine_err = trainer_err = 0.0
        for prompt, r in zip(PROMPTS, res):
            ids = torch.tensor([prompt + r["output_ids"]], device="cuda")
            got = torch.tensor([lp for lp, _ in r["meta_info"]["output_token_logprobs"]])
            with torch.no_grad():
                ref32, ref16 = (torch.log_softmax(m(ids).logits[0].float(), -1)[len(prompt) - 1:-1]
                                .gather(1, ids[0, len(prompt):, None])[:, 0].cpu() for m in (model32, model))
            engine_err = max(engine_err, (got - ref32).abs().max().item())
            trainer_err = max(trainer_err, (ref16 - ref32).abs().max().item())
        report[decode] = {"engine_vs_fp32": engine_err, "bf16_trainer_vs_fp32": trainer_err}
    print("max |logprob error| against the fp32 trainer forward:", report)
    for decode, r in report.items():
        assert r["engine_vs_fp32"] <= 2 * r["bf16_trainer_vs_fp32"] + 0.05, report


def test_cuda_graph_tag_frees_the_graph_pool_and_recaptures(trainer):
    """release_memory_occupation(["cuda_graph"]) drops the captured graphs and returns their memory pool to the
    device; after resume the graphs are captured again and the samples repeat (tokens exactly)."""
    model, lora = trainer
    engine = _engine(model, lora, "graph")
    params = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 11}
    before = engine.generate(input_ids=PROMPTS, sampling_params=params, n=3, lora="policy")
    assert engine.runner.graph._graphs
    torch.cuda.synchronize()
    pool = tuple(engine.runner.graph._pool)

    def pool_segments():  # the segments the allocator holds for the graphs' private pool, by their pool id
        return [s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool]

    held, reserved = pool_segments(), torch.cuda.memory_reserved()
    engine.release_memory_occupation(["cuda_graph"])
    freed = reserved - torch.cuda.memory_reserved()
    print(f"cuda_graph release returned {freed / 2**20:.1f} MiB to the device; the pool held {len(held)} segments "
          f"({sum(held) / 2**20:.1f} MiB), {len(pool_segments())} left")
    assert not engine.runner.graph._graphs and held and not pool_segments()
    assert freed >= sum(held)
    engine.resume_memory_occupation(["cuda_graph"])
    after = engine.generate(input_ids=PROMPTS, sampling_params=params, n=3, lora="policy")
    assert engine.runner.graph._graphs
    assert [r["output_ids"] for r in after] == [r["output_ids"] for r in before]


def test_graph_decode_records_the_static_steps_routes(trainer):
    """return_routed_experts through captured graphs (routes stacked in the graph, copied to the host without a
    wait, one step's buffer overwritten by the next replay) gives the routes of the eager static step, bitwise,
    and the same samples."""
    model, lora = trainer
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 7}
    runs = {}
    for decode in ("static", "graph"):
        engine = _engine(model, lora, decode)
        runs[decode] = engine.generate(input_ids=PROMPTS, sampling_params=params, n=2, lora="policy",
                                       return_routed_experts=True)
        assert engine.decode_mode == decode
    for i, (g, s) in enumerate(zip(runs["graph"], runs["static"])):
        assert g["output_ids"] == s["output_ids"], i
        rg, rs = g["meta_info"]["routed_experts"], s["meta_info"]["routed_experts"]
        assert rg.device.type == "cpu" and rg.shape[0] == len(PROMPTS[i // 2]) + len(g["output_ids"]) - 1
        assert torch.equal(rg, rs), (i, (rg != rs).any(-1).any(-1).nonzero().flatten().tolist())


def test_route_log_queues_its_copies_and_reads_them_only_once_landed():
    """An append into blocks already allocated returns while its copy still waits behind earlier GPU work (the
    event not reached); the source overwritten right after on the same stream (as the next graph replay does)
    does not reach the log; gather and wait read the rows as they were when appended."""
    log = RouteLog(block_rows=4)
    rows = torch.arange(8 * 2 * 3, device="cuda", dtype=torch.int16).view(8, 2, 3)
    want = rows.cpu()
    assert log.append(rows[:6]) == 0  # rows 0-5: allocates both pinned blocks
    assert len(log.blocks) == 2 and all(b.is_pinned() for b in log.blocks)
    log.wait()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spinning ahead of the next copies
    src = rows[6:].clone()
    assert log.append(src) == 6  # rows 6-7 into block 1
    pending = not log._event.query()
    host = log.to_host(src)
    src.fill_(-1)  # queued after the copies: must not reach the log
    assert pending, "append waited for the GPU"
    assert torch.equal(log.gather([0, 5, 6, 7]), want[[0, 5, 6, 7]])  # waits for the copies
    log.wait()
    assert torch.equal(host, want[6:])
    log.clear()
    assert log.num_rows == 0 and not log.blocks


def test_an_fp32_run_with_replay_has_no_gap_beyond_fp32_rounding(tmp_path):
    """The embedded default in fp32 on CUDA with routing replay and KDA in torch on both sides (no TF32 anywhere):
    the trainer computes in fp32 as the engine decodes (trainer.autocast_bf16=off, the default), so every step's
    train/rollout_logprob_abs_diff is fp32 rounding, < 1e-5 nats/token (H200, SFT'd k3_m2: 3.1e-7), and no token's
    own top-k differs from the engine's. Under bf16 autocast (the old default for an fp32 model) it was ~6e-3.
    The problems come from a local file (a GPU host need not have reasoning_gym)."""
    import json
    import subprocess
    import sys

    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": f"{i % 50} + {(7 * i) % 40} - {i % 9}",
                                        "answer": str(i % 50 + (7 * i) % 40 - i % 9)}) + "\n" for i in range(64)))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "miles_k3.train", "device=cuda", "steps=3", "eval.every_n_steps=0",
                           f"data.source={data}", "data.problem_field=null", "data.task_args={}",
                           "model.dtype=fp32", "model.kda_backend=torch_chunk", "trainer.routing_replay=true",
                           f"run_dir={run_dir}"], check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "train/rollout_logprob_abs_diff" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["train/rollout_logprob_abs_diff"] < 1e-5, rows
        assert r["train/route_mismatch_frac"] == 0.0, rows
