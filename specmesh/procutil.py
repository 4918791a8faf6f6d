"""Stopping child processes: signal, wait a grace period, then SIGKILL what is left."""

from __future__ import annotations

import signal
import subprocess


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to timeout_s for proc to exit; past that, SIGKILL and reap it.
    True when it exited on its own."""
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def stop_process(proc: subprocess.Popen, grace_s: float, sig: int = signal.SIGTERM) -> bool:
    """Send sig (if it still runs) and wait_or_kill; True when it exited within grace_s."""
    if proc.poll() is None:
        proc.send_signal(sig)
    return wait_or_kill(proc, grace_s)
