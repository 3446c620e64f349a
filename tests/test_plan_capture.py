"""Tier 1: graph capture for the automatic planner (`loom.plan.capture`): operator graphs of an MLP, a small
CNN, loom's GPT and Hugging Face GPT-2, Llama and Mixtral, with shapes, module paths, parameters, each
operator's backward and the repeated blocks; no parameter memory; a clear error for a model that cannot be
traced. Single process, no workers."""

from __future__ import annotations

import os
import resource

import pytest
import torch
import torch.nn.functional as F
from hf_models import build
from torch import nn

from loom.models.config import GPTConfig
from loom.models.gpt import GPT
from loom.models.mlp import MLP, MLPRegression
from loom.plan.capture import CaptureError, capture
from loom.plan.graph import Ref

LAYERS = 3  # more blocks than are traced (2), so the shortened trace is what every model test exercises
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


class SmallCNN(nn.Module):
    """Two convolutions (one batch-normalised), pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@pytest.fixture(scope="module")
def hf_graphs():
    """GPT-2, Llama and Mixtral (3 layers each), captured with positional ids and keyword labels."""
    return {family: capture(build(family, layers=LAYERS), (IDS,), {"labels": IDS}) for family in FAMILIES}


FAMILIES = ("gpt2", "llama", "mixtral")


def test_mlp_operators_shapes_flops_and_backward():
    graph = capture(MLP(16, 32, 8, depth=3), (torch.randn(4, 16),))
    assert graph.op_counts() == {"aten.t.default": 3, "aten.addmm.default": 3, "aten.gelu.default": 2}
    assert graph.blocks is None  # Linear, GELU, Linear...: not a list of identical blocks
    first, last = (n for n in graph.ops() if n.target == "aten.addmm.default" and n.module in ("0", "4"))
    assert (first.output().shape, last.output().shape) == ((4, 32), (4, 8))
    assert first.module_type == "Linear" and first.flops == 2 * 4 * 16 * 32
    # the first matmul's input needs no gradient: its backward computes the weight's alone (one mm), the
    # others also pass the gradient on (two)
    mms = lambda node: [op.target for op in node.backward].count("aten.mm.default")
    assert (mms(first), mms(last)) == (1, 2)
    assert graph.total("flops", backward=True) == 2 * graph.total("flops") - 2 * 4 * 16 * 32
    # autograd keeps the input for the weight's gradient, and the input and weight for both gradients
    assert first.saved == (Ref("input"),)
    assert [ref.node for ref in last.saved] == [
        graph[last.inputs[1].node].name,
        graph[last.inputs[2].node].name,
    ]


def test_keyword_inputs_and_parameter_ownership():
    model = MLPRegression(MLP(16, 32, 8, depth=2))
    graph = capture(model, (torch.randn(4, 16),), {"y": torch.randn(4, 8)})
    assert graph.op_counts() == {
        "aten.t.default": 2, "aten.addmm.default": 2, "aten.gelu.default": 1, "aten.mse_loss.default": 1,
    }  # fmt: skip
    assert [n.name for n in graph.nodes if n.kind == "input"] == ["x", "y"]
    weight = graph.params["layers.2.weight"]
    assert (weight.module, weight.module_type, weight.trainable) == ("layers.2", "Linear", True)
    assert weight.info.shape == (8, 32)
    (consumer,) = weight.consumers  # reached through the transpose
    assert graph[consumer].target == "aten.addmm.default" and graph[consumer].module == "layers.2"
    loss = next(n for n in graph.ops() if n.target == "aten.mse_loss.default")
    assert loss.module == "" and loss.module_type == "MLPRegression"
    assert [op.target for op in loss.backward] == ["aten.mse_loss_backward.default"]


def test_small_cnn_operators_and_buffers():
    graph = capture(SmallCNN(), (torch.randn(2, 3, 8, 8),))
    assert graph.op_counts() == {
        "aten.convolution.default": 2, "aten.native_batch_norm.default": 1, "aten.add.Tensor": 1,
        "aten.relu.default": 2, "aten.max_pool2d_with_indices.default": 1, "aten.mean.dim": 1,
        "aten.view.default": 1, "aten.t.default": 1, "aten.addmm.default": 1,
    }  # fmt: skip
    conv = next(n for n in graph.ops() if n.module == "features.4")
    assert conv.target == "aten.convolution.default" and conv.output().shape == (2, 16, 4, 4)
    assert conv.flops == 2 * (2 * 16 * 4 * 4) * (8 * 3 * 3)
    assert [op.target for op in conv.backward] == ["aten.convolution_backward.default"]
    stats = graph.params["features.1.running_mean"]
    assert (stats.kind, stats.trainable, stats.module_type) == ("buffer", False, "BatchNorm2d")
    counter = next(n for n in graph.ops() if n.target == "aten.add.Tensor")  # num_batches_tracked += 1
    assert not counter.requires_grad and not counter.backward


@pytest.mark.parametrize("family", FAMILIES)
def test_hugging_face_blocks_paths_and_parameters(hf_graphs, family):
    graph = hf_graphs[family]
    blocks = graph.blocks
    path = "transformer.h" if family == "gpt2" else "model.layers"
    assert (blocks.path, blocks.count, blocks.traced) == (path, LAYERS, 2)
    assert len(blocks.nodes[0]) == len(blocks.nodes[1]) > 20
    assert all(graph[name].module.startswith(f"{path}.0") for name in blocks.representative)
    assert all(graph[name].module.startswith(f"{path}.1") for name in blocks.nodes[1])
    assert all(node.module or node.module_type for node in graph.ops())  # every node knows its module
    assert "aten.embedding.default" in [graph[name].target for name in blocks.before]
    assert graph[blocks.after[-1]].target == "aten.nll_loss_forward.default"
    assert set(blocks.before).isdisjoint(blocks.after)
    attention = "attn.c_attn" if family == "gpt2" else "self_attn.q_proj"
    weight = graph.params[f"{path}.0.{attention}.weight"]
    assert weight.module == f"{path}.0.{attention}" and weight.trainable
    assert [graph[c].module for c in weight.consumers] == [weight.module]
    assert all(graph[c].requires_grad and graph[c].backward for c in weight.consumers)
    assert not graph.notes


def test_hugging_face_gpt2_tied_head(hf_graphs):
    graph = hf_graphs["gpt2"]
    assert graph.params["transformer.wte.weight"].aliases == ("lm_head.weight",)


def test_mixtral_experts_are_captured(hf_graphs):
    graph = hf_graphs["mixtral"]
    experts = [n for n in graph.ops() if n.module == "model.layers.0.mlp.experts"]
    assert experts and all(n.block == 0 for n in experts)
    router = graph.params["model.layers.0.mlp.gate.weight"]
    assert router.module_type == "MixtralTopKRouter" and router.consumers


def test_shortened_trace_counts_what_the_whole_trace_counts(hf_graphs):
    model = build("llama", layers=LAYERS)
    whole = capture(model, (IDS,), {"labels": IDS}, trace_blocks=LAYERS)
    short = hf_graphs["llama"]  # the same model (same shapes), its first two blocks traced
    assert (whole.blocks.traced, short.blocks.traced) == (LAYERS, 2)
    assert whole.blocks.signature == short.blocks.signature
    for backward in (False, True):
        assert whole.total("flops", backward=backward) == short.total("flops", backward=backward) > 0
        assert whole.total("bytes", backward=backward) == short.total("bytes", backward=backward) > 0
    assert len(model.model.layers) == LAYERS  # the block list is restored


def test_loom_gpt_on_the_meta_device():
    config = GPTConfig(n_layers=4, norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_heads=2)
    with torch.device("meta"):
        model = GPT(config)
    graph = capture(model, (IDS, IDS))
    assert (graph.blocks.path, graph.blocks.count, graph.blocks.traced) == ("blocks", 4, 2)
    d, f, tokens = config.d_model, config.ff_dim, IDS.numel()
    # per block: q, k, v, out, gate, up, down projections; scores and mixing (batch, heads, seq, seq)
    kv = config.kv_heads * config.head_dim
    projections = 2 * tokens * d * (2 * d + 2 * kv + 3 * f)
    attention = 2 * 2 * IDS.shape[0] * config.n_heads * IDS.shape[1] ** 2 * config.head_dim
    block = sum(graph[name].flops for name in graph.blocks.representative)
    assert block == projections + attention
    assert graph.total() == 4 * block + 2 * tokens * d * config.vocab_size  # the logits
    assert all(p.is_meta for p in model.parameters())


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_parameter_memory_for_a_two_billion_parameter_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=28, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000, max_position_embeddings=512, use_cache=False,
    )  # fmt: skip
    before, peak_before = _rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters > 2e9  # 8 GB in fp32
    ids = torch.zeros(1, 128, dtype=torch.long)
    graph = capture(model, (ids,), {"labels": ids})
    assert graph.blocks.count == 28 and graph.total() > 2 * parameters * 128 * 0.9
    grown = _rss_bytes() - before
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert grown < 512 << 20 and peak < 512 << 20, (grown, peak)
    assert all(p.is_meta for p in model.parameters())


def test_ninety_six_blocks_trace_two():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(
            GPT2Config(n_layer=96, n_embd=256, n_head=4, vocab_size=1024, use_cache=False)
        )
    graph = capture(model, (torch.zeros(1, 32, dtype=torch.long),))
    assert (graph.blocks.count, graph.blocks.traced) == (96, 2)
    assert {node.block for node in graph.ops()} == {None, 0, 1}
    assert len(model.transformer.h) == 96
    # every matmul's backward computes two products (the head's weight is tied to the embedding and on
    # the meta device lifted under both names, each trainable)
    assert graph.params["lm_head.weight"].trainable
    assert graph.total("flops", backward=True) == 2 * graph.total("flops")


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Stack(nn.Module):
    """Blocks at a path no recipe names (`stack`), found as a list of identical modules."""

    def __init__(self, alternate: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stack = nn.ModuleList(_Residual(8) for _ in range(5))
        self.alternate = alternate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.stack):
            x = block(x)
            if self.alternate and i % 2 == 0:  # work between some blocks, outside them
                x = torch.relu(x)
        return x.sum()


def test_identical_modules_at_any_path_are_blocks():
    graph = capture(_Stack(), (torch.randn(3, 4),))
    assert (graph.blocks.path, graph.blocks.count, graph.blocks.traced) == ("stack", 5, 2)
    assert [graph[name].module for name in graph.blocks.before] == ["stem"] * 2  # t, addmm
    assert graph.total() == 2 * 3 * 4 * 8 + 5 * 2 * (2 * 3 * 8 * 16)


def test_work_between_blocks_is_traced_with_every_block():
    graph = capture(_Stack(alternate=True), (torch.randn(3, 4),))
    assert (graph.blocks.count, graph.blocks.traced) == (5, 5)  # the shortened trace was redone whole
    assert [graph[name].target for name in graph.blocks.between] == ["aten.relu.default"] * 2
    assert [graph[name].target for name in graph.blocks.after] == ["aten.relu.default", "aten.sum.default"]
    assert graph.total("bytes") == sum(node.bytes for node in graph.ops())


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x  # control flow on a value: no graph can hold it


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), _Gate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.inner(x))


def test_an_untraceable_model_names_its_module_and_the_fallbacks():
    with pytest.raises(CaptureError) as caught:
        capture(_Branchy(), (torch.randn(2, 4),))
    message = str(caught.value)
    assert "module 'inner.1' (_Gate) calling Tensor.__bool__ at " in message  # the module and the operator
    assert "test_plan_capture.py:" in message and "(`return x if x.sum() > 0 else -x" in message
    assert "semi_auto" in message and "data_parallel" in message


def test_the_planner_imports_no_layer_above_it():
    import ast
    from pathlib import Path

    import loom.plan

    above = ("loom.parallel", "loom.train", "loom.cli", "loom.checkpoint", "loom.fault", "loom.viz")
    for path in Path(loom.plan.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        ]
        names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [name for name in names if name.startswith(above)], path.name


class _Arguments(nn.Module):
    """Reads a tensor argument, a tuple argument, `*args` and a keyword into `**kwargs`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, pair, *rest, **extra):  # noqa: ANN001, ANN002, ANN003
        return self.fc(x + pair[0] + pair[1] + rest[0] + extra["y"]).sum()


