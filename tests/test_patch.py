"""trainops.patch: shared modules, weight tying, hooks, module state and attributes, refusals, the report."""

import copy
import functools
import inspect
import importlib

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError

patch_module = importlib.import_module("trainops.patch")  # the name trainops.patch is the function

SWAPPABLE = [
    (lambda: torch.nn.Softmax(dim=-1), trainops.nn.Softmax),
    (lambda: torch.nn.LogSoftmax(dim=-1), trainops.nn.LogSoftmax),
    (lambda: torch.nn.Embedding(10, 4, padding_idx=1), trainops.nn.Embedding),
    (lambda: torch.nn.CrossEntropyLoss(weight=torch.rand(6) + 0.5, label_smoothing=0.1), trainops.nn.CrossEntropyLoss),
]
SWAPPABLE_IDS = ["Softmax", "LogSoftmax", "Embedding", "CrossEntropyLoss"]


def sample_inputs(module):
    """Arguments for one call of a module of one of the swappable kinds (float inputs require grad)."""
    torch.manual_seed(1)
    if isinstance(module, torch.nn.Embedding):
        return (torch.randint(0, module.num_embeddings, (7,)),)
    if isinstance(module, torch.nn.CrossEntropyLoss):
        return torch.randn(5, 6, requires_grad=True), torch.randint(0, 6, (5,))
    return (torch.randn(3, 6, requires_grad=True),)


def by_identity(named_tensors):
    """name -> id(tensor): compares which objects sit under which names (== on tensors compares values)."""
    return {name: id(t) for name, t in named_tensors}


def call_and_backward(module, *args, **kwargs):
    with trainops.backend("cpu"):
        out = module(*args, **kwargs)
        out.float().square().sum().backward()
    return out


