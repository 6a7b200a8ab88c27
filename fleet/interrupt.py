"""How a driver (``rlfleet demo``, ``rlfleet faults run``) ends on a signal with its report written.

``catch_signals`` makes SIGINT and SIGTERM raise ``Interrupted`` (a ``KeyboardInterrupt``: no
``except Exception`` on the way swallows it) in the main thread; the driver catches it, shuts
down what it started, writes what it has, and exits ``128 + signal``. Only the first signal
interrupts: a different one at once is noted, not raised again (when a signal sent to the
whole process group also stops the local Ray, Ray interrupts the main thread as if by
SIGINT, along with the SIGTERM that was sent). The same signal again more than a second
later (a second Ctrl-C) exits at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM) asked the run to end: raised in the main thread, like Ctrl-C's."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_SIGNALS: list[tuple[int, float]] = []  # (signal, monotonic time) of each signal the run got


def _raise_interrupted(signum, _frame) -> None:
    now = time.monotonic()
    first = _SIGNALS[0] if _SIGNALS else None
    _SIGNALS.append((signum, now))
    if first is None:
        raise Interrupted(signum)
    if signum == first[0] and now - first[1] > 1.0:  # the same signal again, later: a second Ctrl-C, stop now
        os._exit(128 + signum)
    # Another signal at once: the run is already stopping (module docstring).


def interrupted_by() -> str | None:
    """The signal that ended the run (SIGTERM if one came: Ray's own interruption is a SIGINT), or None."""
    if not _SIGNALS:
        return None
    got = {s for s, _ in _SIGNALS}
    return "SIGTERM" if signal.SIGTERM in got else signal.Signals(_SIGNALS[0][0]).name


def exit_status(name: str) -> int:
    """The exit status of a run that ``name`` (``SIGINT``, ``SIGTERM``) ended: 128 + its number, as a shell reports it."""
    return 128 + int(signal.Signals[name])


def catch_signals(fresh: bool = False) -> dict:
    """SIGINT and SIGTERM raise ``Interrupted`` from now on (Ray's start-up installs a SIGTERM handler of its
    own, so a driver runs this again after it); returns the handlers it replaced. ``fresh``: forget the
    signals of an earlier run in this process. Only the main thread can do it."""
    if fresh:
        _SIGNALS.clear()
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # a caller that ignores a signal keeps ignoring it
            old[sig] = signal.signal(sig, _raise_interrupted)
    return old


def restore(handlers: dict) -> None:
    """Put back the handlers ``catch_signals`` replaced."""
    for sig, old in handlers.items():
        signal.signal(sig, old)
