"""`FusedProjections`: linears that read one input as one GEMM (+ one over their adapters' A, one over their B
block-diagonal), on hand-worked values: outputs, sections as views, merged adapters, refresh, when it serves, and
the groups it refuses; and a single adapted linear adding its delta inside its B GEMM (`add_in_gemm`). The engine's
use of them: tests/rollout/test_fuse_projections.py."""
import pytest
import torch
from torch import nn

from miles_k3.model.fused_projections import FusedProjections
from miles_k3.model.lora import InferenceCopies, LoRALinear

# a: W [[1, 2], [3, 4]], A [[1, -1]], B [[0.5], [1]]; b: W [[-1, 1]] (no adapter); c: W [[2, 0]], A [[0, 1]], B [[3]];
# s = alpha / r = 2 / 1. Rows x = [1, 2] and [0, -1]:
#   a = W x + s B (A x): [5, 11] + 2 [0.5, 1] (-1) = [4, 9];   [-2, -4] + 2 [0.5, 1] (1) = [-1, -2]
#   b = [1], [-1]
#   c = 2 + 2 * 3 * 2 = 14;   0 + 2 * 3 * (-1) = -6
X = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
SECTION_AB = torch.tensor([[4.0, 9.0, 1.0], [-1.0, -2.0, -1.0]])
SECTION_C = torch.tensor([[14.0], [-6.0]])


def _linear(weight, a=None, b=None, alpha: float = 2.0) -> nn.Linear:
    base = nn.Linear(len(weight[0]), len(weight), bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.tensor(weight))
    if a is None:
        return base
    m = LoRALinear(base, rank=len(a), alpha=alpha)
    with torch.no_grad():
        m.lora_A.weight.copy_(torch.tensor(a))
        m.lora_B.weight.copy_(torch.tensor(b))
    return m


def _abc(alpha_c: float = 2.0):
    return (_linear([[1.0, 2.0], [3.0, 4.0]], [[1.0, -1.0]], [[0.5], [1.0]]), _linear([[-1.0, 1.0]]),
            _linear([[2.0, 0.0]], [[0.0, 1.0]], [[3.0]], alpha=alpha_c))


@torch.no_grad()
def test_one_gemm_for_the_base_and_two_for_the_adapters_by_hand():
    a, b, c = _abc()
    group = FusedProjections([(a, b), (c,)])
    assert group.widths == [3, 1] and group.scale == 2.0
    torch.testing.assert_close(group.weight, torch.tensor([[1.0, 2.0], [3.0, 4.0], [-1.0, 1.0], [2.0, 0.0]]))
    torch.testing.assert_close(group.a, torch.tensor([[1.0, -1.0], [0.0, 1.0]]))  # A of a, then of c
    # B block-diagonal: a's rows read a's rank, b's row nothing, c's row c's rank
    torch.testing.assert_close(group.b, torch.tensor([[0.5, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 3.0]]))
    ab, cc = group(X)
    torch.testing.assert_close(ab, SECTION_AB, rtol=0, atol=0)
    torch.testing.assert_close(cc, SECTION_C, rtol=0, atol=0)
    assert ab.data_ptr() + 3 * 4 == cc.data_ptr() and ab.stride() == (4, 1)  # views into one [N, 4] output
    for m, want in ((a, SECTION_AB[:, :2]), (b, SECTION_AB[:, 2:]), (c, SECTION_C)):  # the linears agree
        torch.testing.assert_close(m(X), want, rtol=0, atol=0)


@torch.no_grad()
def test_leading_dims_are_kept():
    group = FusedProjections([_abc()[:2], _abc()[2:]])
    ab, cc = group(X.view(2, 1, 2))
    assert ab.shape == (2, 1, 3) and cc.shape == (2, 1, 1)
    torch.testing.assert_close(ab[:, 0], SECTION_AB, rtol=0, atol=0)


