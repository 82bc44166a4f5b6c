"""What every stage worker shares: argument parsing, logging, clean errors.

`run_reporting_errors` is the one place that turns an expected failure into `error: <message>`
(one line on stderr, no traceback unless `--debug`); stage workers and the `dare` command both
go through it. In a job of several ranks the line names the rank (`error: rank 1: ...`), and
`python -m dare_core.workers.common <worker>` (`run_rank`), what the launchers start on each rank,
names a rank whose worker a signal killed.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from dare_core.config import ConfigError, DareConfig, load_config
from dare_core.process.exits import killed_by
from dare_core.process.threads import configure_threads, log_threads
from dare_core.workers.rank_output import NativeNoiseFilter, lost_contact, native_error_message, parse_collective

# failures a user can act on from the message alone: ValueError covers ConfigError, UserError,
# UnicodeDecodeError and JSONDecodeError (wrapped where the file is read, so the message names it);
# OSError covers missing files, permissions and a full or read-only disk. Anything else is a bug
# and keeps its traceback.
EXPECTED_ERRORS: tuple = (ConfigError, ValueError, OSError)
# exit code 2 (bad input, as argparse uses); other expected failures (disk full, a child process
# that failed) exit 1
USER_ERRORS: tuple = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def error_message(exc: BaseException) -> str:
    """The one-line message of an expected failure; an OSError names its path."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
        text = f"{where}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def rank_label() -> str:
    """`rank N: ` in a process that is one of several ranks (the launchers set WORLD_SIZE and RANK),
    else nothing: an error line of a multi-rank job says which rank it comes from."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return ""
    host = f" on {socket.gethostname()}" if several_nodes() else ""
    return f"rank {os.environ.get('RANK', '?')}{host}: "


def several_nodes() -> bool:
    """The job spans nodes: its world is larger than this node's share (torchrun: LOCAL_WORLD_SIZE,
    the deepspeed launcher: LOCAL_SIZE)."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return local is not None and local != os.environ.get("WORLD_SIZE")


def report_error(exc: BaseException, debug: bool = False) -> int:
    """Print `exc` as `error: <message>` on stderr (after its traceback under --debug); return the
    exit code."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"error: {rank_label()}{error_message(exc)}", file=sys.stderr)
    return 2 if isinstance(exc, USER_ERRORS) else 1


def run_reporting_errors(fn: Callable[[], Optional[int]], debug: bool = False) -> int:
    """`fn()`'s exit code (None counts as 0), or the code of the expected failure it raised."""
    try:
        return fn() or 0
    except EXPECTED_ERRORS as exc:
        return report_error(exc, debug)
    except Exception as exc:
        if not rank_label():
            raise  # a bug: Python prints its traceback
        # one of several ranks: the traceback of a bug (not of a lost peer, unless --debug), then
        # the line that names this rank
        lost = collective_failure(exc)
        if debug or not lost:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        print(f"error: {rank_label()}{lost or type(exc).__name__ + ': ' + error_message(exc)}", file=sys.stderr)
        return 1


# how the process group reports a peer that died (its connection closed) or hangs (the wait timed
# out, launch.timeout_s), as gloo and NCCL word it
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Watchdog caught collective")


def collective_failure(exc: BaseException) -> Optional[str]:
    """The message of a rank whose wait on the others failed, naming the collective where the
    error or its traceback does; None for other errors."""
    text = error_message(exc)
    peer_lost = any(m in text for m in PEER_LOST) or isinstance(exc, _dist_errors("DistNetworkError", "DistStoreError"))
    if not (peer_lost or isinstance(exc, _dist_errors("DistError"))):
        return None
    collective = parse_collective(text, _failed_collective(exc))
    if peer_lost or collective.timeout_s is not None:
        return f"{lost_contact(collective)}; {type(exc).__name__}: {text}"
    # (NCCL refusing a setting, say two ranks on one GPU: not the others' doing)
    where = f" in {collective.name}" if collective.name else ""
    return f"the process group failed{where}: {type(exc).__name__}: {text}"


