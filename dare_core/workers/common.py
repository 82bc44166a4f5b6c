"""What every stage worker shares: argument parsing, logging, clean errors.

`run_reporting_errors` is the one place that turns an expected failure into `error: <message>`
(one line on stderr, no traceback unless `--debug`); stage workers and the `dare` command both
go through it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Callable, Optional

from dare_core.config import ConfigError, DareConfig, load_config
from dare_core.training.threads import configure_threads, log_threads

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


def report_error(exc: BaseException, debug: bool = False) -> int:
    """Print `exc` as `error: <message>` on stderr (after its traceback under --debug); return the
    exit code."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"error: {error_message(exc)}", file=sys.stderr)
    return 2 if isinstance(exc, USER_ERRORS) else 1


def run_reporting_errors(fn: Callable[[], Optional[int]], debug: bool = False) -> int:
    """`fn()`'s exit code (None counts as 0), or the code of the expected failure it raised."""
    try:
        return fn() or 0
    except EXPECTED_ERRORS as exc:
        return report_error(exc, debug)


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
    for noisy in ("DeepSpeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    def work() -> int:
        cfg = parse(argv, description)
        # before any tensor work: torch's default (a thread per logical CPU in every rank)
        # oversubscribes shared or multi-rank machines
        configure_threads(cfg.launch.threads)
        fn(cfg)
        log_threads()  # stages that log it once their checks pass already did; others log it here
        return 0

    return run_reporting_errors(work, debug_requested(argv))
