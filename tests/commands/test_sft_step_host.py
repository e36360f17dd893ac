"""The SFT run's host work, made cheaper without changing what it trains on: the examples tokenized in two batched
calls (`sft_examples.encode_batch`: the same ids as one `encode` per text, as the RL rollouts tokenize), one host read of
the step's loss after its backward (a non-finite loss still skips the update), and a fused AdamW on CUDA."""
import math

import pytest
import torch

from miles_k3.evals.problems import DatasetError, Problem
from miles_k3.model.build import ModelConfig, build_model, build_tokenizer
from miles_k3.sft import build_full_optimizer, sft_backward
from miles_k3.sft_examples import encode_batch
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.optim import OptimConfig, build_scheduler, optimizer_step

OPTIM = OptimConfig(lr=1e-3, betas=[0.9, 0.95], weight_decay=0.01, grad_clip=1.0)


def test_batched_encoding_gives_the_ids_of_one_encode_per_text():
    tok, stop = build_tokenizer(ModelConfig(name="k3_nano"))
    problems = [Problem("a", "a=3, b=-4. Sum them.", "a=3\n3 + b=-4 = -1\nAnswer: -1"),
                Problem("b", "x", "7"), Problem("c", "Total of 12 and 30?", "Answer: 42")]
    samples = encode_batch(problems, "plain", tok, stop[0])
    assert [tok.decode(s.prompt_ids) for s in samples] == [p.problem for p in problems]
    assert [tok.decode(s.response_ids[:-1]) for s in samples] == [p.answer for p in problems]
    assert all(s.response_ids[-1] == stop[0] for s in samples)
    for p, s in zip(problems, samples):
        assert s.prompt_ids == tok.encode(p.problem, add_special_tokens=False)
        assert s.response_ids == tok.encode(p.answer, add_special_tokens=False) + [stop[0]]
    assert encode_batch([], "plain", tok, stop[0]) == []


def test_an_empty_prompt_is_refused_naming_its_problem():
    tok, stop = build_tokenizer(ModelConfig(name="k3_nano"))
    with pytest.raises(DatasetError, match="problem empty-one: its prompt under template 'plain' is empty"):
        encode_batch([Problem("fine", "1+1", "2"), Problem("empty-one", "", "3")], "plain", tok, stop[0])


