"""The scale-out base: `parallel:` config refusals, the process groups of a launch, the autograd collectives
(hand-worked values on 2 gloo ranks), gradient sums and the global gradient norm, and the errors of a
rendezvous nobody answers and of a collective a peer never joins (both name the rank)."""
import socket
import time

import pytest
import torch
from dist_helpers import run_ranks

from miles_k3.model.config import K3Config
from miles_k3.model.parallelize import check_mesh
from miles_k3.parallel.config import ParallelConfig, ParallelConfigError


def _tiny() -> K3Config:
    from miles_k3.model.build import ModelConfig, load_k3_config
    return load_k3_config(ModelConfig(name="k3_tiny"))


@pytest.mark.parametrize("fields, message", [
    ({"dp": 0}, "parallel.dp: must be an integer >= 1, got 0"),
    ({"tp": 2, "ep": 4}, "parallel.ep: 4 does not divide the dp x tp = 1 x 2 = 2 ranks"),
    ({"timeout_s": 0}, "parallel.timeout_s: must be > 0"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ParallelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**fields).validate()


def test_a_mesh_that_does_not_divide_the_model_names_the_dimension():
    cfg = _tiny()  # 4 KDA heads, 4 MLA heads, vocab 512, 16 experts
    with pytest.raises(ParallelConfigError, match=r"parallel.tp: 3 does not divide the model's KDA heads .* = 4; "
                                                  r"use a tp among \[1, 2, 4\]"):
        check_mesh(cfg, tp=3, ep=1)
    with pytest.raises(ParallelConfigError, match=r"parallel.ep: 3 does not divide the model's num_experts = 16"):
        check_mesh(cfg, tp=1, ep=3)
    check_mesh(cfg, tp=4, ep=8)  # divides: no error


def test_the_world_size_must_be_the_product():
    with pytest.raises(ParallelConfigError, match=r"parallel.dp x parallel.tp = 2 x 2 = 4 but torchrun started 2 "
                                                  r"processes"):
        ParallelConfig(dp=2, tp=2).check_world(2, launched=True)
    with pytest.raises(ParallelConfigError, match=r"not started by torchrun .* torchrun --nproc-per-node 2"):
        ParallelConfig(dp=2).check_world(1, launched=False)


def test_one_process_is_the_single_context_and_starts_nothing(monkeypatch):
    from miles_k3.parallel.mesh import SINGLE, init_parallel
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_parallel(ParallelConfig(), "cpu") is SINGLE
    assert not torch.distributed.is_initialized()


def _collectives(rank: int):
    from miles_k3.parallel import comm, grads
    from miles_k3.parallel.mesh import init_parallel
    ctx = init_parallel(ParallelConfig(dp=1, tp=2, ep=2), "cpu")
    out = {"name": ctx.name(), "groups": (ctx.dp_group is None, ctx.tp_group is None, ctx.ep_group is None,
                                          ctx.expert_replica_group is None)}
    # split -> scale by (rank + 1) -> gather: rows 0-1 on rank 0 (x1), row 2 on rank 1 (x2)
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    z = comm.gather_from(comm.split_to(x, ctx.tp_group, 0) * (rank + 1), ctx.tp_group, 0, total=3)
    (z * torch.tensor([[1.0], [2.0], [3.0]])).sum().backward()
    out["gathered"], out["split_grad"] = z.tolist(), x.grad.tolist()
    # copy_to / reduce_from: y = reduce(w_r * copy(a)) with w = (2, 5): y = 7a; dy/da summed over ranks = 7
    a = torch.tensor([1.0, -1.0], requires_grad=True)
    y = comm.reduce_from(comm.copy_to(a, ctx.tp_group) * (2.0 if rank == 0 else 5.0), ctx.tp_group)
    y.sum().backward()
    out["reduced"], out["copy_grad"] = y.tolist(), a.grad.tolist()
    # all_to_all: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0 and none to itself
    send = [1, 2] if rank == 0 else [3, 0]
    recv = comm.exchange_counts(torch.tensor(send), ctx.ep_group).tolist()
    rows = (torch.arange(float(sum(send))) + 10 * rank).unsqueeze(1).requires_grad_()
    got = comm.all_to_all(rows, recv, send, ctx.ep_group)
    (got * (torch.arange(float(got.shape[0])) + 1).unsqueeze(1)).sum().backward()
    out["recv"], out["a2a"], out["a2a_grad"] = recv, got[:, 0].tolist(), rows.grad[:, 0].tolist()
    # gradient sums: p default (dp: a group of one here), q summed over tp; norm with q sharded over tp
    p, q = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    grads.mark_grad_groups(q, "dp", "tp")
    p.grad, q.grad = torch.full((2,), float(rank + 1)), torch.full((2,), float(rank + 1))
    # u: a gradient on rank 0 only (nothing reached it on rank 1): rank 1 takes part with zeros
    u = torch.zeros(3, requires_grad=True)
    grads.mark_grad_groups(u, "tp")
    u.grad = torch.ones(3) if rank == 0 else None
    grads.reduce_gradients([p, u, q], ctx)
    out["p_grad"], out["q_grad"], out["u_grad"] = p.grad.tolist(), q.grad.tolist(), u.grad.tolist()
    grads.mark_sharded(q, "tp")
    out["norm"] = float(grads.global_grad_norm([p, q], ctx))
    return out


@pytest.mark.slow
def test_collectives_on_two_ranks_hand_worked():
    r0, r1 = run_ranks(2, _collectives)
    assert (r0["name"], r1["name"]) == ("rank 0 (dp 0, tp 0, ep 0)", "rank 1 (dp 0, tp 1, ep 1)")
    assert r0["groups"] == (True, False, False, True)  # dp and expert-replica groups of one are None
    for r in (r0, r1):
        assert r["gathered"] == [[0.0, 1.0], [2.0, 3.0], [8.0, 10.0]]
        # d/dx of sum(c_i z_i): rank 0 owns rows 0-1 (scale 1, c = 1, 2), rank 1 row 2 (scale 2, c = 3)
        assert r["split_grad"] == [[1.0, 1.0], [2.0, 2.0], [6.0, 6.0]]
        assert r["reduced"] == [7.0, -7.0] and r["copy_grad"] == [7.0, 7.0]
    assert (r0["recv"], r1["recv"]) == ([1, 3], [2, 0])
    assert r0["a2a"] == [0.0, 10.0, 11.0, 12.0] and r1["a2a"] == [1.0, 2.0]
    # each row's gradient is its position weight at the receiver, sent back to its source
    assert r0["a2a_grad"] == [1.0, 1.0, 2.0] and r1["a2a_grad"] == [2.0, 3.0, 4.0]
    for r in (r0, r1):
        assert r["q_grad"] == [3.0, 3.0]  # 1 + 2 over tp
        assert r["u_grad"] == [1.0, 1.0, 1.0]
    assert r0["p_grad"] == [1.0, 1.0] and r1["p_grad"] == [2.0, 2.0]  # dp group of one: untouched
    # rank 0: p (1, 1) + q shards over tp (3, 3) on each of 2 ranks: sqrt(2 + 36) = sqrt(38)
    assert r0["norm"] == pytest.approx(38 ** 0.5) and r1["norm"] == pytest.approx((8 + 36) ** 0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rendezvous_nobody_answers_fails_naming_the_rank(monkeypatch):
    from miles_k3.parallel.mesh import init_parallel
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1: could not join the process group \(gloo, MASTER_ADDR=127.0.0.1"):
        init_parallel(ParallelConfig(dp=2, timeout_s=2), "cpu")
    assert time.monotonic() - t0 < 30


def test_restarts_that_would_share_one_store_are_refused_at_start(monkeypatch):
    """torchrun --max-restarts whose agent hands every attempt its one store (TORCHELASTIC_USE_AGENT_STORE=True:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset) is refused on every rank with one line, before any process group;
    with a store per attempt (the variable set: USE_AGENT_STORE=False) or without restarts the group starts (here
    it fails to join, reported as it is)."""
    from miles_k3.parallel import mesh
    started = []
    monkeypatch.setattr(mesh.dist, "init_process_group", lambda *a, **k: started.append(1) or (_ for _ in ()).throw(
        RuntimeError("Gloo connectFullMesh failed: Connection refused")))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ParallelConfigError) as err:
            mesh.init_parallel(ParallelConfig(dp=2, timeout_s=2), "cpu")
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"rank {rank}: torchrun --max-restarts 1 with one rendezvous")
        assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
    assert started == []  # refused before the group
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the variable set: a store per attempt
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(RuntimeError, match="Connection refused$"):  # the failure as it is, no hint
        mesh.init_parallel(ParallelConfig(dp=2, timeout_s=2), "cpu")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restarts: a shared store is harmless
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(RuntimeError, match="Connection refused$"):
        mesh.init_parallel(ParallelConfig(dp=2, timeout_s=2), "cpu")
    assert len(started) == 2


def _one_rank_skips_a_collective(rank: int):
    from miles_k3.parallel.comm import all_reduce_
    from miles_k3.parallel.mesh import init_parallel, naming_rank
    ctx = init_parallel(ParallelConfig(dp=2, timeout_s=3), "cpu")
    if rank == 1:
        time.sleep(8)  # never joins; stays alive past rank 0's timeout
        return "skipped"
    try:
        with naming_rank(ctx):
            all_reduce_(torch.ones(1), ctx.dp_group)
    except Exception as err:  # noqa: BLE001 - the test reports whatever the collective raised
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_collective_a_peer_never_joins_times_out_naming_the_rank():
    r0, _ = run_ranks(2, _one_rank_skips_a_collective)
    assert r0.startswith("rank 0 (dp 0, tp 0, ep 0): "), r0
    assert "timed out" in r0.lower(), r0  # gloo: "Timed out waiting 3000ms for recv operation to complete"
