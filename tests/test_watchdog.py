"""The hang report: one stack dump per stall, re-armed by the next finished step; a bad limit is a
one-line config error."""

import time

import pytest

from components.train.config import load_config
from components.errors import UserError
from components.train.watchdog import StepWatchdog


def _wait_for(cond, seconds=5.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_stall_prints_stacks_once_and_a_step_rearms_it(tmp_path):
    log = tmp_path / "hang.txt"
    with open(log, "w") as out:
        dog = StepWatchdog(timeout_s=0.2, rank=3, out=out)
        assert _wait_for(lambda: dog.reports == 1)
        time.sleep(0.4)  # still stalled: no second report
        assert dog.reports == 1
        dog.beat(7)
        assert _wait_for(lambda: dog.reports == 2)
        dog.close()
    text = log.read_text()
    assert text.count("no training step has finished") == 2
    assert "[rank 3]" in text and "last finished: step 7" in text
    assert "test_watchdog.py" in text  # the main thread's stack, waiting in this test


def test_steps_in_time_print_nothing(tmp_path):
    log = tmp_path / "hang.txt"
    with open(log, "w") as out:
        dog = StepWatchdog(timeout_s=0.3, rank=0, out=out)
        for step in range(10):
            time.sleep(0.05)
            dog.beat(step)
        dog.close()
    assert dog.reports == 0 and log.read_text() == ""


def test_off_and_bad_limit():
    dog = StepWatchdog(timeout_s=0, rank=0)
    assert dog._thread is None
    dog.close()
    with pytest.raises(UserError, match="hang_report_s"):
        load_config(["--job.config_file", "train_configs/debug_cpu.toml", "--training.hang_report_s", "-1"])
