"""Work the engine's static decode step does once per step instead of once per layer: the pool row of each
request's new MLA position and its attention length (the same for every MLA layer: one page table, one page
size), by hand and counted in a step of k3_tiny (3 MLA layers). Static decode's samples equal eager decode's
(tests/rollout/test_engine.py), which computes them per layer from the contiguous cache."""
import collections

import torch
from engine_helpers import small_engine

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.mla import paged_rows


def test_paged_rows_by_hand():
    # page size 4; request 0 at position 5: page index 1 -> page 9, row 9 * 4 + 1 = 37; request 1 at position 2:
    # page index 0 -> page 2, row 2 * 4 + 2 = 10
    table = torch.tensor([[5, 9], [2, 7]])
    assert paged_rows(table, torch.tensor([5, 2]), 4).tolist() == [37, 10]


def test_a_static_step_computes_the_mla_rows_once(monkeypatch):
    """The step computes the rows once (`rollout.graph_decode`) and no MLA layer computes them again."""
    from miles_k3.model import mla
    from miles_k3.rollout import graph_decode

    calls = collections.Counter()

    def counting(where):
        def rows(table, positions, page_size):
            calls[where] += 1
            return paged_rows(table, positions, page_size)
        return rows

    monkeypatch.setattr(graph_decode, "paged_rows", counting("step"))
    monkeypatch.setattr(mla, "paged_rows", counting("layer"))
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny")).eval()
    assert sum(layer.is_mla for layer in model.model.layers) == 3
    engine = small_engine(model, decode="static")
    graph = engine.runner.graph
    step = graph._step

    def counted_step(packed):
        calls["steps"] += 1
        return step(packed)

    graph._step = counted_step
    out = engine.generate(input_ids=[[1, 2, 3]], sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert len(out[0]["output_ids"]) == 4 and calls["steps"] >= 3
    assert calls == {"steps": calls["steps"], "step": calls["steps"]}  # once per step, never per layer
