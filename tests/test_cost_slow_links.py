"""The slow-link model (loom.cost.slow_links) with exact numbers, and `loom simulate --replicas`."""

import json

import pytest

from loom.cli.main import main
from loom.cost.hardware import Link
from loom.cost.slow_links import compare_sync, ring_all_reduce_s

WAN = Link(name="wan", bandwidth=125e6, latency_s=0.01, efficiency=1.0)  # 1 Gbit/s, 10 ms


def test_ring_all_reduce():
    # 2 (R - 1) latency steps + 2 (R - 1) / R of the bytes over the link
    assert ring_all_reduce_s(4e9, 4, WAN) == pytest.approx(6 * 0.01 + 4e9 * 1.5 / 125e6)
    assert ring_all_reduce_s(4e9, 1, WAN) == 0.0


def _compare(**changes):
    """A billion-parameter model, 4 replicas of 2 s steps over the WAN, syncing every 50 steps (fp32)."""
    return compare_sync(**{"replica_step_s": 2.0, "parameters": 10**9, "replicas": 4, "link": WAN,
                           "sync_every": 50, **changes})  # fmt: skip


def test_synchronous_against_diloco_and_streaming():
    plain = _compare()
    assert plain.synchronous_step_s == pytest.approx(2.0 + 48.06 - 2.0 * 2 / 3)  # the backward hides 4/3 s
    assert plain.diloco_step_s == pytest.approx(2.0 + 48.06 / 50)
    assert plain.synchronous_bytes_per_step == 4e9 and plain.diloco_bytes_per_step == 4e9 / 50
    assert plain.byte_reduction == pytest.approx(50)
    streamed = _compare(fragments=5, fragment_delay=4)
    assert streamed.diloco_step_s == pytest.approx(
        2.0 + 5 * (9.66 - 8.0) / 50
    )  # 8 s of inner steps hide most
    hidden = _compare(fragments=10, fragment_delay=4, outer_bytes_per_value=2)
    assert hidden.diloco_step_s == 2.0 and hidden.diloco_bytes_per_step == 2e9 / 50
    # ten fragments each hidden behind 9 steps still need the link for 48 s of every 10 steps
    busy = _compare(replica_step_s=1.0, sync_every=10, fragments=10, fragment_delay=9)
    assert busy.diloco_step_s == pytest.approx(10 * (0.06 + 4e8 * 1.5 / 125e6) / 10)
    alone = _compare(replicas=1)
    assert alone.synchronous_step_s == alone.diloco_step_s == 2.0 and alone.byte_reduction == 1.0


def test_bad_streaming_settings():
    with pytest.raises(ValueError, match="fragments <= sync_every"):
        compare_sync(replica_step_s=1.0, parameters=10, replicas=2, link=WAN, sync_every=4, fragments=5)


def test_simulate_prices_replicas_over_a_slow_link(capsys):
    replica = ["--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--global-batch", "64", "--seq", "4096",
               "--recompute", "full"]  # fmt: skip
    slow = [
        "--replicas",
        "4",
        "--link-gbps",
        "1",
        "--sync-every",
        "100",
        "--fragments",
        "4",
        "--fragment-delay",
        "5",
    ]
    assert main(["simulate", *replica, *slow, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    result = data["slow_links"]
    assert result["replica_step_s"] == data["iteration_s"] and result["sync_every"] == 100
    assert result["speedup"] > 1 and result["byte_reduction"] == pytest.approx(100)
    assert main(["simulate", *replica, *slow]) == 0
    assert "DiLoCo steps" in capsys.readouterr().out
    assert main(["simulate", *replica, "--replicas", "4", "--link-gbps", "0"]) == 2
    assert "--link-gbps 0.0 must be > 0" in capsys.readouterr().err
