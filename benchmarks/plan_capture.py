"""Graph capture and strategy space timings for the automatic planner (`loom.plan.capture`, `loom.plan.space`).

    .venv/bin/python benchmarks/plan_capture.py           # about a minute on 2 cores

Each model is captured once after a warm-up capture (the first `torch.export` of a process imports and
initialises its tracing machinery, about 2 s, counted on the first row only): the tiny GPT-2 and Llama of
the test suite (2 layers, width 64), GPT-2 124M and Llama 3 8B at their published shapes, and two 96-layer
models (GPT-3 175B's shapes; a Llama of 12288 width, 208B parameters) built on the meta device, which
capture traces only 2 of their blocks. Then the strategy space of each model's representative block and
boundaries on a dp 8 x tp 8 mesh. Printed: seconds, op nodes traced, blocks (traced/total), forward and
backward TFLOP of the whole model, and the process's resident memory after each capture (no parameter is
ever allocated: the large models stay on the meta device).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_models import build  # noqa: E402

from loom.plan.capture import capture  # noqa: E402
from loom.plan.space import strategy_space  # noqa: E402


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def on_meta(make):
    with torch.device("meta"):
        return make()


def models():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    llama8b = LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, use_cache=False,
    )  # fmt: skip
    llama208b = LlamaConfig(
        num_hidden_layers=96, hidden_size=12288, intermediate_size=49152, num_attention_heads=96,
        num_key_value_heads=8, vocab_size=128256, use_cache=False,
    )  # fmt: skip
    gpt3 = GPT2Config(
        n_layer=96, n_embd=12288, n_head=96, n_positions=2048, vocab_size=50257, use_cache=False
    )
    tiny = torch.randint(0, 128, (2, 16))
    long = torch.zeros(1, 2048, dtype=torch.long)
    return [
        ("gpt2 tiny (2 layers)", lambda: build("gpt2"), tiny),
        ("llama tiny (2 layers)", lambda: build("llama"), tiny),
        ("mixtral tiny (2 layers)", lambda: build("mixtral"), tiny),
        (
            "gpt2 124M (12 layers)",
            lambda: on_meta(lambda: GPT2LMHeadModel(GPT2Config(use_cache=False))),
            long[:, :1024],
        ),
        ("llama3 8B (32 layers)", lambda: on_meta(lambda: LlamaForCausalLM(llama8b)), long),
        ("gpt3 175B (96 layers)", lambda: on_meta(lambda: GPT2LMHeadModel(gpt3)), long),
        ("llama 208B (96 layers)", lambda: on_meta(lambda: LlamaForCausalLM(llama208b)), long),
    ]


def main() -> None:
    start = time.perf_counter()
    capture(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    print(f"warm-up (first export of the process): {time.perf_counter() - start:.2f} s\n")
    print(f"{'model':26} {'capture s':>9} {'ops':>5} {'blocks':>7} {'fwd TFLOP':>10} {'bwd TFLOP':>10} "
          f"{'RSS MiB':>8} {'space s':>8} {'space ops':>9}")  # fmt: skip
    for name, make, ids in models():
        model = make()
        start = time.perf_counter()
        graph = capture(model, (ids,), {"labels": ids})
        seconds = time.perf_counter() - start
        blocks = f"{graph.blocks.traced}/{graph.blocks.count}" if graph.blocks else "-"
        start = time.perf_counter()
        space = strategy_space(graph, {"dp": 8, "tp": 8})
        space_seconds = time.perf_counter() - start
        print(
            f"{name:26} {seconds:9.2f} {sum(1 for _ in graph.ops()):5d} {blocks:>7} "
            f"{graph.total() / 1e12:10.3g} {graph.total(backward=True) / 1e12:10.3g} {rss_mib():8.0f} "
            f"{space_seconds:8.2f} {len(space):9d}"
        )


if __name__ == "__main__":
    main()
