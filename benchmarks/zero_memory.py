"""Per-rank memory of optimizer levels 0-3 against the ZeRO paper's formulas, and level 3 against FSDP2.

An MLP of about 4.2M parameters (its layers held in an `nn.ModuleList`, so that level 3 and FSDP2 both
gather one layer at a time; forward returns the MSE loss) trains for two steps with fp32 AdamW on 4 CPU
ranks (gloo), once per optimizer level (loom data-parallel mode, `loom.parallel.make_optimizer`), then once
with PyTorch's FSDP2 (`fully_shard` on each layer, then the root, on a 1-D DeviceMesh of the same ranks).
Every run starts from the same weights and sees the same data.

What is counted, in bytes per rank (the largest over the ranks; ranks differ only by padding):
- parameters: the storage of each parameter's local tensor (a DTensor's local shard) at rest, after the
  second step; a level-3 parameter released between uses counts 0;
- gradients: right after the second backward, before the optimizer step: `param.grad` (its local shard for
  FSDP2) plus, at levels 2 and 3, each bucket's reduced chunk `bucket.shard_grad`;
- optimizer states: every tensor in the state of the torch optimizer(s) doing the update (AdamW's exp_avg,
  exp_avg_sq and step), after the second step;
- loom's extras, on their own lines: the fp32 master chunks that levels 1-3 update (`shards[i].master`;
  at level 3 they are where the parameters live at rest, so they are compared with its 4Ψ/N), the
  gradient bucket buffers that the collectives read (`bucket.buffer`, allocated per backward and freed
  after the reduction) and, at levels 1-3, the all-gather buffers that publish the updated chunks (allocated
  per publish and freed: both count 0 at rest);
- live tensors: every tensor storage reachable from Python (`gc`) after the second step, less those alive
  before the run was built: a check that nothing held at rest was missed (gradients are gone by then:
  the step ends with `zero_grad(set_to_none=True)`, as `loom.train.Trainer` does).
Storages are counted once however many tensors view them.

The formulas (ZeRO, Rajbhandari et al. 2020, fp32 Adam), with Ψ the parameter count, N the data-parallel
size and "kΨ" meaning k bytes per parameter:
    level 0: parameters 4Ψ,   gradients 4Ψ,   states 8Ψ
    level 1: parameters 4Ψ,   gradients 4Ψ,   states 8Ψ/N
    level 2: parameters 4Ψ,   gradients 4Ψ/N, states 8Ψ/N
    level 3: parameters 4Ψ/N, gradients 4Ψ/N, states 8Ψ/N
(The paper's mixed-precision table counts fp16 weights and an fp32 copy inside the states; in fp32 the
weights are the copy, so the states are Adam's two moments, 8Ψ.) loom's master chunks add 4Ψ/N at levels
1-3; they are reported on their own line, next to that formula. Prints measured / formula per line
(goal: within 10%) and, for level 3, loom / FSDP2.
"""

from __future__ import annotations

import argparse
import copy
import gc
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import loom
from loom.models import MLP, MLPRegression

KINDS = ("parameters", "gradients", "optimizer states", "master chunks", "bucket buffers", "gather buffers")
FORMULAS = {  # bytes per parameter, as (numerator, divided by N)
    0: {"parameters": (4, False), "gradients": (4, False), "optimizer states": (8, False)},
    1: {"parameters": (4, False), "gradients": (4, False), "optimizer states": (8, True)},
    2: {"parameters": (4, False), "gradients": (4, True), "optimizer states": (8, True)},
    3: {"parameters": (4, True), "gradients": (4, True), "optimizer states": (8, True)},
}
MASTER_FORMULA = (4, True)


Regression = MLPRegression  # the layers in an nn.ModuleList: units for level 3 and FSDP2


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        if storage.nbytes() and storage.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python objects."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, DTensor)]
    return storage_bytes(tensors)


