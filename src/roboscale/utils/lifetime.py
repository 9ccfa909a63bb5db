"""Every process roboscale starts ends soon after the process that owns it, whatever ended the owner.

A parent killed outright (SIGKILL, the OOM killer, `kill -9` of torchrun) runs no cleanup, and the kernel's own
notice (``PR_SET_PDEATHSIG``) reaches only a direct child, and only when the *thread* that forked it ends. Most of
our processes are not direct children of their owner: loader workers are forked by a forkserver (which itself
stays alive while they hold its pipe, so the two keep each other alive forever), torchrun starts ranks in
sessions of their own, evaluation workers are spawned by an evaluation that training started. So each process
watches its owner itself: ``exit_with(owner_pid)`` starts a daemon thread that waits on a pidfd of the owner
(Linux >= 5.3; elsewhere it polls) and, once the owner has ended, sends this process SIGTERM (its handlers run:
a rank stops its own workers, which watch it in turn) and SIGKILL ``grace_s`` later.

SIGTERM itself is handled like Ctrl-C in the command-line processes (``terminate_like_interrupt``): it raises
``Terminated``, a ``KeyboardInterrupt``, so every ``finally`` that cleans up after Ctrl-C cleans up after it too,
and the command exits with 143 (128 + SIGTERM) and a message instead of dying silently.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

GRACE_S = 5.0
"""Between the SIGTERM an orphan sends itself and its SIGKILL: time to stop its own workers."""

_POLL_S = 0.5


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is (exit code 143)."""

    exit_code = 128 + signal.SIGTERM


def exit_with(owner_pid: int, *, grace_s: float = GRACE_S) -> None:
    """End this process soon after ``owner_pid`` ends (at once if it already has)."""
    if owner_pid <= 1 or owner_pid == os.getpid():
        return
    when_gone(owner_pid, lambda: _end_this_process(grace_s))


def when_gone(pid: int, action: Callable[[], Any]) -> None:
    """Call ``action`` on a daemon thread once process ``pid`` has ended (at once if it already has)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:  # gone before we looked
        pidfd, pid = None, -1
    except (AttributeError, OSError):  # not Linux, or a kernel without pidfds: poll
        pidfd = None

    def wait_then_act() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # a pidfd turns readable when its process has ended
        else:
            while pid > 0 and alive(pid):
                time.sleep(_POLL_S)
        action()

    threading.Thread(target=wait_then_act, name=f"when-{pid}-ends", daemon=True).start()


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def _end_this_process(grace_s: float) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)  # a handler that cleans up may take this long; one stuck in a collective never returns
    os.kill(os.getpid(), signal.SIGKILL)


def supervise(owner_pid: int, argv: list[str]) -> int:
    """Run ``argv`` in this process's group and kill the whole group (the command and every process it started)
    when ``owner_pid`` ends or this process gets SIGTERM; returns the command's status. Started as ``python -m
    roboscale.utils.lifetime OWNER_PID ARGV...`` in a session of its own, for a command that may not tie its own
    children to itself (any command a caller gives, e.g. an evaluation beside training)."""

    def stop(*_: Any) -> None:
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    when_gone(owner_pid, stop)
    code = subprocess.call(argv)
    if code < 0:  # killed by a signal: end the same way, so that the owner reads the same status
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def run_owned(owner_pid: int, target: Callable[..., Any], *args: Any) -> Any:
    """A process target that first ties this process to ``owner_pid`` (``multiprocessing.Process(target=
    run_owned, args=(os.getpid(), target, ...))``)."""
    exit_with(owner_pid)
    return target(*args)


def terminate_like_interrupt() -> Any:
    """SIGTERM raises ``Terminated`` in the main thread, once; a second SIGTERM ends the process at once (its
    children follow it: they watch it). Returns the handler it replaced (for ``restore_sigterm``)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_terminated(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated("terminated (SIGTERM)")

    return signal.signal(signal.SIGTERM, raise_terminated)


def restore_sigterm(previous: Any) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM that arrive inside the block take effect when it ends, as if sent then. For steps that
    must not be cut in half: a process being spawned that is interrupted before its parent has written its start
    data dies with a traceback (``EOFError: Ran out of input``) printed after the command's own message. Off the
    main thread (where no handler can be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    deferred = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in deferred}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(arrived):
            signal.raise_signal(sig)  # the handler just restored runs now


def interrupted(exc: KeyboardInterrupt, what: str) -> KeyboardInterrupt:
    """The same kind of interrupt (Ctrl-C, or SIGTERM's ``Terminated``), its message saying what it cut short
    and what is intact: ``raise interrupted(exc, "at step 7; ...") from None``."""
    told = type(exc)(f"{str(exc) or 'interrupted'} {what}")
    told.explained = True  # type: ignore[attr-defined]  # an outer handler adds nothing more
    return told


if __name__ == "__main__":
    sys.exit(supervise(int(sys.argv[1]), sys.argv[2:]))
