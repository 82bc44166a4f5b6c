"""What every stage worker shares: argument parsing, logging, clean errors."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Optional

from dare_core.config import ConfigError, DareConfig, load_config

# errors a user can fix: printed as one line, no traceback
USER_ERRORS: tuple = (ConfigError, FileNotFoundError, ValueError)


def parse(argv: Optional[list[str]], description: str) -> DareConfig:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--params", default="params.yaml", help="the config file (default: params.yaml)")
    p.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. -S sft.max_steps=10")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = p.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return load_config(args.params, args.set)


def run_worker(fn: Callable[[DareConfig], object], argv: Optional[list[str]], description: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("DeepSpeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = parse(argv, description)
        fn(cfg)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
