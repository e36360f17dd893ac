"""PushCopier: repeated pushes of the same tensors skip the per-tensor checks (CPU, CUDA) and run as one captured
CUDA graph (GPU), yet every push is still value-checked and all-or-nothing."""
import pytest
import torch
from kernel_testing import gpu_test

import miles_k3.rollout.push_copy as pc


def _setup(device, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(int(a), int(b)) for a, b in torch.randint(1, 50, (n, 2), generator=g)]
    buffers = {f"t{i}": torch.zeros(s, device=device) for i, s in enumerate(shapes)}
    src = {f"t{i}": torch.randn(s, generator=g).to(device) for i, s in enumerate(shapes)}
    return buffers, src


def _counting(monkeypatch):
    calls = []
    real = pc._validated
    monkeypatch.setattr(pc, "_validated", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _check(device, monkeypatch, graphs: bool):
    buffers, src = _setup(device)
    calls = _counting(monkeypatch)
    cp = pc.PushCopier(buffers, "adapter 'p'")
    for step in range(4):  # an optimizer step between pushes: the same tensors, new values
        with torch.no_grad():
            for t in src.values():
                t.add_(1.0)
        cp.copy(src)
        assert all(torch.equal(buffers[n], t) for n, t in src.items()), step
    assert len(calls) == 1  # validated once: the same objects at the same addresses afterwards
    assert (cp._graph is not None) == graphs
    before = {n: b.clone() for n, b in buffers.items()}
    name = "t17"
    with torch.no_grad():
        src[name][3 % src[name].shape[0], 0] = float("nan")
        for t in src.values():
            t.add_(1.0)
    with pytest.raises(ValueError, match=f"tensor {name} has NaN/Inf"):
        cp.copy(src)
    assert all(torch.equal(buffers[n], before[n]) for n in buffers)  # nothing copied
    with torch.no_grad():
        src[name].nan_to_num_(0.0)
    views = {n: t.detach() for n, t in src.items()}  # new objects over the same storage: re-checked once
    cp.copy(views)
    assert len(calls) == 2 and (cp._graph is not None) == graphs
    assert all(torch.equal(buffers[n], t) for n, t in src.items())
    moved = {n: t.clone() + 1 for n, t in src.items()}  # new storage: re-checked, graphs dropped
    cp.copy(moved)
    assert len(calls) == 3 and cp._graph is None
    assert all(torch.equal(buffers[n], t) for n, t in moved.items())
    with pytest.raises(ValueError, match="tensor t5 has"):
        cp.copy({**moved, "t5": moved["t5"].t().contiguous()} if moved["t5"].shape[0] != moved["t5"].shape[1]
                else {**moved, "t5": moved["t5"][:1]})
    assert all(torch.equal(buffers[n], t) for n, t in moved.items())


def test_cpu_repeated_pushes_skip_the_checks_but_not_the_values(monkeypatch):
    _check("cpu", monkeypatch, graphs=False)


@gpu_test
def test_gpu_repeated_pushes_replay_one_graph_and_stay_all_or_nothing(monkeypatch):
    _check("cuda", monkeypatch, graphs=True)
