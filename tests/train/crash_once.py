"""`python -m tests.train.crash_once train ...`: `roboscale train`, except that on torchrun's first attempt rank 1
fails right after its first checkpoint: SIGKILL (a rank lost to the OOM killer or a dead node) or, with
``CRASH_ONCE_SIGNAL=SIGSTOP``, stopped (a hung rank: a debugger, a frozen mount)."""

from __future__ import annotations

import os
import signal
import sys

from roboscale.cli import main
from roboscale.train.trainer import Trainer

if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == "1":
        checkpoint = Trainer.checkpoint
        how = getattr(signal, os.environ.get("CRASH_ONCE_SIGNAL", "SIGKILL"))

        def checkpoint_then_fail(self):
            saved = checkpoint(self)
            if saved is not None:
                os.kill(os.getpid(), how)
            return saved

        Trainer.checkpoint = checkpoint_then_fail
    raise SystemExit(main(sys.argv[1:]))
