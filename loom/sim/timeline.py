"""Draw a simulated pipeline schedule (one row per pipeline stage, forward and backward boxes) with matplotlib.

matplotlib is optional: `draw_timeline` raises `MissingDependency` with an install hint when it is absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["MissingDependency", "draw_timeline", "require_matplotlib"]

_HINT = "--timeline needs matplotlib, which is not installed: pip install matplotlib (or drop --timeline)"


class MissingDependency(RuntimeError):
    """An optional package that a feature needs is not installed."""


def require_matplotlib() -> None:
    """Raise `MissingDependency` with an install hint when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(_HINT) from exc


def draw_timeline(
    intervals: Sequence[tuple[int, str, int, int, float, float]], pp: int, path: str | Path, title: str = ""
) -> None:
    """Save a Gantt chart of `intervals` (device, kind, micro-batch, chunk, start, end) to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependency(_HINT) from exc
    fig, ax = plt.subplots(figsize=(14, 1 + 0.4 * pp))
    colours = {"F": ("#4c72b0", "#8fb0e0"), "B": ("#dd8452", "#f2bc94")}
    for device, kind, micro_batch, chunk, start, end in intervals:
        colour = colours[kind][chunk % 2]  # alternate shades tell the chunks of an interleaved stage apart
        ax.barh(device, end - start, left=start, color=colour, edgecolor="white", linewidth=0.3)
        if pp <= 16 and len(intervals) <= 2000:
            ax.text((start + end) / 2, device, str(micro_batch), ha="center", va="center", fontsize=5)
    ax.set_yticks(range(pp), [f"stage {d}" for d in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (blue: forward, orange: backward; shades: chunks)")
    ax.set_title(title or "simulated pipeline schedule")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
