"""Worker bodies of the heartbeat tests, in a module that imports next to nothing: a rank's clock
starts when it receives its task, and unpickling a task imports the module of its function (seconds for a
test module on a loaded machine), which would count against these tests' short heartbeat timeouts."""

import os
import time

from loom.dist.env import restart_count
from loom.dist.launch import heartbeat

HEARTBEAT_TIMEOUT_S = 2.5


def beat_then_hang(hang_rank: int) -> int:
    """Steps 1-3 beat; then `hang_rank` hangs."""
    for step in range(1, 4):
        heartbeat(step)
    if int(os.environ["RANK"]) == hang_rank:
        time.sleep(600)
    return 0


def slow_start_then_hang(hang_rank: int) -> int:
    """4 s of start-up, longer than the heartbeat timeout but never silent for long; then `hang_rank` hangs
    in another phase."""
    for _ in range(8):
        heartbeat(phase="warming up")
        time.sleep(0.5)
    if int(os.environ["RANK"]) == hang_rank:
        heartbeat(phase="loading the checkpoint")
        time.sleep(600)
    return 0


def silent_in_first_attempt() -> int:
    """Rank 1 of the first attempt hangs before any heartbeat; the restart answers."""
    if restart_count() == 0 and int(os.environ["RANK"]) == 1:
        time.sleep(600)
    return restart_count()