def _dist_errors(*names: str) -> tuple:
    """torch.distributed's exception classes `names` (none where it was not imported: no collective
    can have failed)."""
    dist = sys.modules.get("torch.distributed")
    return tuple(getattr(dist, n) for n in names if hasattr(dist, n))


def _failed_collective(exc: BaseException) -> Optional[str]:
    """The torch.distributed function (all_reduce, barrier, ...) that raised `exc`: the innermost
    frame of its traceback in torch's distributed_c10d.py (DeepSpeed's and our wrappers call it)."""
    names = [f.name for f in traceback.extract_tb(exc.__traceback__)
             if os.path.basename(f.filename) == "distributed_c10d.py" and not f.name.startswith("_")]
    return names[-1] if names else None


def debug_requested(argv: Optional[list[str]]) -> bool:
    # known before the arguments are parsed, so a bad argument or config is reported the same way
    return "--debug" in (sys.argv[1:] if argv is None else argv)


def parse(argv: Optional[list[str]], description: str) -> DareConfig:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--params", default="params.yaml", help="the config file (default: params.yaml)")
    p.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. -S sft.max_steps=10")
    p.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    restart = p.add_mutually_exclusive_group()
    restart.add_argument("--restart", dest="restart", action="store_const", const="always", default="never",
                         help="set this stage's checkpoints aside (after every check passed) and train from the start")
    restart.add_argument("--restart-if-changed", dest="restart", action="store_const", const="if_changed",
                         help="resume checkpoints made with these settings, else set them aside and start fresh")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = p.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    cfg = load_config(args.params, args.set)
    cfg.restart = args.restart
    return cfg


