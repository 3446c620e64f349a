"""Tier 1: what the commands print, checked in-process without workers: `loom train`'s plan summary, final
summary, checkpoint lines and per-job warnings; `loom simulate`'s bubble and timelines; `loom bench`'s link."""

from __future__ import annotations

import logging
import warnings

import pytest

from loom.cli.bench import link_lines
from loom.cli.main import main
from loom.cost.calibrate import PLACEHOLDER_LINK, build_profile, link_check
from loom.sim.simulator import BUBBLE_DEFINITION
from loom.sim.timeline import READABLE_BOXES, draw_timeline, zoom_end
from loom.train.report import describe_save, group_layouts, main_rank_warnings, steps_summary

# ---- loom train ------------------------------------------------------------------------------------------


def _rows(layers: int) -> list[tuple]:
    rows = [("embedding", (256, 128), "(2, 1) [tp, -]", (128, 128))]
    for i in range(layers):
        rows += [
            (f"blocks.{i}.norm1.weight", (128,), "(1,) [-]", (128,)),
            (f"blocks.{i}.attention.wq", (128, 128), "(1, 2) [-, tp]", (128, 64)),
            (f"blocks.{i}.attention.wk", (128, 128), "(1, 2) [-, tp]", (128, 64)),
            (f"blocks.{i}.attention.wo", (128, 128), "(2, 1) [tp, -]", (64, 128)),
        ]
    return rows


def test_plan_summary_has_a_line_per_layout_pattern_whatever_the_depth():
    shallow, deep = group_layouts(_rows(2)), group_layouts(_rows(96))
    assert len(shallow) == len(deep) == 4  # embedding, norms, column-parallel, row-parallel
    assert any(
        line.split()[0] == "192" and "blocks.*.attention.wq, blocks.*.attention.wk" in line for line in deep
    )
    assert any(line.split()[0] == "96" and "blocks.*.attention.wo" in line for line in deep)


def test_verbose_plan_lists_every_parameter():
    lines = group_layouts(_rows(3), verbose=True)
    assert len(lines) == 1 + 4 * 3 and "blocks.2.attention.wo" in lines[-1]


@pytest.mark.parametrize(
    ("losses", "first", "expected"),
    [
        ([], 1, "no steps run (train.steps was already reached"),
        ([2.5], 1, "1 step (step 1): loss 2.500"),
        ([2.5, 2.0, 1.5], 8, "3 steps (steps 8-10): loss 2.500 -> 2.000 -> 1.500"),
        ([3.0] + [2.0] * 8 + [1.0], 1, "10 steps: loss 3.000 (step 1) -> 1.000 (step 10)"),
        (
            [3.0] * 10 + [1.0] * 15,
            1,
            "25 steps: loss 3.000 (mean of steps 1-10) -> 1.000 (mean of steps 16-25)",
        ),
        ([1.0, float("nan")], 1, "(not finite!)"),
    ],
    ids=["none", "one", "few", "under_20", "many", "not_finite"],
)
def test_final_summary_reads_right_for_any_step_count(losses, first, expected):
    assert expected in steps_summary(losses, first)


def test_checkpoint_line_names_step_size_and_seconds(tmp_path):
    step = tmp_path / "step_000120"
    (step / "sub").mkdir(parents=True)
    (step / "a").write_bytes(b"x" * 1_500_000)
    (step / "sub" / "b").write_bytes(b"x" * 500_000)
    line = describe_save(step, 0.4567)
    assert line == f"checkpoint step 120 saved: {step} (2.0 MB, 0.46 s)"


