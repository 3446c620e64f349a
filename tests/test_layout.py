"""Tier 1: the layout algebra and its error messages (pure Python, no processes)."""

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from loom.dist.mesh import MeshShape, prime_factors
from loom.layout import Layout, TensorLayout, align_device_matrix, compile_operator, compile_strategy
from loom.ops import LayerNorm, MatMul, Softmax


def test_prime_factors():
    assert prime_factors(1) == ()
    assert prime_factors(8) == (2, 2, 2)
    assert prime_factors(12) == (2, 2, 3)


def test_mesh_shape_fills_and_factorises():
    shape = MeshShape.from_dict({"dp": -1, "tp": 4}, 8)
    assert shape.sizes == (("dp", 2), ("tp", 4))
    assert shape.canonical == (("dp", 2), ("tp_0", 2), ("tp_1", 2))
    assert shape.canonical_dims_of("tp") == (1, 2)
    assert MeshShape.from_dict(None, 4).sizes == (("dp", 4),)


@pytest.mark.parametrize(
    ("sizes", "world", "message"),
    [
        ({"dp": 2, "tp": 2}, 8, "has 4 devices but the world size is 8"),
        ({"dp": -1, "tp": 3}, 8, "does not divide the world size 8"),
        ({"dp": -1, "tp": -1}, 8, "only one axis may be -1"),
        ({"dp": 0}, 8, "sizes are positive"),
        ({"d p": 8}, 8, "must be an identifier"),
    ],
)
def test_mesh_shape_errors(sizes, world, message):
    with pytest.raises(ValueError, match=message):
        MeshShape.from_dict(sizes, world)


def test_unknown_mesh_axis_is_named():
    with pytest.raises(ValueError, match="unknown mesh axis 'pp'; this mesh has axes \\['dp', 'tp'\\]"):
        MeshShape.from_dict({"dp": 2, "tp": 2}, 4).size("pp")


def test_tensor_layout_placements_nest_left_to_right():
    layout = TensorLayout(((0, 1), (), (2,)))
    assert layout.placements(3) == (Shard(0), Shard(0), Shard(2))
    assert layout.cuts((2, 2, 2)) == (4, 1, 2)
    assert TensorLayout.from_placements((Shard(0), Partial(), Replicate()), 2) == TensorLayout(
        ((0,), ()), (1,)
    )


def test_align_device_matrix():
    assert align_device_matrix([2, 4], (2, 2, 2)) == [(0,), (1, 2)]
    assert align_device_matrix([1, 8, 1], (2, 2, 2)) == [(), (0, 1, 2), ()]
    assert align_device_matrix([4, 3], (2, 2, 3)) == [(0, 1), (2,)]
    with pytest.raises(
        ValueError, match=r"device arrangement \(3, 4\) does not fit the canonical mesh 2 x 2 x 3"
    ):
        align_device_matrix([3, 4], (2, 2, 3))


def matmul_layouts(strategy, shapes=((16, 8), (8, 12)), canonical=(2, 2)):
    op = MatMul()
    return compile_operator("MatMul", op.input_names, op.labels(shapes), strategy, shapes, canonical)


def test_matmul_strategies_follow_mindspore_device_matrix():
    # ((4, 1), (1, 1)) on 4: rows of x over both canonical dims, w replicated.
    x, w = matmul_layouts(((4, 1), (1, 1)))
    assert x.dim_axes == ((0, 1), ()) and w.dim_axes == ((), ())
    # ((1, 2), (2, 1)) on 4: device matrix [2 (repeated), 2]: the contracted dim on the inner canonical dim.
    x, w = matmul_layouts(((1, 2), (2, 1)))
    assert x.dim_axes == ((), (1,)) and w.dim_axes == ((1,), ())
    # ((2, 1), (1, 2)) on 8: device matrix [2, 2, 2]: i on dim 1, j on dim 2, dim 0 repeats.
    x, w = matmul_layouts(((2, 1), (1, 2)), canonical=(2, 2, 2))
    assert x.dim_axes == ((1,), ()) and w.dim_axes == ((), (2,))