class TinyLM(torch.nn.Module):
    """Embedding tied to the head, attention softmax shared by both blocks, LogSoftmax, loss."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width, padding_idx=0)
        self.softmax = torch.nn.Softmax(dim=-1)
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict(dict(
            qk=torch.nn.Linear(width, 2 * width), attend=self.softmax)) for _ in range(2)])
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.log_probs = torch.nn.LogSoftmax(dim=-1)
        self.loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for block in self.blocks:
            q, k = block["qk"](h).chunk(2, dim=-1)
            h = h + block["attend"](q @ k.transpose(-1, -2) / 4.0) @ h
        logp = self.log_probs(self.head(h))
        return self.loss(logp.flatten(0, 1), targets.flatten())


def lm_batch(vocab=11):
    torch.manual_seed(2)
    return torch.randint(0, vocab, (2, 5)), torch.randint(0, vocab, (2, 5))


# ----------------------------------------------------------------------------------------------
# Issue 16 item 7: a module reachable under several names stays one module
# ----------------------------------------------------------------------------------------------

def test_a_shared_module_stays_one_module_under_every_name():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Softmax(dim=-1)
            self.b = self.a
            self.inner = torch.nn.Sequential(torch.nn.Identity(), self.a)
            self.layers = torch.nn.ModuleList([self.a, self.a])
            self.table = torch.nn.ModuleDict(dict(x=self.a))

    model = Model()
    held = model.a
    report = trainops.patch(model)
    every = [model.a, model.b, model.inner[1], model.layers[0], model.layers[1], model.table["x"]]
    assert all(m is held for m in every)
    assert type(held) is trainops.nn.Softmax
    assert report.swapped == [("a", "torch.nn.Softmax", "trainops.nn.Softmax")]
    assert report.other_names == {"a": ("b", "inner.1", "layers.0", "layers.1", "table.x")}
    assert str(report).splitlines()[1] == (
        "  a (same module as b, inner.1, layers.0, layers.1, table.x): torch.nn.Softmax -> trainops.nn.Softmax")


def test_a_shared_module_at_two_depths_and_a_refused_shared_module_are_reported_once():
    shared_sparse = torch.nn.Embedding(4, 2, sparse=True)
    shared_loss = torch.nn.CrossEntropyLoss()
    model = torch.nn.Sequential(shared_loss, torch.nn.Sequential(torch.nn.Sequential(shared_loss, shared_sparse)),
                                shared_sparse)
    report = trainops.patch(model)
    assert model[0] is model[1][0][0] and type(model[0]) is trainops.nn.CrossEntropyLoss
    assert report.swapped == [("0", "torch.nn.CrossEntropyLoss", "trainops.nn.CrossEntropyLoss")]
    assert [name for name, *_ in report.skipped] == ["1.0.1"]
    assert report.other_names == {"0": ("1.0.0",), "1.0.1": ("2",)}
    assert "1.0.1 (same module as 2): Embedding kept (sparse=True" in str(report)


def test_a_module_held_outside_the_model_is_the_patched_module():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LogSoftmax(dim=-1))
    elsewhere = {"log_probs": model[1]}
    trainops.patch(model)
    assert elsewhere["log_probs"] is model[1] and type(model[1]) is trainops.nn.LogSoftmax


def test_a_module_containing_its_ancestor_is_walked_without_going_round():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Softmax(dim=-1)))
    model[0].add_module("up", model)
    report = trainops.patch(model)
    assert report.swapped == [("0.0", "torch.nn.Softmax", "trainops.nn.Softmax")]
    assert report.other_names == {}


# ----------------------------------------------------------------------------------------------
# Weight tying, parameters, buffers
# ----------------------------------------------------------------------------------------------

def test_weight_tying_survives_and_parameters_are_the_same_objects():
    model = TinyLM()
    before = by_identity(model.named_parameters(remove_duplicate=False))
    weight = model.embed.weight
    trainops.patch(model)
    assert model.embed.weight is weight and model.head.weight is weight
    assert by_identity(model.named_parameters(remove_duplicate=False)) == before
    tokens, targets = lm_batch()
    with trainops.backend("cpu"):
        model(tokens, targets).backward()
    assert weight.grad is not None and weight.grad[0].abs().sum() > 0  # the head's use of row 0 reaches it


def test_requires_grad_dtype_and_device_of_parameters_are_kept():
    frozen = torch.nn.Embedding.from_pretrained(torch.randn(10, 4), freeze=True)
    bf16 = torch.nn.Embedding(10, 4, dtype=torch.bfloat16)
    meta = torch.nn.Embedding(10, 4, device="meta")
    loss = torch.nn.CrossEntropyLoss(weight=torch.rand(6, dtype=torch.bfloat16))
    model = torch.nn.ModuleDict(dict(frozen=frozen, bf16=bf16, meta=meta, loss=loss))
    params = {name: (id(p), p.dtype, p.device, p.requires_grad) for name, p in model.named_parameters()}
    assert len(trainops.patch(model).swapped) == 4
    assert {name: (id(p), p.dtype, p.device, p.requires_grad) for name, p in model.named_parameters()} == params
    assert model.loss.weight.dtype == torch.bfloat16
    with trainops.backend("cpu"):
        out = model.frozen(torch.tensor([1, 2]))
    assert not out.requires_grad and torch.equal(out, frozen.weight[[1, 2]])
    model.meta.to_empty(device="cpu")
    assert model.meta.weight.device.type == "cpu" and type(model.meta) is trainops.nn.Embedding


def test_buffers_and_state_dict_keys_are_unchanged():
    model = TinyLM()
    model.softmax.register_buffer("temperature", torch.tensor(2.0))
    model.log_probs.register_buffer("scratch", torch.zeros(3), persistent=False)
    model.loss = torch.nn.CrossEntropyLoss(weight=torch.rand(11))
    buffers = by_identity(model.named_buffers())
    keys = list(model.state_dict())
    checkpoint = copy.deepcopy(model.state_dict())
    trainops.patch(model)
    assert by_identity(model.named_buffers()) == buffers
    assert list(model.state_dict()) == keys
    model.load_state_dict(checkpoint)  # strict: a torch checkpoint loads into the patched model ...
    fresh = TinyLM()
    fresh.softmax.register_buffer("temperature", torch.tensor(0.0))
    fresh.loss = torch.nn.CrossEntropyLoss(weight=torch.zeros(11))
    fresh.load_state_dict(model.state_dict())  # ... and the patched model's into a torch model
    assert fresh.softmax.temperature == 2.0 and torch.equal(fresh.loss.weight, checkpoint["loss.weight"])


# ----------------------------------------------------------------------------------------------
# Issue 16 item 8: hooks, training state, attributes
# ----------------------------------------------------------------------------------------------

def _record(calls, name, *args, **kwargs):
    calls.append((name, args[0] if args else None))


HOOKS = {
    # name -> register(module, calls): the hook appends (name, the module it is given) to calls
    "forward_pre": lambda m, calls: m.register_forward_pre_hook(functools.partial(_record, calls, "forward_pre")),
    "forward_pre_with_kwargs": lambda m, calls: m.register_forward_pre_hook(
        functools.partial(_record, calls, "forward_pre_with_kwargs"), with_kwargs=True),
    "forward": lambda m, calls: m.register_forward_hook(functools.partial(_record, calls, "forward")),
    "forward_with_kwargs": lambda m, calls: m.register_forward_hook(
        functools.partial(_record, calls, "forward_with_kwargs"), with_kwargs=True),
    "forward_always_called": lambda m, calls: m.register_forward_hook(
        functools.partial(_record, calls, "forward_always_called"), always_call=True),
    "forward_prepended": lambda m, calls: m.register_forward_hook(
        functools.partial(_record, calls, "forward_prepended"), prepend=True),
    "full_backward": lambda m, calls: m.register_full_backward_hook(functools.partial(_record, calls, "full_backward")),
    "backward_pre": lambda m, calls: m.register_full_backward_pre_hook(
        functools.partial(_record, calls, "backward_pre")),
    "state_dict_pre": lambda m, calls: m.register_state_dict_pre_hook(
        functools.partial(_record, calls, "state_dict_pre")),
    "state_dict_post": lambda m, calls: m.register_state_dict_post_hook(
        functools.partial(_record, calls, "state_dict_post")),
    "state_dict_private": lambda m, calls: m._register_state_dict_hook(
        functools.partial(_record, calls, "state_dict_private")),
    "load_state_dict_pre": lambda m, calls: m.register_load_state_dict_pre_hook(
        functools.partial(_record, calls, "load_state_dict_pre")),
    "load_state_dict_pre_without_module": lambda m, calls: m._register_load_state_dict_pre_hook(
        lambda state_dict, *rest: calls.append(("load_state_dict_pre_without_module", None))),
    "load_state_dict_post": lambda m, calls: m.register_load_state_dict_post_hook(
        functools.partial(_record, calls, "load_state_dict_post")),
}


def exercise(model, module):
    """Forward (keyword arguments where the module takes one input), backward, state_dict, load_state_dict."""
    args = sample_inputs(module)
    if len(args) == 1:  # by keyword, under the name torch's forward gives it
        name = list(inspect.signature(type(module).forward).parameters)[1]
        call_and_backward(module, **{name: args[0]})
    else:
        call_and_backward(module, *args)
    model.load_state_dict(model.state_dict())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # Embedding: no input requires grad
@pytest.mark.parametrize("make, new_class", SWAPPABLE, ids=SWAPPABLE_IDS)
@pytest.mark.parametrize("hook", list(HOOKS))
def test_hooks_are_kept_and_their_handles_still_remove_them(make, new_class, hook):
    model = torch.nn.Sequential(make())
    calls = []
    handle = HOOKS[hook](model[0], calls)
    exercise(model, model[0])
    expected = calls.copy()
    assert [name for name, _ in expected] == [hook]
    calls.clear()

    report = trainops.patch(model)
    assert report.skipped == [] and type(model[0]) is new_class
    exercise(model, model[0])
    assert calls == [(name, model[0] if module is not None else None) for name, module in expected]

    calls.clear()
    handle.remove()
    exercise(model, model[0])
    assert calls == []


def test_hooks_keep_their_order_and_kwargs():
    model = torch.nn.Sequential(torch.nn.Softmax(dim=-1))
    seen = []
    model[0].register_forward_hook(lambda m, args, kwargs, out: seen.append(("second", tuple(kwargs))),
                                   with_kwargs=True)
    model[0].register_forward_hook(lambda m, args, out: seen.append(("first", args)), prepend=True)
    model[0].register_forward_pre_hook(lambda m, args, kwargs: (args, {"input": kwargs["input"] * 0}),
                                       with_kwargs=True)
    trainops.patch(model)
    x = torch.randn(2, 3)
    with trainops.backend("cpu"):
        out = model[0](input=x)
    assert torch.allclose(out, torch.full_like(x, 1 / 3))  # the pre-hook's replacement input was used
    assert seen == [("first", ()), ("second", ("input",))]


def test_training_state_is_kept():
    model = TinyLM()
    model.eval()
    model.blocks.train()  # mixed: the shared softmax is in training mode, everything else in eval
    states = {name: m.training for name, m in model.named_modules()}
    trainops.patch(model)
    assert {name: m.training for name, m in model.named_modules()} == states
    assert model.softmax.training and not model.log_probs.training and not model.embed.training


@pytest.mark.parametrize("make, new_class", SWAPPABLE, ids=SWAPPABLE_IDS)
def test_extra_attributes_are_kept(make, new_class):
    model = torch.nn.Sequential(make())
    model[0].my_tag = 1
    model[0].notes = {"owner": "me"}
    notes = model[0].notes
    trainops.patch(model)
    assert type(model[0]) is new_class
    assert model[0].my_tag == 1 and model[0].notes is notes


@pytest.mark.parametrize("make, new_class", SWAPPABLE, ids=SWAPPABLE_IDS)
def test_a_patched_module_has_every_attribute_a_fresh_trainops_module_has(make, new_class):
    # guards patch's table of the attributes trainops.nn's __init__ adds against drift
    model = torch.nn.Sequential(make())
    trainops.patch(model)
    fresh = new_class(10, 4) if new_class is trainops.nn.Embedding else new_class()
    added = set(vars(fresh)) - set(vars(make()))
    assert set(vars(fresh)) <= set(vars(model[0]))
    assert {name: getattr(model[0], name) for name in added} == {name: getattr(fresh, name) for name in added}


# ----------------------------------------------------------------------------------------------
# Modules left as they are, with the reason
# ----------------------------------------------------------------------------------------------

class MySoftmax(torch.nn.Softmax):
    def forward(self, input):
        return super().forward(input * 2)


class MyLoss(torch.nn.CrossEntropyLoss):
    pass


def _with_forward_override(module):
    module.forward = lambda input: input
    return module


def _with_check_index(module):
    module.check_index = False
    return module


def _with_z_loss(module):
    module.z_loss = 1e-4
    return module


def _with_non_full_backward_hook(module):
    module.register_backward_hook(lambda *args: None)
    return module


def _compiled(module):
    module.compile()
    return module


REFUSED = {
    "subclass": (lambda: MySoftmax(dim=-1), "a subclass of torch.nn.Softmax"),
    "subclass_of_loss": (MyLoss, "a subclass of torch.nn.CrossEntropyLoss"),
    "sparse": (lambda: torch.nn.Embedding(4, 2, sparse=True), "sparse=True is not supported"),
    "max_norm": (lambda: torch.nn.Embedding(4, 2, max_norm=1.0), "max_norm is not supported"),
    "forward_override": (lambda: _with_forward_override(torch.nn.Softmax(dim=-1)), "instance attribute 'forward'"),
    "check_index": (lambda: _with_check_index(torch.nn.Embedding(4, 2)), "instance attribute 'check_index'"),
    "z_loss": (lambda: _with_z_loss(torch.nn.CrossEntropyLoss()), "instance attribute 'z_loss'"),
    "non_full_backward_hook": (lambda: _with_non_full_backward_hook(torch.nn.CrossEntropyLoss()),
                               "non-full backward hook"),
    "compiled_in_place": (lambda: _compiled(torch.nn.LogSoftmax(dim=-1)), "Module.compile()"),
}


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # importing torch.compile's stack
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_module_that_cannot_be_swapped_is_kept_with_the_reason(case):
    make, reason = REFUSED[case]
    model = torch.nn.ModuleDict(dict(kept=make(), swapped=torch.nn.Softmax(dim=-1)))
    kept_class, kept_state = type(model.kept), dict(vars(model.kept))
    report = trainops.patch(model)
    assert type(model.kept) is kept_class and vars(model.kept) == kept_state
    assert report.swapped == [("swapped", "torch.nn.Softmax", "trainops.nn.Softmax")]
    assert [(name, cls) for name, cls, _ in report.skipped] == [("kept", kept_class.__name__)]
    assert reason in report.skipped[0][2]
    assert f"  kept: {kept_class.__name__} kept ({report.skipped[0][2]})" in str(report)


def test_every_reason_is_given():
    module = _with_check_index(torch.nn.Embedding(4, 2, max_norm=1.0, sparse=True))
    report = trainops.patch(torch.nn.Sequential(module))
    assert report.skipped[0][2] == (
        "max_norm is not supported by trainops.nn.Embedding; "
        "sparse=True is not supported by trainops.nn.Embedding; "
        "its instance attribute 'check_index' would be taken as trainops.nn.Embedding.check_index; "
        "set it after patching")


def test_patching_twice_swaps_nothing_the_second_time():
    model = TinyLM()
    first = trainops.patch(model)
    assert len(first.swapped) == 4 and first.skipped == []
    second = trainops.patch(model)
    assert second.swapped == [] and second.skipped == [] and second.other_names == {}
    assert str(second) == "trainops.patch: 0 module(s) swapped, 0 left as they are"


@pytest.mark.parametrize("make, new_class", SWAPPABLE, ids=SWAPPABLE_IDS)
def test_the_root_module_is_swapped(make, new_class):
    root = make()
    root.eval()
    report = trainops.patch(root)
    assert type(root) is new_class and not root.training
    assert report.swapped == [("", f"torch.nn.{new_class.__name__}", f"trainops.nn.{new_class.__name__}")]
    assert f"  <root>: torch.nn.{new_class.__name__} -> trainops.nn.{new_class.__name__}" in str(report)


def test_model_must_be_a_module():
    with pytest.raises(InvalidProblemError, match="argument 'model' must be a torch.nn.Module, got dict"):
        trainops.patch({"embed": torch.nn.Embedding(3, 2)})


def test_a_failing_swap_leaves_every_module_as_it_was(monkeypatch):
    class SlottedSoftmax(torch.nn.Module):
        __slots__ = ("extra",)  # a different object layout: assigning this class raises TypeError

    monkeypatch.setitem(patch_module._SWAPS, torch.nn.Softmax, patch_module._Swap(torch.nn.Softmax, SlottedSoftmax))
    # the loss (class and its added z_loss / loss_dtype) and the embedding are swapped before the softmax fails
    model = torch.nn.ModuleDict(dict(loss=torch.nn.CrossEntropyLoss(), embed=torch.nn.Embedding(4, 2),
                                     softmax=torch.nn.Softmax(dim=-1)))
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {name: dict(vars(m)) for name, m in model.named_modules()}
    with pytest.raises(TypeError, match="layout"):
        trainops.patch(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == state


# ----------------------------------------------------------------------------------------------
# End to end: same outputs, gradients and hook calls as the unpatched model
# ----------------------------------------------------------------------------------------------

def count_hook_calls(model):
    """Register forward pre, forward, full backward and backward pre hooks on every module; return the counts."""
    counts = {}

    def counter(key, *args, **kwargs):
        counts[key] = counts.get(key, 0) + 1

    for name, m in model.named_modules():
        m.register_forward_pre_hook(functools.partial(counter, (name, "forward_pre")))
        m.register_forward_hook(functools.partial(counter, (name, "forward")))
        m.register_full_backward_hook(functools.partial(counter, (name, "full_backward")))
        m.register_full_backward_pre_hook(functools.partial(counter, (name, "backward_pre")))
    return counts


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the Embedding: no input requires grad
def test_a_patched_model_gives_the_same_outputs_gradients_and_hook_calls():
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    reference_counts, counts = count_hook_calls(reference), count_hook_calls(model)
    report = trainops.patch(model)
    assert {name for name, *_ in report.swapped} == {"embed", "softmax", "log_probs", "loss"}
    assert report.other_names == {"softmax": ("blocks.0.attend", "blocks.1.attend")}
    tokens, targets = lm_batch()
    with trainops.backend("cpu"):
        for _ in range(2):
            expected, got = reference(tokens, targets), model(tokens, targets)
            expected.backward()
            got.backward()
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert counts == reference_counts
    assert counts[("softmax", "forward")] == 4 and counts[("loss", "full_backward")] == 2


def test_norm_modules_are_not_swapped_yet():
    """patch leaves torch.nn.RMSNorm and LayerNorm alone (host time; patch's docstring says why)."""
    model = torch.nn.Sequential(torch.nn.RMSNorm(6), torch.nn.LayerNorm(6))
    report = trainops.patch(model)
    assert report.swapped == [] and type(model[0]) is torch.nn.RMSNorm and type(model[1]) is torch.nn.LayerNorm


class TinyBlock(torch.nn.Module):
    """A pre-norm block of torch's modules: RMSNorm, LayerNorm, GELU (tanh), SiLU, Dropout."""

    def __init__(self, width=16):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(width, eps=1e-6)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.gelu = torch.nn.GELU(approximate="tanh")
        self.silu = torch.nn.SiLU()
        self.drop = torch.nn.Dropout(0.25)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        h = self.up(self.norm1(x))
        x = x + self.drop(self.down(self.gelu(h) * self.silu(h)))
        return self.norm2(x)


def test_block_ops_are_swapped_only_when_asked():
    torch.manual_seed(3)
    model = TinyBlock()
    with torch.no_grad():  # weights away from their initial ones, so that a lost weight would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    reference = copy.deepcopy(model)
    assert trainops.patch(model).swapped == [] and trainops.patch(model).skipped == []

    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # built before the patch: still the same parameters
    report = trainops.patch(model, block_ops=True)
    kinds = {name: new for name, _, new in report.swapped}
    assert kinds == {"norm1": "trainops.nn.RMSNorm", "norm2": "trainops.nn.LayerNorm", "gelu": "trainops.nn.GELU",
                     "silu": "trainops.nn.SiLU", "drop": "trainops.nn.Dropout"} and report.skipped == []
    assert model.norm1.weight_offset == 0.0 and model.drop.mask_mode == "regenerate"
    assert model.gelu.approximate == "tanh" and model.drop.p == 0.25 and model.norm1.eps == 1e-6

    x = torch.randn(4, 5, 16, dtype=torch.float64)
    model.double().eval()
    reference.double().eval()   # dropout is the identity in eval: the two models compute the same function
    with trainops.backend("cpu"):
        out = model(x)
        out.square().sum().backward()
    want = reference(x)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    opt.step()   # the optimizer steps the swapped modules' parameters
    assert not torch.equal(model.norm1.weight, reference.norm1.weight)

    model.train()   # training mode: trainops's dropout drops a quarter of the elements
    with trainops.backend("cpu"):
        dropped = model.drop(torch.ones(4000, dtype=torch.float64))
    assert 0.2 < (dropped == 0).double().mean().item() < 0.3 and set(dropped.unique().tolist()) == {0.0, 4 / 3}


def test_block_ops_must_be_a_bool():
    with pytest.raises(InvalidProblemError, match="argument 'block_ops' must be a bool, got 1"):
        trainops.patch(TinyBlock(), block_ops=1)
    model = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Softmax(-1))
    with pytest.raises(InvalidProblemError):
        trainops.patch(model, block_ops="yes")
    assert type(model[1]) is torch.nn.Softmax and type(model[0]) is torch.nn.GELU   # nothing half-applied


