"""benchmarks/bench_sglang_k3.py on the CPU: its math by hand-worked values, and its logprobs part end to end against
`tests/sglang_double.py` (NOT SGLang: the double serves its own copy of the checkpoint, so the gap is ~0 unless a
weight of that copy is changed). SGLang itself runs only in the script on the GPU."""
import functools

import pytest
import torch
from bench_module import load_benchmark
from repo_helpers import REPO

from tests.sglang_double import FakeSGLangEngine

bench = load_benchmark("bench_sglang_k3")


def test_logprob_gap_skips_sglangs_none_first_entry():
    ours = [[-1.0, -2.0], [-3.0]]
    theirs = [[None, -1.1, -2.3], [-3.2]]  # |d| 0.1, 0.3 / 0.2
    gap = bench.logprob_gap(ours, theirs)
    assert gap["mean"] == pytest.approx(0.2) and gap["max"] == pytest.approx(0.3) and gap["tokens"] == 3
    with pytest.raises(ValueError, match="SGLang positions"):
        bench.logprob_gap([[-1.0, -2.0]], [[-1.0]])


def test_greedy_and_argmax_agreement():
    g = bench.greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]])
    assert g == {"prefix_frac": 2 / 4, "overall_frac": 3 / 4, "identical": 0, "sequences": 1}
    g = bench.greedy_agreement([[5, 6], [1, 2, 3]], [[5, 6], [1, 2]])  # a missing token disagrees
    assert g["prefix_frac"] == 4 / 5 and g["overall_frac"] == 4 / 5 and g["identical"] == 1
    assert bench.argmax_agreement([[3, 4, 5, 6]], [[None, 3, 4, 0, 6]]) == 3 / 4
    assert bench.top1_ids([None, [(-0.1, 7, None), (-2.0, 3, None)]]) == [None, 7]
    assert bench.spread([[-1.0, -3.0], [-2.0]]) == pytest.approx(2 / 3)


def test_random_prompts_are_seeded_and_avoid_special_ids():
    a = bench.random_prompts(4, 50, 12, {0, 5, 11}, seed=3)
    assert a == bench.random_prompts(4, 50, 12, {0, 5, 11}, seed=3) != bench.random_prompts(4, 50, 12, {0}, seed=4)
    assert len(a) == 4 and all(len(p) == 50 for p in a)
    assert {t for p in a for t in p} <= set(range(12)) - {0, 5, 11}
    assert bench.parse_grpo("64x8:512+512") == (64, 8, 512, 512) and bench.parse_grpo("none") is None
    with pytest.raises(ValueError, match="PxN:prompt"):
        bench.parse_grpo("64x8")


def _run(k3_dir, double_model, prompts=2, greedy=2):
    argv = ["--model-dir", str(k3_dir), "--device", "cpu", "--parts", "logprobs", "--prompts", str(prompts),
            "--tokens", "16", "--greedy-tokens", str(greedy), "--budget-gib", "0.05"]
    rows = bench.run(argv, engine_cls=functools.partial(FakeSGLangEngine, model=double_model))
    return {r.get("check", r.get("engine")): r for r in rows}