@torch.no_grad()
def test_merged_adapters_enter_with_their_merged_weight_and_no_adapter_gemms():
    a, b, c = _abc()
    for m in (a, c):
        InferenceCopies.attach(m, torch.float32, forward_merged=True)
    group = FusedProjections([(a, b), (c,)])
    # W + s B A: a [[1, 2], [3, 4]] + 2 [[0.5, -0.5], [1, -1]] = [[2, 1], [5, 2]]; c [[2, 0]] + 2 [[0, 3]] = [[2, 6]]
    torch.testing.assert_close(group.weight, torch.tensor([[2.0, 1.0], [5.0, 2.0], [-1.0, 1.0], [2.0, 6.0]]))
    assert group.a is None and group.b is None
    ab, cc = group(X)
    torch.testing.assert_close(ab, SECTION_AB, rtol=0, atol=0)
    torch.testing.assert_close(cc, SECTION_C, rtol=0, atol=0)


@torch.no_grad()
def test_refresh_rereads_the_adapters_in_place():
    a, b, c = _abc()
    group = FusedProjections([(a, b), (c,)])
    addresses = [t.data_ptr() for t in (group.weight, group.a, group.b)]
    c.lora_B.weight.fill_(1.0)  # c = 2 + 2 * 1 * 2 = 6 for x = [1, 2]
    assert group(X)[1][0, 0].item() == 14.0  # not seen until refreshed
    group.refresh()
    assert group(X)[1][0, 0].item() == 6.0
    assert [t.data_ptr() for t in (group.weight, group.a, group.b)] == addresses  # graphs keep reading them


def test_serves_only_a_decode_step_without_grad_in_its_dtype_with_every_adapter_enabled():
    a, b, c = _abc()
    group = FusedProjections([(a, b), (c,)])
    step = X.view(2, 1, 2)  # a decode step's input: one token per request
    with torch.no_grad():
        assert group.serves(step)
        assert not group.serves(X) and not group.serves(X.view(1, 2, 2))  # not one token per request
        assert not group.serves(step.double())
        a.enabled = False  # `adapters_disabled`: a LoRALinear computes its base alone
        assert not group.serves(step)
        a.enabled = True
    assert not group.serves(step)  # autograd on: the trainer's forward


def test_refuses_groups_it_cannot_compute_as_one():
    a, b, c = _abc()
    with pytest.raises(ValueError, match="share In"):
        FusedProjections([(a, _linear([[1.0, 2.0, 3.0]]))])
    with_bias = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="no bias"):
        FusedProjections([(a, with_bias)])
    with pytest.raises(ValueError, match="at least one linear"):
        FusedProjections([(a,), ()])
    with pytest.raises(ValueError, match=r"scales \[2.0, 4.0\]"):
        FusedProjections([(a,), (_abc(alpha_c=4.0)[2],)])
    InferenceCopies.attach(a, torch.float32, forward_merged=True)
    with pytest.raises(ValueError, match="some adapters of the group are merged and some not"):
        FusedProjections([(a, b), (c,)])


@torch.no_grad()
def test_an_adapted_linear_adds_its_delta_inside_the_b_gemm_by_hand():
    a = _abc()[0]
    InferenceCopies.attach(a, torch.float32)
    a.inference_copies.add_in_gemm = True
    torch.testing.assert_close(a(X), SECTION_AB[:, :2], rtol=0, atol=0)  # [4, 9] and [-1, -2] as above
    torch.testing.assert_close(a(X.view(2, 1, 2))[:, 0], SECTION_AB[:, :2], rtol=0, atol=0)
    with torch.enable_grad():  # the trainer's forward (autograd on) never takes it
        y = a(X.clone().requires_grad_())
        assert y.grad_fn is not None and y.grad_fn.name() != "AddmmBackward0"
        torch.testing.assert_close(y.detach(), SECTION_AB[:, :2], rtol=0, atol=0)