# ----------------------------------------------------------------------------------------------
# dry_run and unpatch
# ----------------------------------------------------------------------------------------------

def test_dry_run_reports_without_changing_anything():
    model = TinyLM()
    model.add_module("block", TinyBlock())
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {name: dict(vars(m)) for name, m in model.named_modules()}
    planned = trainops.patch(model, block_ops=True, dry_run=True)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == state
    done = trainops.patch(model, block_ops=True)
    assert planned.swapped == done.swapped and planned.other_names == done.other_names and len(done.swapped) == 9


def test_unpatch_gives_back_the_torch_classes_and_drops_what_patch_added():
    torch.manual_seed(0)
    model = TinyLM()
    model.loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    model.add_module("block", TinyBlock())
    reference = copy.deepcopy(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {name: dict(vars(m)) for name, m in model.named_modules()}
    patched = trainops.patch(model, block_ops=True)
    assert model.loss.z_loss == 0.0 and model.block.drop.mask_mode == "regenerate"
    model.loss.my_tag = 1   # set after patching: kept
    report = trainops.unpatch(model)
    assert [(n, new, old) for n, old, new in patched.swapped] == report.swapped
    assert report.other_names == {"softmax": ("blocks.0.attend", "blocks.1.attend")}
    assert {name: type(m) for name, m in model.named_modules()} == classes
    state["loss"]["my_tag"] = 1
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == state
    tokens, targets = lm_batch()
    torch.testing.assert_close(model(tokens, targets), reference(tokens, targets), rtol=0, atol=0)
    assert trainops.unpatch(model).swapped == []
    # a trainops module built as such, not by patch, stays
    own = torch.nn.Sequential(trainops.nn.Softmax(dim=-1))
    assert trainops.unpatch(own).swapped == [] and type(own[0]) is trainops.nn.Softmax


def test_a_failing_unpatch_leaves_every_module_as_it_was(monkeypatch):
    model = torch.nn.ModuleDict(dict(loss=torch.nn.CrossEntropyLoss(), embed=torch.nn.Embedding(4, 2),
                                     softmax=torch.nn.Softmax(dim=-1)))
    trainops.patch(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {name: dict(vars(m)) for name, m in model.named_modules()}

    class SlottedSoftmax(torch.nn.Module):
        __slots__ = ("extra",)   # a different object layout: assigning this class raises TypeError

    old_class, added = patch_module._PATCHED[model.softmax]
    monkeypatch.setitem(patch_module._PATCHED, model.softmax, (SlottedSoftmax, added))
    with pytest.raises(TypeError, match="layout"):
        trainops.unpatch(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == state
    assert patch_module._PATCHED[model.loss][0] is torch.nn.CrossEntropyLoss   # the records are back too
