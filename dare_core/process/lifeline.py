"""A stage ends when whatever started it dies: killing `dvc repro` (or a Prefect worker, or the
shell) must not leave `dare stage` training on as an orphan, nor the launcher and ranks it started.

- `watch_parent()`: a daemon thread of `dare stage` that checks every second whether the process has
  been re-parented (its parent died: it now belongs to init or a subreaper) and then ends it with
  SIGTERM. Polling the parent's pid works whichever thread of the parent started this process (Linux's
  PR_SET_PDEATHSIG fires when that *thread* ends, which a caller's thread pool may do while the
  stage runs), and it costs one system call a second.
- `dies_with_parent()`: the `preexec_fn` for the processes `dare stage` starts itself (the
  launcher, or the one worker): PR_SET_PDEATHSIG, so they get SIGTERM the moment `dare stage` ends,
  however it ended. The launchers pass it on to every rank (and every rank's guard,
  workers/common.py `run_rank`, has its own)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1


def watch_parent(interval_s: float = 1.0, signum: int = signal.SIGTERM) -> bool:
    """Start the watch (see the module docstring); False where there is no parent to watch (this
    process was started by init, or is a container's first process) or where it was asked to
    outlive it: started under `nohup` (SIGHUP ignored), as for a run meant to survive a logout."""
    parent = os.getppid()
    if parent <= 1 or signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return False

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                try:  # (its reader may have died with the parent)
                    print(f"error: the process that started this stage (pid {parent}) ended; stopping",
                          file=sys.stderr, flush=True)
                except (OSError, ValueError):
                    pass
                os.kill(os.getpid(), signum)
                return

    threading.Thread(target=watch, name="dare-parent-watch", daemon=True).start()
    return True


def dies_with_parent(signum: int = signal.SIGTERM) -> Optional[Callable[[], None]]:
    """A `preexec_fn` that has the child receive `signum` when this process ends (Linux); None
    elsewhere. The C function is looked up here, in the parent: between fork and exec the child
    only calls it (no dynamic loading, which could wait on a lock another thread held at the fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)

    return preexec
