"""DeepSpeed's C++ ops, announced when they are compiled.

DeepSpeed is installed with no op prebuilt (DS_BUILD_OPS=0, docs/environment.md): the first process
that loads an op compiles it into TORCH_EXTENSIONS_DIR (dare.env: the checkout's
.cache/torch_extensions), and every later one loads it in well under a second. On a fresh clone that
first build happens inside the first training stage, which said nothing for the minute or more it
took; `announced` logs what is built, why and about how long it takes before, and the time it took
after. `python -m dare_core.training.op_builds <Builder>` builds one ahead (`make ds-ops`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

# the builders DARE loads: (what the op is, why this stage needs it, how long a build takes on a
# 2-core CPU: the shared-memory op 19-39 s, CPU Adam about 96 s in an operator's first SFT)
OPS = {
    "ShareMemCommBuilder": ("its shared-memory collectives op", "every process group on the CPU loads it", "20-40 s"),
    "CPUAdamBuilder": ("its CPU Adam op", "the optimizer is offloaded to host memory (launch.offload_optimizer)",
                       "1-2 min"),
}


def _builder(builder_name: str):
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(builder_name)


def build_dir(op_name: str) -> Path:
    """Where torch's JIT loader builds (and finds) op `op_name`: TORCH_EXTENSIONS_DIR/<op_name>, or
    its per-user default."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op_name, verbose=False))


def needs_build(op_name: str) -> bool:
    """DeepSpeed will compile op `op_name` when it is loaded: it can run here (DeepSpeed loads no
    other, e.g. no shared-memory op on a GPU), was not installed prebuilt and is not built yet."""
    import deepspeed.ops
    from deepspeed.git_version_info import installed_ops

    return (deepspeed.ops.__compatible_ops__.get(op_name, False) and not installed_ops.get(op_name)
            and not (build_dir(op_name) / f"{op_name}.so").is_file())


@contextlib.contextmanager
def announced(builder_name: str) -> Iterator[None]:
    """Around the code that makes DeepSpeed load `builder_name`'s op: a line before a build (only
    where the op is not built yet, from one rank a machine) and one when it is done."""
    builder = _builder(builder_name)
    name = getattr(builder, "NAME", None)
    say = (name is not None and os.environ.get("LOCAL_RANK", "0") == "0" and builder_name in OPS
           and needs_build(name))
    if not say:
        yield
        return
    what, why, takes = OPS[builder_name]
    where = build_dir(name)
    log.info("DeepSpeed compiles %s (%s) into %s: %s, and the op is built on first use, once per checkout; "
             "about %s on 2 CPU cores, with no output until it is done", what, name, where, why, takes)
    start = time.monotonic()
    yield
    log.info("DeepSpeed built %s (%s) in %.1f s; later stages load it from %s", what, name, time.monotonic() - start,
             where)


def main(argv: list[str]) -> int:
    """Build the ops named by their builders (`make ds-ops`), each announced."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for builder_name in argv:
        with announced(builder_name):
            _builder(builder_name).load()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
