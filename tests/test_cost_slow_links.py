"""The slow-link model (loom.cost.slow_links) with exact numbers, and `loom simulate --replicas` (or a config's
`[parallel] sync`)."""

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


DEMO = "configs/demo.toml"
REPLICAS = ["--parallel.optimizer_level", "0", "--train.workers", "4"]  # dp 2 x tp 2: 2 replicas of tp 2


def _simulate_json(capsys, *args):
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("sync, method", [("diloco", "DiLoCo"), ("local_sgd", "local SGD")])
def test_a_config_whose_replicas_step_alone_is_priced_as_one_replica(capsys, sync, method):
    keys = ["--parallel.sync", sync, "--parallel.sync_every", "10", "--link-gbps", "2"]
    data = _simulate_json(capsys, DEMO, *REPLICAS, *keys)
    # the main figures are one replica's: the same model on its 2 tp ranks with its half of the batch
    replica = _simulate_json(capsys, DEMO, *REPLICAS, "--parallel.dp", "1", "--train.workers", "2",
                             "--train.global_batch", "16")  # fmt: skip
    assert data["plan"] == replica["plan"] and data["iteration_s"] == replica["iteration_s"]
    slow = data["slow_links"]
    assert slow["method"] == method and slow["replicas"] == 2 and slow["sync_every"] == 10
    assert slow["replica_step_s"] == data["iteration_s"]
    fp32_bytes = 4 * data["parameters"]
    assert slow["synchronous_bytes_per_step"] == fp32_bytes
    assert slow["diloco_bytes_per_step"] == pytest.approx(fp32_bytes / 10)
    link = Link(name="slow link", bandwidth=2e9 / 8, latency_s=0.01, efficiency=1.0)
    expected = compare_sync(replica_step_s=data["iteration_s"], parameters=data["parameters"], replicas=2,
                            link=link, sync_every=10)  # fmt: skip
    assert slow["synchronous_step_s"] == pytest.approx(expected.synchronous_step_s, rel=1e-12)
    assert slow["diloco_step_s"] == pytest.approx(expected.diloco_step_s, rel=1e-12)


def test_a_config_reads_its_streaming_keys(capsys):
    keys = ["--parallel.sync", "diloco", "--parallel.sync_every", "8", "--parallel.fragments", "4",
            "--parallel.fragment_delay", "2", "--parallel.outer_dtype", "bf16"]  # fmt: skip
    slow = _simulate_json(capsys, DEMO, *REPLICAS, *keys)["slow_links"]
    parameters = _simulate_json(capsys, DEMO, *REPLICAS)["parameters"]
    assert slow["diloco_bytes_per_step"] == pytest.approx(2 * parameters / 8)  # bf16 pseudo-gradients
    assert main(["simulate", DEMO, *REPLICAS, *keys]) == 0
    assert "(DiLoCo: sync every 8, 4 fragment(s), delay 2, bf16)" in " ".join(capsys.readouterr().out.split())


def test_a_config_that_syncs_every_step_has_no_slow_link_table(capsys):
    assert "slow_links" not in _simulate_json(capsys, DEMO, *REPLICAS)


@pytest.mark.parametrize(
    "args, message",
    [
        ([DEMO, "--sync-every", "3"], "how replicas meet ([parallel] sync), priced as loom train runs them; leave "
         "out --sync-every"),
        (["--model", "llama3-8b", "--fragments", "2"], "--fragments price replicas over a slow link: give "
         "--replicas N too"),
    ],
)  # fmt: skip
def test_sync_flags_that_do_not_apply_are_usage_errors(capsys, args, message):
    assert main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err


def test_replicas_with_data_parallel_ranks_inside_are_priced_as_one_of_them(capsys):
    # 4 workers, dp 4: 2 replicas of dp 2 (level 1 inside each), against one run of dp 2 on 2 workers
    keys = [
        "--parallel.sync",
        "diloco",
        "--parallel.replicas",
        "2",
        "--parallel.tp",
        "1",
        "--parallel.dp",
        "4",
    ]
    data = _simulate_json(capsys, DEMO, "--train.workers", "4", *keys)
    replica = _simulate_json(capsys, DEMO, "--train.workers", "2", "--parallel.tp", "1", "--parallel.dp", "2",
                             "--train.global_batch", "16")  # fmt: skip
    assert data["plan"] == replica["plan"] and data["iteration_s"] == replica["iteration_s"]
    assert data["plan"]["dp"] == 2 and data["plan"]["optimizer_level"] == 1
    assert data["slow_links"]["replicas"] == 2
