"""SIGTERM stops a command as Ctrl-C does: a batch scheduler's time limit (or `kill`) raises `Stopped` where the run
is, so the CLIs keep what finished (probe-train's shards and verifiers, probe-bench's problems) and say how to go on.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the run is (a KeyboardInterrupt: whatever keeps finished work on Ctrl-C keeps it)."""


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM raises `Stopped` while the block runs (main thread only; the old handler comes back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def exit_code(err: KeyboardInterrupt) -> int:
    """The shell's code for a command stopped by this signal: 143 (SIGTERM) or 130 (Ctrl-C)."""
    return 128 + (signal.SIGTERM if isinstance(err, Stopped) else signal.SIGINT)
