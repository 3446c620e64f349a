"""Pipeline schedules as per-device task orders: GPipe, 1F1B and interleaved 1F1B (Megatron-LM's order).

A task is `(kind, micro_batch, chunk)` with kind "F" or "B". Device r runs chunk c as virtual stage
`c * pp + r`, so micro-batches flow 0 -> pp-1 through chunk 0, then again through chunk 1, and so on.
"""

from __future__ import annotations

from loom.cost.plan import SIMULATED_SCHEDULES

__all__ = ["Task", "device_orders", "peak_in_flight"]

Task = tuple[str, int, int]


def _interleaved_index(step: int, pp: int, chunks: int, forward: bool) -> tuple[int, int]:
    """(micro_batch, chunk) of a device's `step`-th forward or backward task in Megatron's interleaved order."""
    group = step % (pp * chunks)
    chunk = group // pp if forward else chunks - 1 - group // pp
    return (step // (pp * chunks)) * pp + step % pp, chunk


def _one_f_one_b(rank: int, pp: int, chunks: int, micro_batches: int) -> list[Task]:
    total = micro_batches * chunks
    warmup = (pp - rank - 1) if chunks == 1 else (pp - rank - 1) * 2 + (chunks - 1) * pp
    warmup = min(warmup, total)
    f = [("F", *_interleaved_index(k, pp, chunks, True)) for k in range(total)]
    b = [("B", *_interleaved_index(k, pp, chunks, False)) for k in range(total)]
    order = f[:warmup]
    for i in range(total - warmup):
        order += [f[warmup + i], b[i]]
    return order + b[total - warmup :]


def device_orders(schedule: str, pp: int, chunks: int, micro_batches: int) -> list[list[Task]]:
    """The task order of each of the `pp` devices for `schedule` (one of `SIMULATED_SCHEDULES`)."""
    if pp < 1 or chunks < 1 or micro_batches < 1:
        raise ValueError(
            f"device_orders: pp, chunks and micro_batches must be >= 1 ({pp}, {chunks}, {micro_batches})"
        )
    if schedule not in SIMULATED_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SIMULATED_SCHEDULES}")
    if schedule == "gpipe":
        if chunks != 1:
            raise ValueError(
                "the gpipe schedule runs one chunk per stage; use 'interleaved' for virtual stages"
            )
        one = [("F", m, 0) for m in range(micro_batches)] + [("B", m, 0) for m in range(micro_batches)]
        return [list(one) for _ in range(pp)]
    if chunks > 1 and micro_batches % pp:
        raise ValueError(
            f"the interleaved schedule needs micro-batches ({micro_batches}) to be a multiple of pp ({pp}); "
            "change the global batch or micro-batch size"
        )
    return [_one_f_one_b(rank, pp, chunks, micro_batches) for rank in range(pp)]


def peak_in_flight(order: list[Task], chunks: int) -> int:
    """Most (micro-batch, chunk) forwards whose backward has not run yet, at any point of `order`."""
    live = peak = 0
    for kind, _, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    assert live == 0, "every forward needs its backward"
    return peak
