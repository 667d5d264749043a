"""Split, Concat and View in training (issue 22): ONNX Runtime has training versions of them
(SplitTraining takes the split sizes as a tensor input, ConcatTraining also outputs each input's
length along the axis, so that SplitGrad / ConcatGrad can cut or join the gradient; View's
gradient is a reshape). torch's autograd keeps those sizes in the graph node itself, and the ops'
forward and backward already make no copy beyond the one a gradient needs. These tests show it
with the aten calls each backward makes (a TorchDispatchMode records them) and the storage the
results live in, so trainops adds no ops for them.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Calls(TorchDispatchMode):
    """The aten overloads run inside the mode, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_concat_backward_is_views_of_the_gradient():
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    out = torch.cat([a, b], dim=1)
    dy = torch.randn_like(out)
    with Calls() as calls:
        da, db = torch.autograd.grad(out, (a, b), dy)
    assert calls.names == ["slice.Tensor", "slice.Tensor"], calls.names     # no copy kernel
    assert same_memory(da, dy) and same_memory(db, dy)
    assert torch.equal(da, dy[:, :3]) and torch.equal(db, dy[:, 3:])


def test_split_forward_is_views_and_its_backward_one_write():
    x = torch.randn(6, 8, requires_grad=True)
    with Calls() as calls:
        p, q = torch.split(x, [2, 4], dim=0)
    assert calls.names == ["split_with_sizes.default"]
    assert same_memory(p, x) and same_memory(q, x) and q.storage_offset() == 16
    dp, dq = torch.randn_like(p), torch.randn_like(q)
    with Calls() as calls:
        (dx,) = torch.autograd.grad((p, q), x, (dp, dq))
    # one kernel writes the gradient of x (its memory must exist): the minimum, as SplitGrad's concat
    assert calls.names == ["cat.default"], calls.names
    assert torch.equal(dx, torch.cat([dp, dq]))


def test_split_with_an_unused_part_gets_zeros_there():
    x = torch.randn(6, 8, requires_grad=True)
    p, _ = torch.split(x, [2, 4], dim=0)
    dp = torch.randn_like(p)
    (dx,) = torch.autograd.grad(p, x, dp)
    assert torch.equal(dx[:2], dp) and torch.equal(dx[2:], torch.zeros(4, 8))


def test_view_and_reshape_backward_are_views():
    x = torch.randn(6, 8, requires_grad=True)
    v = x.view(4, 12)
    assert same_memory(v, x)
    dv = torch.randn(4, 12)
    with Calls() as calls:
        (dx,) = torch.autograd.grad(v, x, dv)
    assert same_memory(dx, dv) and calls.names == ["view.default"], calls.names
    # a reshape that cannot be a view copies in the forward (as any framework must), never backward
    r = x.t().reshape(48)
    assert not same_memory(r, x)
    dr = torch.randn(48)
    with Calls() as calls:
        (dx,) = torch.autograd.grad(r, x, dr)
    assert same_memory(dx, dr) and "copy_.default" not in calls.names and "clone.default" not in calls.names, \
        calls.names
    assert torch.equal(dx, dr.view(8, 6).t())
