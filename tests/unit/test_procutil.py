"""specmesh.procutil: SIGTERM, wait, SIGKILL what is left (real `sh` children)."""

import subprocess
import time

from specmesh.procutil import stop_process, wait_or_kill


def _sh(script):
    proc = subprocess.Popen(["sh", "-c", script])
    time.sleep(0.3)  # the trap is installed
    return proc


def test_a_child_that_exits_on_sigterm_stops_cleanly():
    proc = _sh("trap 'exit 0' TERM; while :; do sleep 0.1; done")
    assert stop_process(proc, 5) is True and proc.returncode == 0


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    proc = _sh("trap '' TERM; while :; do sleep 0.1; done")
    t0 = time.monotonic()
    assert stop_process(proc, 0.5) is False
    assert proc.returncode == -9 and time.monotonic() - t0 < 5


def test_wait_or_kill_on_an_exited_child_is_true():
    proc = subprocess.Popen(["true"])
    assert wait_or_kill(proc, 5) is True and stop_process(proc, 1) is True
