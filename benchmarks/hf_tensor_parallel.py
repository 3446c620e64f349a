"""Tensor parallelism on an unedited Hugging Face Llama: loom's module plan against PyTorch's own
`parallelize_module` (ColwiseParallel / RowwiseParallel, the way torchtitan lays out Llama), side by side.

Both lay out the same model with Megatron's layouts on 2 CPU ranks (gloo, tp=2) and train it with SGD on
the same batch; their steps are interleaved (loom, torch, loom, torch, ...) so that both see the same
machine load. loom keeps global semantics (every activation a DTensor, tensors the model creates lifted,
the loss computed by the model on DTensors with a vocabulary-parallel cross entropy); PyTorch's plan turns
activations back into local tensors between the sharded linears and gathers the logits for the loss.
Prints the median step times, the ratio loom / torch, the losses of both (they must agree) and the peak
resident memory of each rank's process (one process runs both, so it is an upper bound for either).

    python benchmarks/hf_tensor_parallel.py            # 4 blocks, hidden 256, batch 4 x 128
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time

import torch


def build(layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=1024, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def torch_native(model: torch.nn.Module, mesh) -> torch.nn.Module:  # noqa: ANN001
    """PyTorch's tensor parallelism for a Llama: colwise q/k/v and gate/up, rowwise o/down, a
    vocabulary-parallel embedding, a colwise head gathered for the loss."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _step(model, optimizer, ids) -> tuple[float, float]:  # noqa: ANN001
    import loom

    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start, loom.full(loss).item()


def measure(steps: int, warmup: int, layers: int, hidden: int, vocab: int, batch: int, seq: int) -> dict:
    import loom
    from loom.models.recipes import tensor_plan

    mesh = loom.init({"tp": 2})
    base = build(layers, hidden, vocab)
    ours = loom.parallelize(copy.deepcopy(base), module_plan=tensor_plan(base), batch_axes=())
    theirs = torch_native(copy.deepcopy(base), mesh.device_mesh)
    models = {"loom": ours, "torch": theirs}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"loom": [], "torch": []}
    losses: dict[str, list[float]] = {"loom": [], "torch": []}
    for i in range(warmup + steps):
        order = ("loom", "torch") if i % 2 else ("torch", "loom")
        for name in order:
            elapsed, loss = _step(models[name], optimizers[name], ids)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(elapsed)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() for p in base.parameters())
    return {"times": times, "losses": losses, "peak_mib": peak_mib, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    import loom

    results = loom.launch(
        measure, 2, args.steps, args.warmup, args.layers, args.hidden, args.vocab, args.batch, args.seq
    )
    first = results[0]
    loom_s = statistics.median(first["times"]["loom"])
    torch_s = statistics.median(first["times"]["torch"])
    print(
        f"Llama, {first['params'] / 1e6:.1f}M parameters, tp=2 on 2 CPU ranks, batch {args.batch} x {args.seq}"
    )
    print(f"median step: loom {loom_s * 1e3:.1f} ms, torch parallelize_module {torch_s * 1e3:.1f} ms")
    print(f"loom / torch: {loom_s / torch_s:.2f}")
    worst = max(
        abs(a - b) / abs(b) for a, b in zip(first["losses"]["loom"], first["losses"]["torch"], strict=True)
    )
    print(f"losses agree within rel {worst:.1e} (first {first['losses']['loom'][0]:.4f})")
    print(f"peak resident memory per rank (both models): {max(r['peak_mib'] for r in results):.0f} MiB")


if __name__ == "__main__":
    main()
