"""Stop signals held back while a block's work must be done whole (an optimizer step and its count; a task's process
started and registered)."""
import contextlib
import signal
import threading
from collections.abc import Iterable
from typing import Optional

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@contextlib.contextmanager
def stop_signals_deferred(kept: Optional[list[int]] = None):
    """Holds back, until the block ends, the Python handlers of SIGINT, SIGTERM and SIGHUP (Ctrl-C's
    KeyboardInterrupt, Lightning's, the schedule's own, the default's exit): a signal that came meanwhile is raised
    again as the block ends, to its own handler; or, given ``kept`` and where the block ends without an exception,
    put in ``kept``, for the caller to raise where its work is whole (`raise_signals`). (Python runs signal handlers
    in the main thread alone: elsewhere, nothing to hold back. A signal mask would be inherited by a process started
    inside the block, and would not hold back a handler another thread's signal trips.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    held = {}
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        handler = signal.getsignal(sig) if sig is not None else None
        if handler is not None and handler is not signal.SIG_IGN:  # (None: a handler set outside Python, kept)
            held[sig] = handler
            signal.signal(sig, lambda signum, frame: came.append(signum))
    whole = False
    try:
        yield
        whole = True
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        if whole and kept is not None:
            kept.extend(sig for sig in dict.fromkeys(came) if sig not in kept)
        else:
            raise_signals(dict.fromkeys(came))


def raise_signals(signals: Iterable[int]) -> None:
    """Raises each of ``signals`` to its handler now (those `stop_signals_deferred` kept)."""
    for sig in signals:
        signal.raise_signal(sig)