def test_logprobs_part_against_the_double(k3_dir):
    """The double serves the same weights: the gap is ~0 and greedy continuations agree; one weight of its copy
    changed, the gap is clearly non-zero."""
    from miles_k3.model.weights import load_k3

    rows = _run(k3_dir, load_k3(k3_dir, "cpu", torch.float32))
    assert "error" not in rows["sglang"] and rows["sglang"]["server_args"]["enable_multimodal"] is False
    lp = rows["prompt_logprobs"]
    assert "error" not in lp and lp["tokens"] == 2 * 15 and lp["prompts"] == 2
    assert lp["mean"] < 1e-5 and lp["max"] < 1e-5 and lp["ours_spread"] > 0
    # the floor: our model against itself in fp32, which on the CPU is its own dtype (the same forward: 0 exactly)
    assert lp["floor_mean"] == lp["floor_max"] == 0.0 and lp["fp32_mean"] == lp["mean"]
    assert lp["argmax_agree"] is None  # the double returns no input_top_logprobs
    greedy = rows["greedy"]
    assert "error" not in greedy and greedy["sequences"] == 2 and greedy["overall_frac"] == 1.0

    changed = load_k3(k3_dir, "cpu", torch.float32)
    with torch.no_grad():
        changed.lm_head.weight.mul_(3.0)  # sharper logits: every log-prob moves
    rows = _run(k3_dir, changed, prompts=1, greedy=0)
    assert "greedy" not in rows  # --greedy-tokens 0: no greedy check
    lp = rows["prompt_logprobs"]
    assert lp["mean"] > 1e-3 and lp["max"] > lp["mean"]


def test_a_failing_sglang_is_a_result_not_a_crash(k3_dir):
    def broken(**args):
        raise RuntimeError("no GPU for sglang")

    rows = bench.run(["--model-dir", str(k3_dir), "--device", "cpu", "--parts", "logprobs", "--prompts", "1",
                      "--tokens", "8", "--greedy-tokens", "2", "--budget-gib", "0.05"], engine_cls=broken)
    errors = {r.get("check", r.get("engine")): r["error"] for r in rows if "error" in r}
    assert set(errors) == {"sglang", "prompt_logprobs", "greedy"} and "no GPU for sglang" in errors["greedy"]