def test_compile_strategy_broadcast_dim_must_not_be_cut():
    layouts = compile_strategy("Add", ["x", "y"], ["ab", "ab"], ((2, 2), (1, 2)), [(4, 4), (1, 4)], (2, 2))
    assert layouts[0].dim_axes == ((0,), (1,)) and layouts[1].dim_axes == ((), (1,))
    with pytest.raises(ValueError, match="input y dim 0 has size 1, which the cut 2 does not divide"):
        compile_strategy("Add", ["x", "y"], ["ab", "ab"], ((2, 2), (2, 2)), [(4, 4), (1, 4)], (2, 2))


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (
            ((3, 1), (1, 1)),
            "MatMul: input x dim 0 has size 16, which the cut 3 does not divide; use a cut that "
            "divides 16 \\(one of \\[1, 2, 4, 8, 16\\]\\)",
        ),
        (((2, 4), (4, 1)), "cuts into 8 parts in all, which does not divide the device count 4"),
        (((4,), (1, 1)), "the strategy \\(4,\\) of input x has 1 entries but x has 2 dims"),
        (((4, 1),), "in_strategy has 1 entries but the operator takes 2 input\\(s\\) \\(x, w\\)"),
        (
            ((1, 2), (4, 1)),
            "input w dim 0 is cut into 4 but input x dim 1, which the operator pairs with it, is cut into 2",
        ),
        (((1, 1), (0, 1)), "input w dim 0 has cut 0; cuts are positive"),
        ("4,1", "in_strategy must be a tuple"),
    ],
)
def test_strategy_errors_name_operator_tensor_dim_and_fix(strategy, message):
    with pytest.raises(ValueError, match=message):
        matmul_layouts(strategy)


def test_matmul_rejects_higher_rank():
    with pytest.raises(ValueError, match="MatMul: input x has shape \\(2, 3, 4\\), .* use BatchMatMul"):
        MatMul().labels([(2, 3, 4), (4, 5)])


def test_softmax_axis_and_layernorm_dims_cannot_be_cut():
    op = Softmax(axis=1)
    shapes = [(4, 8)]
    with pytest.raises(ValueError, match="Softmax: input x dim 1 is cut into 2, but dim 1 is a softmax axis"):
        compile_operator("Softmax", ["x"], op.labels(shapes), ((1, 2),), shapes, (2, 2), op.uncut(shapes))
    ln = LayerNorm(begin_norm_axis=-1, begin_params_axis=-1)
    shapes = [(4, 6, 8), (8,), (8,)]
    with pytest.raises(ValueError, match="LayerNorm: input x dim 2 is cut into 2, but dim 2 is normalised"):
        compile_operator(
            "LayerNorm",
            ln.input_names,
            ln.labels(shapes),
            ((1, 1, 2), (2,), (2,)),
            shapes,
            (2, 2),
            ln.uncut(shapes),
        )


def test_layout_maps_names_to_canonical_dims():
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    tensor_map = layout("dp", ("sp", "mp"), "None")
    assert tensor_map.cuts() == (2, 4, 1)
    compiled = tensor_map.compile("f", "x", (4, 8, 3), (2, 2, 2))
    assert compiled.dim_axes == ((0,), (1, 2), ())
    # a 4 x 2 arrangement of the same 8 devices lands on the same canonical mesh
    assert Layout((4, 2), ("a", "b"))("b", "a").compile("f", "x", (2, 4), (2, 2, 2)).dim_axes == (
        (2,),
        (0, 1),
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda lay: lay("dp", "dp"), "axis 'dp' cuts dim 0 and dim 1; an axis cuts a tensor at most once"),
        (
            lambda lay: lay("dp", "tp"),
            "dim 1 names the unknown axis 'tp'; the axes are \\['dp', 'sp', 'mp'\\]",
        ),
    ],
)
def test_layout_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make(Layout((2, 2, 2), ("dp", "sp", "mp")))


def test_layout_compile_errors():
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    with pytest.raises(ValueError, match="maps 2 dims but x has 3"):
        layout("dp", "sp").compile("f", "x", (4, 4, 4), (2, 2, 2))
    with pytest.raises(
        ValueError, match="dim 0 has size 6, which its axes \\('sp', 'mp'\\) \\(cut 4\\) do not"
    ):
        layout(("sp", "mp"), "None").compile("f", "x", (6, 4), (2, 2, 2))
    with pytest.raises(ValueError, match="out of device-matrix order"):
        layout(("mp", "sp"), "None").compile("f", "x", (8, 4), (2, 2, 2))
    with pytest.raises(ValueError, match="has 8 devices but there are 4"):
        layout("dp", "None").compile("f", "x", (8, 4), (2, 2))
    with pytest.raises(ValueError, match="one name per axis"):
        Layout((2, 2), ("dp",))