def _state_tensors(optimizers) -> list[torch.Tensor]:
    return [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def _train(model, optimizer, x, y, on_backward) -> None:
    """Two steps; `on_backward()` runs after the second backward, before the optimizer step."""
    for step in range(2):
        model(x, y).backward()
        if step == 1:
            on_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure_loom(base: nn.Module, level: int, x, y) -> dict:
    before = live_tensor_bytes()
    model = loom.parallelize(copy.deepcopy(base), mode="data_parallel")
    optimizer = loom.parallel.make_optimizer(model, torch.optim.AdamW, level, lr=1e-3)
    sync = model.loom.grad_sync
    out: dict[str, int] = {}

    def on_backward() -> None:
        chunks = [bucket.shard_grad for bucket in sync.buckets]
        out["gradients"] = storage_bytes([p.grad for p in model.parameters()] + chunks)

    _train(model, optimizer, x, y, on_backward)
    out["parameters"] = storage_bytes(model.parameters())
    inner = [optimizer] if level == 0 else optimizer.inner
    out["optimizer states"] = storage_bytes(_state_tensors(inner))
    shards = [] if level == 0 else optimizer.shards
    out["master chunks"] = storage_bytes(shard.master for shard in shards)
    out["bucket buffers"] = storage_bytes(bucket.buffer for bucket in sync.buckets)
    # publish() allocates its all-gather buffer per call; an attribute is read if a version keeps one
    out["gather buffers"] = storage_bytes(getattr(shard, "gathered", None) for shard in shards)
    out["live tensors"] = live_tensor_bytes() - before
    with model.loom.full_parameters():
        out["checksum"] = sum(p.detach().double().sum().item() for p in model.parameters())
    return out


def measure_fsdp(base: nn.Module, x, y) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    before = live_tensor_bytes()
    mesh = init_device_mesh("cpu", (loom.world_size(),))
    model = copy.deepcopy(base)
    for layer in model.layers:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, int] = {}

    def on_backward() -> None:
        out["gradients"] = storage_bytes([p.grad for p in model.parameters()])

    _train(model, optimizer, x, y, on_backward)
    out["parameters"] = storage_bytes(model.parameters())
    out["optimizer states"] = storage_bytes(_state_tensors([optimizer]))
    out["live tensors"] = live_tensor_bytes() - before
    out["checksum"] = sum(p.full_tensor().double().sum().item() for p in model.parameters())
    return out


