"""Tier 1: bad inputs to the API (strategies, Layouts, loom.parallelize, LOOM_CHECK) fail early with a message
that names the offending value and says how to fix it. Single process: these are checked before any mesh or
collective is needed."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import loom
from loom import ops
from loom.dist import consistency
from loom.layout import Layout, compile_operator

LAYOUT = Layout((2, 2), ("dp", "mp"))


def _compile(op, strategy, shapes, canonical=(2, 2)):
    labels, uncut = op.labels(shapes), op.uncut(shapes)
    return compile_operator(op.name, op.input_names, labels, strategy, shapes, canonical, uncut)


def _function(x):
    return x


CASES = {
    # a strategy is one tuple per input, each a cut per dim
    "flat strategy, two inputs": (
        lambda: ops.MatMul().shard((4, 1)),
        ["in_strategy (4, 1) is one flat tuple", "one tuple per tensor", "((4, 1), (1, 1))"],
    ),
    "flat strategy, one input": (lambda: ops.ReLU().shard((2, 1)), ["(2, 1) is one flat tuple", "((2, 1),)"]),
    "too few entries": (
        lambda: ops.MatMul().shard(((4, 1),)),
        ["has 1 entries but the operator takes 2 input(s) (x, w)", "give one entry per input"],
    ),
    "a string strategy": (
        lambda: ops.MatMul().shard("dp"),
        ["got 'dp'", "one entry per input", "e.g. ((2, 1), (2, 1))"],
    ),
    "None inside cuts": (lambda: ops.ReLU().shard(((2, None),)), ["got (2, None)", "1 leaves a dim whole"]),
    "None as an operator entry": (
        lambda: ops.ReLU().shard((None,)),
        ["got None", "None leaves an input as it comes only in loom.shard"],
    ),
    "axis name as a cut": (
        lambda: ops.ReLU().shard((("dp", 1),)),
        ["got ('dp', 1)", "belong in a Layout map"],
    ),
    "zero cut": (lambda: ops.ReLU().shard(((0, 1),)), ["cut 0", "cuts are positive (1 = not cut)"]),
    "flat out_strategy": (
        lambda: ops.MatMul().shard(((2, 1), (1, 1)), out_strategy=(2, 1)),
        ["out_strategy (2, 1) is one flat tuple", "((2, 1),)"],
    ),
    "cut that does not divide": (
        lambda: _compile(ops.MatMul(), ((3, 1), (1, 1)), [(16, 8), (8, 12)]),
        ["size 16, which the cut 3 does not divide", "one of [1, 2, 4, 8, 16]"],
    ),
    "paired dims cut differently": (
        lambda: _compile(ops.MatMul(), ((1, 2), (1, 1)), [(16, 8), (8, 12)]),
        ["input w dim 0 is cut into 1 but input x dim 1", "cut both alike"],
    ),
    "cuts for the wrong number of dims": (
        lambda: _compile(ops.ReLU(), ((2, 1, 1),), [(16, 8)]),
        ["(2, 1, 1) of input x has 3 entries but x has 2 dims", "give one cut per dim"],
    ),
    "softmax axis cut": (
        lambda: _compile(ops.Softmax(), ((1, 2),), [(16, 8)], canonical=(2,)),
        ["is cut into 2", "use 1 there"],
    ),
    "cuts not dividing the devices": (
        lambda: _compile(ops.ReLU(), ((3, 1),), [(6, 8)]),
        ["cuts into 3 parts in all, which does not divide the device count 4", "divide 4"],
    ),
    # Layouts map dims to axis names, or "None"
    "Layout dim Python None": (
        lambda: LAYOUT("dp", None),
        ["dim 1 is Python None", "the string 'None'", "layout('dp', 'None')"],
    ),
    "Layout dim an int": (lambda: LAYOUT("dp", 2), ["dim 1 is the int 2", "not to a cut", "strategy tuple"]),
    "Layout dim a float": (
        lambda: LAYOUT(1.5, "dp"),
        ["dim 0 is 1.5", "an axis name, a tuple of axis names, or 'None'"],
    ),
    "Layout unknown axis": (lambda: LAYOUT("tp", "None"), ["unknown axis 'tp'", "['dp', 'mp']"]),
    "Layout axis used twice": (
        lambda: LAYOUT("dp", "dp"),
        ["axis 'dp' cuts dim 0 and dim 1", "map dim 1 to another axis"],
    ),
    "Layout names fewer axes": (
        lambda: Layout((2, 2), ("dp",)),
        ["has 2 axes but alias_name ('dp',) names 1", "one name per axis"],
    ),
    "Layout zero size": (
        lambda: Layout((2, 0), ("dp", "mp")),
        ["device_matrix (2, 0) must hold positive ints", "Layout((2, 2), ('dp', 'mp'))"],
    ),
    "Layout non-string names": (
        lambda: Layout((2, 2), ("dp", 1)),
        ["alias_name ('dp', 1) must hold axis names", "Layout((2, 2), ('dp', 'mp'))"],
    ),
    "Layout axis named None": (
        lambda: Layout((2, 2), ("dp", "None")),
        ["('dp', 'None') must be distinct and not 'None'"],
    ),
    # loom.parallelize's arguments
    "parallelize a function": (
        lambda: loom.parallelize(_function),
        ["takes an nn.Module; got function '_function'", "loom.shard(_function, in_strategy)"],
    ),
    "parallelize a string": (
        lambda: loom.parallelize("model.pt"),
        ["got str 'str'", "pass the nn.Module itself"],
    ),
    "parallelize mode auto without inputs": (
        lambda: loom.parallelize(nn.Linear(2, 2), mode="auto"),
        ["mode='auto') needs example_inputs", "example_inputs=(x,)"],
    ),
    "memory_limit without auto": (
        lambda: loom.parallelize(nn.Linear(2, 2), memory_limit=2**20),
        ["memory_limit is the planner's (mode='auto')"],
    ),
    "parallelize unknown mode": (
        lambda: loom.parallelize(nn.Linear(2, 2), mode="tensor"),
        ["unknown mode 'tensor'", "('data_parallel', 'semi_auto', 'auto')"],
    ),
    "example_inputs a dict": (
        lambda: loom.parallelize(nn.Linear(2, 2), "semi_auto", example_inputs={"x": torch.ones(2, 2)}),
        ["example_inputs must be a tuple", "got dict", "keyword inputs go in example_kwargs"],
    ),
    "example_inputs a number": (
        lambda: loom.parallelize(nn.Linear(2, 2), "semi_auto", example_inputs=3),
        ["got int", "e.g. (x,) or (x, y)"],
    ),
    "example_kwargs a tuple": (
        lambda: loom.parallelize(nn.Linear(2, 2), "semi_auto", example_kwargs=(torch.ones(2),)),
        ["example_kwargs must be a dict", "got tuple", "{'mask': m}"],
    ),
    "bucket_mb zero": (
        lambda: loom.parallelize(nn.Linear(2, 2), bucket_mb=0),
        ["got 0", "positive number of megabytes"],
    ),
    # calling a primitive
    "primitive given a number": (
        lambda: ops.MatMul()(torch.ones(2, 2), 3),
        ["MatMul takes 2 tensor input(s) (x, w) first", "got Tensor, int", "torch.tensor(...)"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_names_value_and_fix(case):
    call, expected = CASES[case]
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    message = str(caught.value)
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


@pytest.mark.parametrize("value", ["maybe", "2", "yes please"])
def test_bad_loom_check_setting(value, monkeypatch):
    monkeypatch.setenv(consistency.ENV, value)
    with pytest.raises(ValueError, match=f"LOOM_CHECK={value!r} is not a setting: use LOOM_CHECK=1"):
        consistency.setting()


@pytest.mark.parametrize(("value", "mode"), [(None, "first"), ("1", "always"), ("0", "off"), ("", "first")])
def test_loom_check_settings(value, mode, monkeypatch):
    if value is None:
        monkeypatch.delenv(consistency.ENV, raising=False)
    else:
        monkeypatch.setenv(consistency.ENV, value)
    assert consistency.setting() == mode
    assert os.environ.get(consistency.ENV) == value


def test_fingerprints_see_every_value_and_place():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    swapped, changed = x.clone(), x.clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    changed[999] = torch.nextafter(changed[999], torch.tensor(2.0))
    digests = {consistency.tensor_digest(t) for t in (x, swapped, changed, x.reshape(10, 100), x.double())}
    assert len(digests) == 5
    assert consistency.tensor_digest(x.clone()) == consistency.tensor_digest(x)
    assert consistency.tensor_digest(x[::2]) == consistency.tensor_digest(x[::2].contiguous())
