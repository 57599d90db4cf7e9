"""A scheduler stop that hangs still ends: the watchdog armed by the first SIGTERM/SIGINT prints
every thread's stack and exits with code 3 (scheduler_svc/cli.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.support.stack import ROOT


def test_watchdog_prints_stacks_and_exits_when_a_stop_hangs() -> None:
    code = (
        "import threading, time\n"
        "from scheduler_svc.cli import arm_stop_watchdog\n"
        "threading.Thread(target=time.sleep, args=(60,), name='stuck-worker').start()\n"
        "arm_stop_watchdog(0.5)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3
    assert time.monotonic() - t0 < 30
    assert "still stopping" in proc.stderr
    assert proc.stderr.count("Thread 0x") >= 2  # the main thread and the stuck worker


def test_watchdog_does_nothing_when_the_process_ends_first() -> None:
    code = "from scheduler_svc.cli import arm_stop_watchdog\narm_stop_watchdog(30)\nprint('bye')\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "bye")
