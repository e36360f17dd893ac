"""benchmarks/census_sft_step.py: the op census of one SFT step, on k3_nano (fp32, CPU), against counts worked out
from the architecture by hand."""
import torch
from bench_module import load_benchmark

from miles_k3.model.config import K3Config
from miles_k3.trainer.batch import Sample

census = load_benchmark("census_sft_step")


def test_the_census_counts_the_steps_ops_by_phase_and_names_their_lines():
    """k3_nano: layer 0 KDA + dense MLP, layers 1-2 KDA + MoE, layer 3 MLA + MoE. Linear layers called per forward:
    8 per KDA layer (q, k, v, f_a, f_b, b, g, o: 24), 6 in the MLA layer (q_a, q_b, kv_a, kv_b, g, o), 3 in the
    dense MLP, 5 per MoE layer (the latent down and up projections, the shared expert's gate, up and down: 15) and
    the lm_head: 49. Each MoE layer groups its rows once: 3 bincounts, 3 host lists. AdamW runs its fused form
    (CUDA's: one update of every tensor of a dtype, not one per parameter)."""
    cfg = K3Config.from_name("k3_nano")
    model, params, opt, sched = census.sft_setup(cfg, torch.device("cpu"), torch.float32)
    examples = [Sample([1, 2, 3, 4], [5, 6, 7]), Sample([8, 9], [10, 11, 12, 13])]
    loss, counted = census.counted_step(model, params, opt, sched, examples, torch.device("cpu"), 0)
    figures, lines = census.summarize(counted, top=5)
    calls, aten = figures["calls"], figures["aten"]
    assert calls["forward"]["linear"] == 49
    assert aten["forward"]["bincount"] == 3 and calls["forward"]["tolist"] == 3
    sites = {r["site"] for r in figures["rows"] if r["name"] == "tolist"}
    assert len(sites) == 1 and sites.pop().startswith("miles_k3/model/experts.py:")
    assert aten["optimizer"]["_fused_adamw_"] == 2  # the decayed matrices and the rest: fp32, two groups
    assert not {"_foreach_addcdiv_", "_foreach_lerp_", "addcdiv_", "lerp_"} & aten["optimizer"].keys()
    backward_sites = [r["site"] for r in figures["rows"] if r["phase"] == "backward" and r["level"] == "aten"]
    assert any(s.startswith("MmBackward0 <- miles_k3/model/") for s in backward_sites)
    assert figures["aten_totals"]["batch"] > 0 and figures["cpu_path_left_out"]["aten forward"] > 0
    assert lines[0].startswith("aten ops per phase: batch ") and torch.isfinite(torch.tensor(loss))