def test_pinned_routes_send_every_token_of_every_layer_to_the_same_experts(k3_dir, tmp_path):
    """--pin-routes: the copy's routers pick, at every token of every MoE layer, exactly the experts whose selection
    bias was raised, while the unpinned model routes tokens to different experts; nothing else changed."""
    from safetensors.torch import load_file

    from miles_k3.model.routing import recording
    from miles_k3.model.weight_files import inspect_weights
    from miles_k3.model.weights import load_k3

    top_k = inspect_weights(k3_dir).config.num_experts_per_token
    pinned = bench.pin_routes(k3_dir, tmp_path / "pinned", top_k=top_k, seed=0)
    before = {k: v for f in sorted(k3_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    after = {k: v for f in sorted((tmp_path / "pinned").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(before) == set(after) and len(pinned) >= 1
    for name, t in after.items():
        if name in pinned:
            raised = ((t - before[name]) == bench.PIN_BIAS).nonzero().flatten().tolist()
            assert raised == pinned[name] and len(raised) == top_k
        else:
            assert torch.equal(t, before[name]), name
    ids = torch.tensor([[(7 * i + 3) % 200 + 1 for i in range(24)]])
    routes = {}
    for which, path in (("base", k3_dir), ("pinned", tmp_path / "pinned")):
        model = load_k3(path, "cpu", torch.float32)
        with torch.no_grad(), recording(model) as rec:
            model(ids)
        routes[which] = rec.routes().long().sort(-1).values  # [24 tokens, MoE layers, top_k]
    want = torch.tensor([pinned[n] for n in sorted(pinned, key=lambda n: int(n.split(".layers.")[1].split(".")[0]))])
    assert torch.equal(routes["pinned"], want.expand_as(routes["pinned"]))
    assert len({tuple(r.flatten().tolist()) for r in routes["base"]}) > 1  # unpinned: tokens route differently
    with pytest.raises(ValueError, match="is the model directory itself"):
        bench.pin_routes(k3_dir, k3_dir, top_k=top_k, seed=0)
    # the bench with --pin-routes: both sides load the pinned copy (the double serves the one written above; the
    # bench writes the same bytes again, same seed)
    argv = ["--model-dir", str(k3_dir), "--device", "cpu", "--parts", "logprobs", "--prompts", "1", "--tokens", "12",
            "--greedy-tokens", "0", "--budget-gib", "0.05", "--pin-routes", str(tmp_path / "pinned")]
    double = load_k3(tmp_path / "pinned", "cpu", torch.float32)
    rows = bench.run(argv, engine_cls=functools.partial(FakeSGLangEngine, model=double))
    assert rows[0]["pinned_moe_layers"] == len(pinned) and rows[0]["model_dir"] == str(tmp_path / "pinned")
    lp = next(r for r in rows if r.get("check") == "prompt_logprobs")
    assert "error" not in lp and lp["mean"] < 1e-5


def test_rounding_floor_bench_compares_bf16_with_fp32_and_serves_the_pinned_copy(k3_dir, tmp_path):
    """benchmarks/bench_rounding_floor.py: our model in bf16 against fp32 on the same prompts (a gap above 0, the
    positions of every prompt but its first token), and with --pin-routes the pinned copy."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_rounding_floor

    row = bench_rounding_floor.run(["--model-dir", str(k3_dir), "--prompts", "2", "--tokens", "12"])
    assert row["tokens"] == 2 * 11 and row["mean"] > 0 and row["max"] >= row["mean"]
    assert 0 <= row["argmax_agree"] <= 1 and row["pinned_moe_layers"] is None
    pinned = bench_rounding_floor.run(["--model-dir", str(k3_dir), "--prompts", "1", "--tokens", "12",
                                       "--pin-routes", str(tmp_path / "pinned")])
    assert pinned["model_dir"] == str(tmp_path / "pinned") and pinned["pinned_moe_layers"] >= 1


def test_sglang_captures_decode_graphs_at_the_race_batch_sizes():
    a = bench.parse_args(["--model-dir", "x", "--parts", "logprobs,race", "--batches", "1,64,256", "--grpo", "64x8:512+512"])
    assert bench.race_graphs(a) == {"cuda_graph_bs_decode": [1, 64, 256, 512], "cuda_graph_max_bs_decode": 512}
    a = bench.parse_args(["--model-dir", "x", "--parts", "race", "--batches", "4,2", "--grpo", "none"])
    assert bench.race_graphs(a) == {"cuda_graph_bs_decode": [2, 4], "cuda_graph_max_bs_decode": 4}
    assert bench.race_graphs(bench.parse_args(["--model-dir", "x", "--parts", "logprobs"])) == {}
    assert bench.race_graphs(bench.parse_args(["--model-dir", "x", "--no-cuda-graph"])) == {}


def test_data_prompts_are_a_second_set_after_the_random_ids(k3_dir, tmp_path):
    """--data adds its problems as their own rows after the random ids; --no-random leaves the data alone."""
    import json

    from miles_k3.model.weights import load_k3

    data = tmp_path / "lp.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": p, "answer": "0"}) + "\n"
                            for i, p in enumerate(["15-43-75=-103", "1+5=6", "7-2=5"])))
    double = functools.partial(FakeSGLangEngine, model=load_k3(k3_dir, "cpu", torch.float32))
    argv = ["--model-dir", str(k3_dir), "--device", "cpu", "--parts", "logprobs", "--prompts", "2", "--tokens", "16",
            "--greedy-tokens", "0", "--budget-gib", "0.05", "--data", str(data), "--template", "plain"]
    lps = [r for r in bench.run(argv, engine_cls=double) if r.get("check") == "prompt_logprobs"]
    assert [r["source"] for r in lps] == ["random", f"{data} (plain)"]
    assert [r["prompts"] for r in lps] == [2, 2] and lps[0]["tokens"] == 2 * 15
    assert all("error" not in r and r["mean"] < 1e-5 for r in lps)
    assert lps[1]["prompt_tokens"] < 16  # the two problems' own lengths, not the random ids' 16
    lps = [r for r in bench.run(argv + ["--no-random"], engine_cls=double) if r.get("check") == "prompt_logprobs"]
    assert [r["source"] for r in lps] == [f"{data} (plain)"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--model-dir", str(k3_dir), "--no-random"])
