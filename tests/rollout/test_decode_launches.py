"""Work the engine's static decode step does once per step instead of once per layer: the pool row of each
request's new MLA position and its attention length (the same for every MLA layer: one page table, one page
size), by hand and counted in a step of k3_tiny (3 MLA layers); the KDA slot column made contiguous once. Static decode's samples equal eager decode's
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


def test_a_static_step_hands_every_kda_layer_contiguous_slots(monkeypatch):
    """The slot column of the packed step input has a row stride of 3 + pages; the step makes it contiguous once,
    so the KDA decode kernels (which need unit stride) do not each copy it (k3_tiny: 6 KDA layers, batch 3)."""
    from miles_k3.model.kda import KDAAttention

    seen = []
    pooled = KDAAttention._pooled_step

    def record(self, x, backend, state):
        seen.append(state.slots_B.is_contiguous())
        return pooled(self, x, backend, state)

    monkeypatch.setattr(KDAAttention, "_pooled_step", record)
    torch.manual_seed(0)
    engine = small_engine(K3ForCausalLM(K3Config.from_name("k3_tiny")).eval(), decode="static")
    engine.generate(input_ids=[[1, 2, 3], [4, 5], [6]], sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert seen and all(seen) and len(seen) % 6 == 0, seen