def test_other_ranks_warnings_are_silenced_and_restored(capfd):
    torch_logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    level = logging.getLogger("torch").level
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with main_rank_warnings(is_main=False):
            warnings.warn("from rank 1", UserWarning, stacklevel=1)
            torch_logger.warning("CPU process group does not support alltoall yet")
        with main_rank_warnings(is_main=True):
            warnings.warn("from rank 0", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["from rank 0"]
    assert "alltoall" not in capfd.readouterr().err
    assert logging.getLogger("torch").level == level


# ---- loom simulate ---------------------------------------------------------------------------------------

README_TIMELINE = ["--model", "gpt3-175b", "--gpus", "64", "--tp", "8", "--pp", "8", "--interleave", "3"]
README_TIMELINE += ["--global-batch", "64"]


def test_readme_timeline_says_what_it_wrote_and_why_it_exits_1(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main(["simulate", *README_TIMELINE, "--timeline", str(png)]) == 1
    err = capsys.readouterr().err
    assert png.stat().st_size > 0
    assert "the plan does not fit: needs" in err
    assert f"wrote {png}" in err and "exit status 1 because it does not fit" in err


def test_bubble_is_one_number_with_its_definition(capsys):
    args = [*README_TIMELINE, "--recompute", "selective", "--sequence-parallel"]
    assert main(["simulate", *args]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert " ".join(BUBBLE_DEFINITION.split()) in out
    assert main(["simulate", *args, "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    share = data["breakdown"]["pipeline_bubble"] / data["iteration_s"]
    assert data["bubble_fraction"] == pytest.approx(share) and 0 < share < 1
    assert data["bubble_definition"] == BUBBLE_DEFINITION


def _intervals(pp: int, micro: int) -> list[tuple]:
    """A GPipe-like schedule: every micro-batch's forward, then its backward, 1 s each, offset per stage."""
    out = []
    for d in range(pp):
        for m in range(micro):
            out.append((d, "F", m, 0, d + m, d + m + 1.0))
            out.append((d, "B", m, 0, pp + micro + d + m, pp + micro + d + m + 1.0))
    return out


def test_long_timelines_get_a_readable_zoom(tmp_path):
    assert zoom_end(_intervals(4, 8), 4) is None  # 16 boxes a row: readable as it is
    many = _intervals(4, 64)
    end = zoom_end(many, 4)
    assert end is not None
    for d in range(4):
        assert sum(1 for iv in many if iv[0] == d and iv[4] < end) <= READABLE_BOXES
    pytest.importorskip("matplotlib")
    line = draw_timeline(_intervals(2, 40), 2, tmp_path / "t.png")
    assert "zoom on its first" in line and (tmp_path / "t.png").stat().st_size > 0


# ---- loom bench ------------------------------------------------------------------------------------------


def _ranks(all_reduce: list[tuple[int, float]]) -> list[dict]:
    rank = {
        "matmul": [
            {"size": 128, "seconds": 1e-3, "flops_per_s": 4e9},
            {"size": 512, "seconds": 3e-2, "flops_per_s": 9e9},
        ],
        "memory_bandwidth": 1e10,
        "kernel_overhead_s": 5e-6,
        "collectives": [
            {"kind": "all_reduce", "bytes": b, "seconds": s, "algbw": b / s, "busbw": b / s}
            for b, s in all_reduce
        ],
    }
    return [rank, rank]


def test_one_size_fits_the_link_to_its_measurement():
    result = build_profile(_ranks([(65536, 65536 / 0.032e9)]), 2)  # 0.032 GB/s measured (2 ranks: busbw)
    assert result.cluster.intra.bandwidth == pytest.approx(0.032e9)
    [(_, measured, predicted)] = link_check(result)
    assert predicted == pytest.approx(measured)
    assert "from one size (no latency term" in link_lines(result)[0]


def test_the_fit_reproduces_latency_plus_bandwidth_measurements():
    latency, bandwidth = 20e-6, 2e9  # per step (2 on 2 ranks), bytes/s of bus
    points = [(b, 2 * latency + b / bandwidth) for b in (4096, 65536, 1 << 20)]
    result = build_profile(_ranks(points), 2)
    link = result.cluster.intra
    assert link.bandwidth == pytest.approx(bandwidth) and link.latency_s == pytest.approx(latency)
    assert all(p == pytest.approx(m) for _, m, p in link_check(result))
    lines = link_lines(result)
    assert "the large-buffer limit" in lines[0] and "within 0% of every size" in lines[1]


def test_one_rank_reports_a_placeholder_link():
    result = build_profile(_ranks([]), 1)
    assert (result.cluster.intra.latency_s, result.cluster.intra.bandwidth) == PLACEHOLDER_LINK
    assert "no all-reduce measured on 1 rank(s); the profile keeps a placeholder" in link_lines(result)[0]
