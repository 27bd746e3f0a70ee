import os
import signal
import threading

import pytest

from lightning_multilora.signals import stop_signals_deferred


def test_a_ctrl_c_inside_the_block_is_raised_as_it_ends():
    """The block's work is done whole: the KeyboardInterrupt comes after its last statement, not inside it."""
    done = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with stop_signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("after the signal")
        assert done == ["after the signal"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_held_handlers_run_once_each_after_the_block_and_are_put_back():
    came = []
    handler = lambda signum, frame: came.append(signum)  # noqa: E731
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with stop_signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGHUP)
            assert came == []
        assert sorted(came) == sorted([signal.SIGTERM, signal.SIGHUP])
        assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGHUP) is handler
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def test_an_ignored_signal_stays_ignored_and_a_block_with_no_signal_raises_nothing():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals_deferred():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_outside_the_main_thread_nothing_is_held():
    """(Python lets the main thread alone set handlers: elsewhere the block runs as it is.)"""
    seen = []

    def work():
        with stop_signals_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGINT)]


def test_signals_kept_for_the_caller_where_the_block_ends_whole_and_raised_where_it_fails():
    """(`kept`: the optimizer step's, raised to their handlers as the batch ends, `raise_signals`.)"""
    from lightning_multilora.signals import raise_signals

    came = []
    handler = lambda signum, frame: came.append(signum)  # noqa: E731
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        kept: list[int] = []
        with stop_signals_deferred(kept):
            os.kill(os.getpid(), signal.SIGTERM)
        assert kept == [signal.SIGTERM] and came == []
        raise_signals(kept)
        assert came == [signal.SIGTERM]
        kept = []
        with pytest.raises(RuntimeError, match="step failed"):
            with stop_signals_deferred(kept):
                os.kill(os.getpid(), signal.SIGTERM)
                raise RuntimeError("step failed")
        assert kept == [] and came == [signal.SIGTERM] * 2  # (raised as the block failed: nothing left to keep)
    finally:
        signal.signal(signal.SIGTERM, previous)
