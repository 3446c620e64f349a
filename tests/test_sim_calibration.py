"""Tier 2: the simulator takes a profile calibrated on this machine (`loom bench`'s measurements, taken on 2
CPU ranks between steps of a real data-parallel training run) and predicts that run's step. How close the
prediction comes is timing, so it is measured in `benchmarks/simulator_calibration.py`, not asserted here."""

import math

from benchmarks.simulator_calibration import predict, train_and_calibrate


def test_a_calibrated_profile_drives_the_simulator(worker_pool):
    ranks = worker_pool.run(2, train_and_calibrate, 2, 1, timeout=600)
    assert all(r["step_s"] > 0 for r in ranks)
    predicted = predict(ranks)
    assert math.isfinite(predicted) and predicted > 0