def measure(levels: list[int], batch: int, width: int, depth: int, fsdp: bool) -> dict:
    loom.init()
    torch.manual_seed(0)
    base = Regression(MLP(width // 2, width, width // 2, depth=depth))
    generator = torch.Generator().manual_seed(1 + loom.rank())
    x = torch.randn(batch, width // 2, generator=generator)
    y = torch.randn(batch, width // 2, generator=generator)
    results: dict = {"params": sum(p.numel() for p in base.parameters())}
    for level in levels:
        results[level] = measure_loom(base, level, x, y)
    if fsdp:
        try:
            results["fsdp2"] = measure_fsdp(base, x, y)
        except Exception as error:  # reported in the table instead of a number
            results["fsdp2"] = {"error": f"{type(error).__name__}: {error}"}
    return results


def _mb(n: float) -> str:
    return f"{n / 2**20:10.2f}"


def _formula(level: int, kind: str) -> tuple[int, bool] | None:
    """The formula a measured line is compared with (None: not in the paper)."""
    if level == 3 and kind == "parameters":
        return None  # their storage is released at rest; the master chunks hold them
    if level == 3 and kind == "master chunks":
        return FORMULAS[3]["parameters"]
    if kind == "master chunks" and level > 0:
        return MASTER_FORMULA
    return FORMULAS[level].get(kind)


def _formula_text(numerator: int, sharded: bool) -> str:
    return f"{numerator}Ψ/N" if sharded else f"{numerator}Ψ"


def report(results: list[dict], levels: list[int], ranks: int) -> None:
    psi = results[0]["params"]

    def worst(key, kind):  # the largest over the ranks
        return max(r[key][kind] for r in results)

    print(
        f"MLP with Ψ = {psi:,} parameters ({4 * psi / 2**20:.2f} MB in fp32), fp32 AdamW, N = {ranks} ranks"
    )
    print(
        "bytes per rank (largest over the ranks), MB = 2^20 bytes; ratio = measured / formula (goal 0.90-1.10)"
    )
    print()
    header = f"{'level':<6}{'what':<18}{'measured MB':>12}  {'formula':<8}{'formula MB':>11}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    failures = []
    for level in levels:
        for kind in KINDS:
            measured = worst(level, kind)
            formula = _formula(level, kind)
            if formula is None:
                if kind == "parameters" and level == 3:
                    note = "released at rest: the parameters live in the master chunks (next line)"
                elif not measured:
                    continue
                else:
                    note = f"= {measured / psi:.2f} bytes/param, not in the formula"
                print(f"{level:<6}{kind:<18}{_mb(measured):>12}  {note}")
                continue
            expected = formula[0] * psi / (ranks if formula[1] else 1)
            ratio = measured / expected
            if not 0.9 <= ratio <= 1.1:
                failures.append(f"level {level} {kind}: {ratio:.3f}")
            text = _formula_text(*formula)
            print(f"{level:<6}{kind:<18}{_mb(measured):>12}  {text:<8}{_mb(expected):>11}{ratio:>8.3f}")
        listed = sum(worst(level, kind) for kind in KINDS)
        paper = sum(n * psi / (ranks if s else 1) for n, s in FORMULAS[level].values())
        print(
            f"{level:<6}{'all of the above':<18}{_mb(listed):>12}  {'paper':<8}{_mb(paper):>11}"
            f"{listed / paper:>8.3f}  (paper: parameters + gradients + states)"
        )
        live = worst(level, "live tensors")
        print(
            f"{level:<6}{'live at rest':<18}{_mb(live):>12}  (every tensor reachable from Python; no grads)"
        )
        print()
    print("formula lines outside 0.90-1.10: " + (", ".join(failures) if failures else "none"))
    print()
    fsdp = [r.get("fsdp2", {}) for r in results]
    if not fsdp[0]:
        return
    errors = [r["error"] for r in fsdp if "error" in r]
    if errors:
        print(f"FSDP2 (fully_shard per layer + root) FAILED on CPU/gloo, no numbers: {errors[0]}")
        return
    if 3 not in levels:
        print("FSDP2 measured, but level 3 was not run: no comparison")
        return
    print("level 3 against FSDP2 (fully_shard on each layer, then the root), bytes per rank")
    header = f"{'what':<18}{'loom MB':>10}{'FSDP2 MB':>10}{'loom/FSDP2':>12}"
    print(header)
    print("-" * len(header))
    rows = {
        "parameters": worst(3, "parameters") + worst(3, "master chunks"),
        "gradients": worst(3, "gradients"),
        "optimizer states": worst(3, "optimizer states"),
        "live at rest": worst(3, "live tensors"),
    }
    for kind, ours in rows.items():
        theirs = max(r["live tensors" if kind == "live at rest" else kind] for r in fsdp)
        print(f"{kind:<18}{_mb(ours):>10}{_mb(theirs):>10}{ours / theirs:>12.3f}")
    extras = worst(3, "bucket buffers") + worst(3, "gather buffers")
    print(
        f"{'loom buffers':<18}{_mb(extras):>10}{'-':>10}  (gradient bucket + all-gather buffers, held at rest)"
    )
    print("(loom's parameters at level 3: their master chunks; the parameters' own storage is empty at rest)")
    sums = {r[3]["checksum"] - r["fsdp2"]["checksum"] for r in results}
    print(f"sum of all parameters after training, loom level 3 - FSDP2: {max(map(abs, sums)):.3e}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel size N")
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--no-fsdp", action="store_true", help="skip the FSDP2 comparison")
    args = parser.parse_args()
    results = loom.launch(
        measure, args.ranks, args.levels, args.batch, args.width, args.depth, not args.no_fsdp
    )
    report(results, args.levels, args.ranks)


if __name__ == "__main__":
    main()
