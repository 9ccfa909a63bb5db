"""``signals_deferred``: Ctrl-C or SIGTERM inside the block acts when the block ends, with the handler then in
place; nothing is lost and nothing acts early."""

from __future__ import annotations

import signal
import threading

import pytest

from roboscale.utils.lifetime import Terminated, restore_sigterm, signals_deferred, terminate_like_interrupt


def _send_to_this_thread(signum: int) -> None:
    """The signal to the main thread itself: ``os.kill`` lets the kernel pick any thread of the process (the test
    process has many by now), whose handler may then run after the block ended."""
    signal.pthread_kill(threading.get_ident(), signum)


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test: pytest started as a background job of a non-interactive shell
    (``make test &``, CI scripts) inherits SIGINT ignored, and Python then installs no handler of its own; a
    deferred signal does what the handler in place does, which would be nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_inside_the_block_is_raised_when_it_ends(python_sigint) -> None:
    finished = False
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        _send_to_this_thread(signal.SIGINT)
        finished = True  # the block was not cut short
    assert finished


def test_sigterm_inside_the_block_raises_terminated_after_it() -> None:
    previous = terminate_like_interrupt()
    try:
        finished = False
        with pytest.raises(Terminated), signals_deferred():
            _send_to_this_thread(signal.SIGTERM)
            finished = True
        assert finished
    finally:
        restore_sigterm(previous)


def test_without_a_signal_the_handlers_are_restored_untouched() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with signals_deferred():
        pass
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
