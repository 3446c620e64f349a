"""Tier 1: pipeline schedules as task orders, their in-flight memory, and the event engine's timings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loom.sim.engine import play
from loom.sim.schedule import device_orders, peak_in_flight


def test_one_f_one_b_order_of_the_first_and_last_stage():
    orders = device_orders("1f1b", 4, 1, 6)
    assert [k for k, _, _ in orders[0][:4]] == [
        "F",
        "F",
        "F",
        "F",
    ]  # warm-up: pp - rank - 1 forwards, then 1F1B
    assert orders[3][:4] == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]


@given(
    pp=st.integers(1, 8),
    chunks=st.integers(1, 4),
    groups=st.integers(1, 4),
    schedule=st.sampled_from(["1f1b", "interleaved"]),
)
def test_every_task_runs_once_per_device(pp, chunks, groups, schedule):
    micro_batches = pp * groups
    chunks = chunks if schedule == "interleaved" else 1
    for order in device_orders(schedule, pp, chunks, micro_batches):
        assert sorted(order) == sorted(
            (k, m, c) for k in "FB" for m in range(micro_batches) for c in range(chunks)
        )


@pytest.mark.parametrize(
    ("pp", "chunks", "micro_batches"), [(4, 1, 8), (8, 3, 64), (35, 3, 280), (64, 1, 512)]
)
def test_first_stage_holds_korthikanti_in_flight_activations(pp, chunks, micro_batches):
    # Korthikanti et al. Section 4.2.3: the first stage stores L * (1 + (p - 1) / (p * v)) layers' activations
    layers = pp * chunks * 2
    in_flight = peak_in_flight(
        device_orders("interleaved" if chunks > 1 else "1f1b", pp, chunks, micro_batches)[0], chunks
    )
    stored_layers = in_flight * layers // (pp * chunks)
    assert stored_layers == pytest.approx(layers * (1 + (pp - 1) / (pp * chunks)) if chunks > 1 else layers)


def test_gpipe_holds_every_micro_batch():
    assert peak_in_flight(device_orders("gpipe", 4, 1, 16)[0], 1) == 16


def test_interleaved_needs_a_multiple_of_pp_micro_batches():
    with pytest.raises(ValueError, match="multiple of pp"):
        device_orders("interleaved", 4, 2, 6)


@given(pp=st.integers(1, 8), micro_batches=st.integers(1, 32), f=st.floats(0.1, 2), b=st.floats(0.1, 4))
def test_uniform_1f1b_and_gpipe_take_m_plus_p_minus_1_slots(pp, micro_batches, f, b):
    for schedule in ("1f1b", "gpipe"):
        playback = play(
            device_orders(schedule, pp, 1, micro_batches), 1, micro_batches, [f] * pp, [b] * pp, 0.0
        )
        assert playback.makespan == pytest.approx((micro_batches + pp - 1) * (f + b))


def test_interleaving_shrinks_the_bubble_by_the_chunk_count():
    pp, m, chunks = 4, 16, 2
    plain = play(device_orders("1f1b", pp, 1, m), 1, m, [2.0] * pp, [4.0] * pp, 0.0)
    inter = play(device_orders("interleaved", pp, chunks, m), chunks, m, [1.0] * 8, [2.0] * 8, 0.0)
    ideal = m * 6.0
    assert plain.makespan - ideal == pytest.approx((pp - 1) * 6.0)
    assert inter.makespan - ideal == pytest.approx((pp - 1) * 6.0 / chunks)


def test_transfers_between_stages_delay_the_pipeline():
    orders = device_orders("1f1b", 2, 1, 4)
    fast = play(orders, 1, 4, [1.0, 1.0], [2.0, 2.0], 0.0)
    slow = play(orders, 1, 4, [1.0, 1.0], [2.0, 2.0], 0.5, record=True)
    assert fast.makespan == pytest.approx(15.0)
    # at least the fill and drain each cross the link once; at most every micro-batch waits both ways
    assert fast.makespan + 2 * 0.5 <= slow.makespan <= fast.makespan + 2 * 4 * 0.5
    assert len(slow.intervals) == 16


def test_blocking_sends_hold_the_sending_device():
    # 1F1B over 2 devices, 4 micro-batches: device 0 sends each forward's output on, device 1 each backward's
    # input gradient back; a blocking send (Megatron-LM 2021) holds its device for the transfer as well
    orders = device_orders("1f1b", 2, 1, 4)
    overlapped = play(orders, 1, 4, [1.0, 1.0], [2.0, 2.0], 0.5)
    blocking = play(orders, 1, 4, [1.0, 1.0], [2.0, 2.0], 0.5, blocking=True)
    assert overlapped.sending == [0.0, 0.0]
    assert blocking.sending == [4 * 0.5, 4 * 0.5]
    assert blocking.busy == overlapped.busy
    # every send now delays its own device's next task, not only the receiver's
    assert overlapped.makespan < blocking.makespan <= overlapped.makespan + 8 * 0.5