def run_worker(fn: Callable[[DareConfig], object], argv: Optional[list[str]], description: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # (botocore: a line per S3 client about where it found credentials and endpoint)
    for noisy in ("DeepSpeed", "torch.distributed", "botocore", "aiobotocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    def work() -> int:
        # (here, not at the top: run_rank, every rank's supervisor, need not import torch)
        from dare_core.process.process_group import exit_before_teardown, several_gloo_ranks, shutdown_distributed

        cfg = parse(argv, description)
        # before any tensor work: torch's default (a thread per logical CPU in every rank)
        # oversubscribes shared or multi-rank machines
        configure_threads(cfg.launch.threads)
        # waiting on the other ranks is bounded: read by process/process_group.py's init_distributed
        os.environ["DARE_DIST_TIMEOUT_S"] = str(cfg.launch.timeout_s)
        try:
            fn(cfg)
        except BaseException:
            shutdown_distributed(clean=False)
            raise
        gloo_ranks = several_gloo_ranks()
        shutdown_distributed(clean=True)
        log_threads()  # stages that log it once their checks pass already did; others log it here
        if gloo_ranks and argv is None:  # (a rank's own process; tests call main(argv) in theirs)
            exit_before_teardown(0)
        return 0

    return run_reporting_errors(work, debug_requested(argv))


# --------------------------------------------------------------------------- one rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # how launchers and users stop a job


def _on_parent_death(signum: int) -> None:
    """Linux: `signum` reaches this process when its parent dies (PR_SET_PDEATHSIG), so that no rank
    outlives the launcher or its guard; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))
    except (OSError, AttributeError):
        pass


def _worker_dies_with_guard() -> None:  # runs in the worker between fork and exec
    _on_parent_death(signal.SIGKILL)


def _first_native_error(noise: Optional[NativeNoiseFilter]) -> str:
    """`: <the first C++ error message held back>`, for the line of a worker that a signal killed."""
    for line in noise.held if noise else []:
        message = native_error_message(line)
        if message:
            return f": {message[:300]} (--debug shows all the native messages)"
    return ""


def run_rank(argv: list[str]) -> int:
    """`python -m dare_core.workers.common MODULE ARGS`: what `dare stage` has the launcher start on
    every rank. It runs the stage worker `python -m MODULE ARGS` as its child and exits as it did.
    A worker that ends with an error prints its own `error: rank N: ...` line; one killed by a
    signal (the out-of-memory killer, a crash) cannot, so this says which rank died and how, before
    the launcher stops the other ranks. NCCL's watchdog kills a worker whose collective timed out
    (SIGABRT) after a page of C++ diagnostics: the worker's stderr passes through a filter that
    holds those back (rank_output.py; all shown under --debug), and the line names the collective.
    Signals sent to this process (the launcher stopping the job) are passed on to the worker."""
    local_rank_args = [a for a in argv if a.startswith("--local_rank")]  # the deepspeed launcher's, before MODULE
    rest = [a for a in argv if not a.startswith("--local_rank")]
    if not rest:
        print("usage: python -m dare_core.workers.common MODULE [ARGS...]", file=sys.stderr)
        return 2
    module, args = rest[0], rest[1:]
    launcher = os.getppid()
    _on_parent_death(signal.SIGTERM)  # a launcher killed outright: this rank stops too (passed on below)
    if os.getppid() != launcher:
        return 1  # it died before that was set
    # the interpreter options this process was started with (the deepspeed launcher's -u)
    options = sys.orig_argv[1:sys.orig_argv.index("-m")] if "-m" in sys.orig_argv else []
    cmd = [sys.executable, *options, "-m", module, *local_rank_args, *args]
    # the C++ runtime's diagnostics are held back (rank_output.py), unless --debug asks for them
    noise = None if "--debug" in args else NativeNoiseFilter(sys.stderr)
    worker = subprocess.Popen(cmd, preexec_fn=_worker_dies_with_guard, stderr=subprocess.PIPE if noise else None)
    reader = None
    if noise:
        reader = threading.Thread(target=noise.pump, args=(worker.stderr.fileno(),), daemon=True)
        reader.start()
    stopped: list[int] = []

    def forward(signum, _frame) -> None:
        stopped.append(signum)
        if worker.poll() is None:
            worker.send_signal(signum)
            worker.send_signal(signal.SIGCONT)  # a stopped worker must still end now

    for signum in STOP_SIGNALS:
        signal.signal(signum, forward)
    code = worker.wait()
    if reader:
        # (a process the worker started may hold its stderr open: this rank need not wait for it)
        reader.join(timeout=5)
    if code >= 0:
        return code
    died = signal.Signals(-code)
    if not stopped and died in STOP_SIGNALS:
        # the deepspeed launcher stops a rank's processes one by one, the worker first: a moment
        # for its signal to this process tells that teardown from a worker stopped on its own
        time.sleep(0.5)
    if not stopped:  # not the launcher's teardown, nor Ctrl-C: this rank is the one that failed
        who = rank_label() or f"rank {os.environ.get('RANK', '0')}: "
        if noise and noise.mid_line:  # (the line of a progress bar the worker left unfinished)
            print(file=sys.stderr)
        timed_out = noise.collective_timeout() if noise else None
        if timed_out:  # NCCL's watchdog aborts the process (SIGABRT) when a collective times out
            print(f"error: {who}{lost_contact(timed_out)}", file=sys.stderr, flush=True)
        else:
            print(f"error: {who}the worker (pid {worker.pid}) was {killed_by(died)}"
                  f"{_first_native_error(noise)}", file=sys.stderr, flush=True)
    # end the same way, so that the launcher reports this rank's signal
    if died not in (signal.SIGKILL, signal.SIGSTOP):  # (their handling cannot be changed)
        signal.signal(died, signal.SIG_DFL)
    os.kill(os.getpid(), died)
    return 128 + died


if __name__ == "__main__":
    sys.exit(run_rank(sys.argv[1:]))
