"""The process group of a multi-rank stage, from its start to its end: made once (nccl on GPUs,
bound to the rank's GPU; gloo on the CPU), every wait bounded by launch.timeout_s, and left on every
way out so that a finished run ends quietly. Every stage worker leaves it (workers/common.py), so
this stays free of the training code: prepare, convert and eval import it too."""
from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

import torch


def ensure_dist_env() -> None:
    """A single process started without a launcher still needs the rendezvous variables
    (otherwise DeepSpeed tries MPI discovery)."""
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


# launch.timeout_s's default; every stage worker exports the configured value as TIMEOUT_VAR
# (workers/common.py run_worker)
DEFAULT_TIMEOUT_S = 600
TIMEOUT_VAR = "DARE_DIST_TIMEOUT_S"


def dist_timeout_s() -> float:
    """How long a rank waits for the others (rendezvous and every collective) before it fails with
    an error: a rank that hangs, or a node that vanishes, must end the job, not freeze it."""
    return float(os.environ.get(TIMEOUT_VAR) or DEFAULT_TIMEOUT_S)


def init_distributed() -> None:
    """The process group (nccl on GPUs, gloo on the CPU) with the `dist_timeout_s` timeout, once.
    Made here rather than by DeepSpeed so that on GPUs it is bound to this rank's GPU (DeepSpeed
    then finds it made and uses it)."""
    if torch.distributed.is_initialized():
        return
    ensure_dist_env()
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=dist_timeout_s())
    bound = {}
    if backend == "nccl":
        gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        # the current device is where tensors made with device="cuda" go (all_reduce_sum's, the
        # models' loaders'): otherwise GPU 0 for every rank of the node
        torch.cuda.set_device(gpu)
        if _bind_device(int(os.environ.get("WORLD_SIZE", "1"))):
            bound["device_id"] = gpu
    torch.distributed.init_process_group(backend, timeout=timeout, **bound)
    _default_timeout_for_later_groups(timeout)
    with _quiet_build_notice():
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    if backend == "gloo":
        _release_shared_workspace_name()


# printed by DeepSpeed on the CPU each time a stage loads its shared-memory allreduce op, which is
# built once and cached: every stage's log carried it as if something had been compiled
BUILD_NOTICE = re.compile(r"^DeepSpeed \S+ built successfully$")


@contextlib.contextmanager
def _quiet_build_notice():
    """Everything the block prints to sys.stdout, less DeepSpeed's build notice, passed on as it was."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if not BUILD_NOTICE.match(line.strip())]
        sys.stdout.write("".join(kept))


def shared_workspace_path(rank: int) -> Path:
    """Where DeepSpeed's CPU allreduce keeps this run's workspace of `rank` (all ranks on one
    machine, as the deepspeed launcher's LOCAL_SIZE says): a POSIX shared-memory object named by the
    user, the rendezvous address and port, and the rank."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def _release_shared_workspace_name() -> None:
    """DeepSpeed never removes the name of a rank's allreduce workspace, so each run left about
    68 MB of memory per rank in /dev/shm after it ended: a day of test runs held 20 GB of a 24 GB
    machine, and the next compile was killed for memory. Once every rank has opened every other's
    workspace (DeepSpeed waits for that inside init_distributed; the barrier waits for every rank to
    get there) the names are no longer needed; the memory itself lives on while a rank maps it."""
    world = torch.distributed.get_world_size()
    if os.environ.get("LOCAL_SIZE") != str(world):  # DeepSpeed's own test: otherwise it made none
        return
    if world > 1:
        torch.distributed.barrier()
    shared_workspace_path(torch.distributed.get_rank()).unlink(missing_ok=True)


def _default_timeout_for_later_groups(timeout: datetime.timedelta) -> None:
    """Groups made after the default one take torch's default timeout (NCCL 10 min, gloo 30 min),
    not the default group's: DeepSpeed reduces the gradients over such a group (its copy of the
    world group), so a hung rank would hold the others there that long, not launch.timeout_s.
    `new_group` reads these module defaults when it is given no timeout."""
    c10d = torch.distributed.distributed_c10d
    c10d.default_pg_timeout = timeout
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:  # (None: torch built without NCCL)
        c10d.default_pg_nccl_timeout = timeout


def _bind_device(world: int) -> bool:
    """Whether to bind the NCCL group to this rank's GPU (`init_process_group(device_id=...)`): its
    communicator is made at once, and barriers know their GPU instead of guessing it from the rank
    (torch's "Guessing device ID" warning, a hang where ranks and GPUs do not map one to one). Not
    on one rank (every later group would be split from a communicator that has no peer, which
    DeepSpeed's issue tracker reports hanging), nor on torch 2.6.x-2.7.0, where binding can hang;
    DeepSpeed 0.19 follows the same rules where it makes the group itself."""
    from packaging.version import Version

    return world > 1 and not Version("2.6.0") < Version(torch.__version__.split("+")[0]) < Version("2.7.1")


def shutdown_distributed(clean: bool) -> None:
    """Leave the process group before the process exits, so that torch's C++ side ends quietly:
    without it, ranks that outlive rank 0 (the host of the rendezvous store) report the store gone
    (`TCPStore recvValue failed`) and NCCL that `destroy_process_group() was not called`.
    `clean` (the stage succeeded on this rank): wait for every rank first, so that none leaves
    while the others still use the group (rank 0 hosts the store under the deepspeed launcher).
    Otherwise the others may be gone or hung: abort (NCCL's orderly shutdown would wait for
    their collectives); an error here must not hide the one that ended the stage."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        try:
            if dist.get_world_size() > 1:  # (one rank's group is not bound to its GPU: torch would warn)
                dist.barrier()
        except BaseException:
            _abandon_process_group()
            raise
        dist.destroy_process_group()
    else:
        _abandon_process_group()


def several_gloo_ranks() -> bool:
    """Whether this process is one of several ranks of a gloo group (a multi-rank run on the CPU)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() > 1


def exit_before_teardown(code: int) -> NoReturn:
    """End the process now, skipping the interpreter's final teardown: for a rank of a gloo group
    whose stage ended cleanly. Gloo's worker threads live on after `destroy_process_group` while
    DeepSpeed still holds its groups, and one of them may still be releasing a finished collective
    (whose tensors Python owns) when the interpreter begins to finalize. A thread that asks for the
    GIL then is stopped in the middle of a C++ destructor: `std::terminate`, so a rank that finished
    every step died of SIGABRT (2-rank ZeRO-3 SFT on a 2-core machine: 4 times in about 90 runs;
    its core dump showed gloo's `runLoop` destroying a barrier's work). Exit handlers still run
    (logging flushes its files in one) and the standard streams are flushed; files the stage wrote
    are closed by then."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (closed, or a reader gone)
            pass
    os._exit(code)


def _abandon_process_group() -> None:
    dist = torch.distributed
    try:
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:  # gloo closes its connections at once
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (already failing: leaving untidily is the lesser evil)
        pass
