"""Draw a simulated pipeline schedule (one row per pipeline stage, forward and backward boxes) with matplotlib.

matplotlib is optional: `draw_timeline` raises `MissingDependency` with an install hint when it is absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["MissingDependency", "draw_timeline", "require_matplotlib", "zoom_end"]

_HINT = "--timeline needs matplotlib, which is not installed: pip install matplotlib (or drop --timeline)"


class MissingDependency(RuntimeError):
    """An optional package that a feature needs is not installed."""


def require_matplotlib() -> None:
    """Raise `MissingDependency` with an install hint when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(_HINT) from exc


# At most this many boxes across one device's row of a panel: beyond it boxes are thinner than their labels.
READABLE_BOXES = 48


def zoom_end(intervals: Sequence[tuple[int, str, int, int, float, float]], pp: int) -> float | None:
    """The end of a zoomed window from time 0 in which every device shows at most `READABLE_BOXES` boxes
    (None: the whole schedule is readable as it is)."""
    per_device = [sorted(end for device, _, _, _, _, end in intervals if device == d) for d in range(pp)]
    if max((len(ends) for ends in per_device), default=0) <= READABLE_BOXES:
        return None
    return min(ends[READABLE_BOXES - 1] for ends in per_device if len(ends) >= READABLE_BOXES)


def draw_timeline(
    intervals: Sequence[tuple[int, str, int, int, float, float]], pp: int, path: str | Path, title: str = ""
) -> str:
    """Save a Gantt chart of `intervals` (device, kind, micro-batch, chunk, start, end) to `path`; returns a
    line saying what was drawn.

    Any number of micro-batches stays readable: when a device runs more than `READABLE_BOXES` passes, the
    picture has two panels, the whole step (boxes unlabelled) and a zoom on its start (`zoom_end`: about
    `READABLE_BOXES` passes per device, labelled with their micro-batch), whose window is shaded in the first.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependency(_HINT) from exc
    zoom = zoom_end(intervals, pp)
    panels = 1 if zoom is None else 2
    fig, axes = plt.subplots(panels, 1, figsize=(14, panels * (1 + 0.4 * pp)), squeeze=False)
    makespan = max((end for *_, end in intervals), default=0.0)
    _panel(axes[0][0], intervals, pp, labels=zoom is None and pp <= 16)
    axes[0][0].set_title(title or "simulated pipeline schedule")
    axes[0][0].set_xlim(0, makespan or 1.0)
    what = f"whole step ({makespan:.3g} s)"
    if zoom is not None:
        axes[0][0].axvspan(0, zoom, color="#999999", alpha=0.15, linewidth=0)
        inside = [iv for iv in intervals if iv[4] < zoom]
        _panel(axes[1][0], inside, pp, labels=pp <= 16)
        axes[1][0].set_xlim(0, zoom)
        axes[1][0].set_title(
            f"zoom: the first {zoom:.3g} s of {makespan:.3g} s (shaded above), labelled with micro-batches",
            fontsize=9,
        )
        what += f" and a zoom on its first {zoom:.3g} s"
    axes[-1][0].set_xlabel("seconds (blue: forward, orange: backward; shades: chunks)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return f"{path}: the simulated pipeline schedule, {what}"


def _panel(ax, intervals: Sequence[tuple], pp: int, *, labels: bool) -> None:
    colours = {"F": ("#4c72b0", "#8fb0e0"), "B": ("#dd8452", "#f2bc94")}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for device, kind, micro_batch, chunk, start, end in intervals:
        colour = colours[kind][chunk % 2]  # alternate shades tell the chunks of an interleaved stage apart
        bars.setdefault((device, colour), []).append((start, end - start))
        if labels:
            ax.text((start + end) / 2, device, str(micro_batch), ha="center", va="center", fontsize=5)
    for (device, colour), spans in bars.items():  # one artist per row and colour: fast at any count
        ax.broken_barh(spans, (device - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(pp), [f"stage {d}" for d in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)