def test_a_nan_loss_is_read_after_the_backward_and_the_update_is_skipped():
    model = build_model(ModelConfig(name="k3_nano", experts="bf16", dtype="fp32"), torch.device("cpu"),
                        torch.float32, seed=0).requires_grad_(True)
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["lm_head.weight"][5].fill_(math.nan)  # one NaN logit: every position's log-softmax is NaN
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = build_full_optimizer(params, OPTIM)
    sched = build_scheduler(opt, OPTIM)
    examples = [Sample([1, 2, 2], [3, 4]), Sample([7, 8], [9])]
    loss, tokens = sft_backward(model, examples, 0, torch.device("cpu"), micro_batch_tokens=6)  # two micro-batches
    assert math.isnan(loss) and tokens == 4 + 2  # the input positions: all ids but the last of each
    assert any(not torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)  # it ran
    metrics = optimizer_step(opt, sched, params, OPTIM, loss=loss)
    assert metrics["train/skipped"] == 1.0 and math.isnan(metrics["train/grad_norm"])
    assert all(torch.equal(p.detach(), before[n]) or n == "lm_head.weight" for n, p in params.items())
    assert all(p.grad is None for p in params.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_cuda_optimizer_steps_as_the_foreach_one():
    """Three updates of the same parameters and gradients: the fused AdamW that build_full_optimizer takes on CUDA
    against torch's foreach one over the same groups. In fp32, so that a wrong lr, beta, eps or decay group (each
    moves a parameter by ~1e-4 or more here; the decay alone 0.5 x lr 1e-3 x |p|) shows above the implementations'
    rounding."""
    cuda = torch.device("cuda")
    optim = OptimConfig(lr=1e-3, betas=[0.9, 0.95], weight_decay=0.5, grad_clip=1.0)
    gen = torch.Generator(device=cuda)
    shapes = [(256, 128), (128,), (64, 64, 8)]
    runs = []
    for fused in (True, False):
        params = {f"p{i}": torch.nn.Parameter(torch.randn(s, generator=gen.manual_seed(i), device=cuda))
                  for i, s in enumerate(shapes)}
        opt = build_full_optimizer(params, optim)
        assert opt.defaults["fused"] is True
        if not fused:  # the same groups, torch's foreach implementation
            groups = [{"params": group["params"], "weight_decay": group["weight_decay"]}
                      for group in opt.param_groups]
            opt = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, foreach=True)
            assert not any(group["fused"] for group in opt.param_groups)
        for step in range(3):
            for i, p in enumerate(params.values()):
                p.grad = torch.randn(p.shape, generator=gen.manual_seed(100 * step + i), device=cuda)
            opt.step()
        runs.append([p.detach().clone() for p in params.values()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_log_window_counts_the_kernels_compiled_in_its_steps(monkeypatch, tmp_path):
    """SFT's log line and perf/triton_new: Triton cache directories added during the window's steps (by hand: one
    kernel in the first step, two in the third); a window that could not count has no figure."""
    import triton

    from miles_k3.sft import _compiled, _Window
    from miles_k3.utils.runtime import CompileCounter

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    (tmp_path / "old").mkdir()
    counter, window = CompileCounter(True), _Window()
    metrics = {"train/skipped": 0.0, "train/lr": 1e-3, "train/grad_norm": 1.0}
    for new in (["k1"], [], ["k2", "k3"]):
        for key in new:
            (tmp_path / key).mkdir()
            (tmp_path / key / f"kernel_{key}.json").write_text("{}")
            (tmp_path / key / f"__grp__kernel_{key}.json").write_text("{}")
        count = counter.take()
        window.add(1.0, metrics, 100, 0.5, count, counter.names if count else [])
    assert window.kernels == ["kernel_k1", "kernel_k2", "kernel_k3"]
    kernels = window.kernels
    row = window.flush()
    assert row["perf/triton_new"] == 3.0 and row["perf/tokens_per_s"] == 200.0
    assert _compiled(row["perf/triton_new"], kernels) == ", compiled 3 Triton kernels (kernel_k1, kernel_k2, kernel_k3)"
    assert _compiled(3.0, kernels, show=2) == ", compiled 3 Triton kernels (kernel_k1, kernel_k2, ...)"
    assert _compiled(0.0, []) == ""
    window.add(1.0, metrics, 100, 0.5, CompileCounter(False).take())  # off CUDA: not counted
    assert "perf/triton_new" not in window.flush()
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "absent"))
    assert counter.take() is None and counter.take() is None  # the cache went away


def test_heldout_forwards_take_the_reference_kernels_and_restore_the_choice(monkeypatch):
    """Nothing is compiled for a held-out measurement: every RMSNorm in its forwards sees the fused kernels
    switched off (`reference_kernels`), and the process's choice is back on afterwards."""
    from miles_k3.model import layers
    from miles_k3.sft import heldout_figures

    model = build_model(ModelConfig(name="k3_nano", experts="bf16", dtype="fp32"), torch.device("cpu"),
                        torch.float32, seed=0)
    seen, forward = [], layers.RMSNorm.forward

    def spy(self, *args, **kwargs):
        seen.append(layers.fused_kernels_active())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(layers.RMSNorm, "forward", spy)
    assert layers.fused_kernels_active()
    figures = heldout_figures(model, [Sample([1, 2], [3, 4]), Sample([5], [6])], 0, torch.device("cpu"))
    assert seen and not any(seen) and layers.fused_kernels_active()
    assert 0.0 <= figures["sft/heldout_exact"] <= 1.0
