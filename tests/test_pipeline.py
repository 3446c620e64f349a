"""Tier 1: pipeline stages, partitioning, schedule names, bubble arithmetic, saved-activation tracking."""

import pytest
import torch
from torch import nn

from loom.parallel.pipeline import (
    Event,
    SavedActivations,
    assign_stages,
    balanced_partition,
    bubble_fraction,
    group_blocks,
    pipeline_stage,
    plot_timeline,
    stage_indices,
    stage_of_blocks,
    step_bubbles,
    theoretical_bubble,
    validate_microbatches,
)


def test_balanced_partition_minimises_the_largest_stage():
    assert balanced_partition([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert balanced_partition([4, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    assert balanced_partition([1, 2, 3, 4, 5, 6], 3) == [0, 0, 0, 1, 1, 2]  # 6 | 9 | 6
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3"):
        balanced_partition([1, 1], 3)


def test_marks_and_their_errors():
    blocks = [nn.Linear(2, 2) for _ in range(4)]
    for block, k in zip(blocks, [0, 0, 1, 1], strict=True):
        pipeline_stage(block, k)
    assert group_blocks(blocks) == [[0, 1], [2, 3]]
    del blocks[2].pipeline_stage
    with pytest.raises(ValueError, match="block 2 .* has no pipeline stage"):
        stage_of_blocks(blocks)
    blocks[1].pipeline_stage, blocks[2].pipeline_stage = 1, 0
    with pytest.raises(ValueError, match="block 2 is on stage 0 after a block on stage 1"):
        stage_of_blocks(blocks)
    blocks[2].pipeline_stage = 3
    with pytest.raises(ValueError, match="without gaps"):
        stage_of_blocks(blocks)
    with pytest.raises(ValueError, match="non-negative int"):
        pipeline_stage(blocks[0], -1)


def test_assign_stages_by_parameters_and_by_time():
    blocks = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8)]
    assert assign_stages(blocks, 2) == [0, 0, 0, 1]  # 72 + 72 + 576 = 720 | 520
    assert [b.pipeline_stage for b in blocks] == [0, 0, 0, 1]
    stages = assign_stages(blocks, 2, by="time", sample=torch.randn(4, 8))
    assert stages[0] == 0 and stages[-1] == 1 and sorted(stages) == stages
    with pytest.raises(ValueError, match="needs a sample"):
        assign_stages(blocks, 2, by="time")


def test_schedule_names_placements_and_microbatches():
    assert stage_indices("1f1b", 1, 4) == [1]
    assert stage_indices("interleaved", 1, 4, 2) == [1, 5]
    assert stage_indices("zbv", 1, 4, 2) == [1, 6]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        stage_indices("pipedream", 0, 2)
    with pytest.raises(ValueError, match="takes 2..any stages per rank"):
        stage_indices("interleaved", 0, 2, 1)
    with pytest.raises(ValueError, match="3 micro-batches for 4 pipeline stages"):
        validate_microbatches(3, 4)


def _event(kind, start, end):
    return Event(rank=0, kind=kind, stage=0, microbatch=0, start=start, end=end)


def test_bubble_fraction_counts_idle_and_waiting_time(tmp_path):
    events = [_event("forward", 0, 2), _event("recv", 2, 3), _event("backward", 3, 5), _event("weight", 4, 6)]
    assert bubble_fraction(events) == pytest.approx(1 / 6)
    later = [Event(rank=1, kind="forward", stage=1, microbatch=0, start=2, end=4)]
    # over the whole step (0..6) rank 1 idles 4 of 6; over its own events it never idles
    assert step_bubbles([events, later]) == pytest.approx([1 / 6, 4 / 6])
    assert bubble_fraction(later) == 0.0
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    plot_timeline(events + [_event("send", 2, 2)], str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0


def test_saved_activations_are_counted_until_backward():
    layer = nn.Linear(16, 16)
    tracker = SavedActivations(layer.parameters())
    x = torch.randn(4, 16, requires_grad=True)
    with tracker.hooks():
        out = torch.relu(layer(x)).sum()
    assert tracker.live == tracker.peak > 0  # x (input of the matmul) and the relu output, not the weight
    assert tracker.peak == 2 * 4 * 16 * 4
    out.backward()
    assert tracker.live == 0 and tracker.peak == 2 * 4 * 16 * 4