def test_capture_names_the_inputs_forward_takes_as_whole_tensor_arguments():
    """`Graph.arguments`: whole tensor arguments by name (a keyword into `**kwargs` too), `*rest` by
    position; tensors inside a tuple argument are not listed."""
    t = torch.randn(2, 4)
    graph = capture(_Arguments(), (t, (t, t), t), {"y": t})
    inputs = [node.name for node in graph.nodes if node.kind == "input"]
    assert len(inputs) == 5
    assert sorted(graph.arguments.values()) == ["rest[0]", "x", "y"], graph.arguments
    assert {graph.arguments[name] for name in (inputs[0], inputs[3], inputs[4])} == {"x", "rest[0]", "y"}


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, scale: float, x: torch.Tensor, *, times: int = 1) -> torch.Tensor:
        return self.fc(x).sum() * scale * times


def test_numbers_among_the_arguments_are_constants_of_the_trace():
    """A number or flag passed to forward is taken as a constant: no input node, and the tensor arguments
    keep their names."""
    graph = capture(_Scaled(), (0.5, torch.randn(2, 4)), {"times": 3})
    inputs = [node.name for node in graph.nodes if node.kind == "input"]
    assert len(inputs) == 1 and graph.arguments == {inputs[0]: "x"}, (inputs, graph.arguments)
