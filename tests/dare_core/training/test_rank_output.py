"""A rank's stderr without the C++ runtime's diagnostics (dare_core/workers/rank_output.py), and the
one line for a rank whose collective timed out: the filter on recorded text, then `run_rank` on a
stand-in worker that writes what NCCL's watchdog writes and aborts as it does."""
from __future__ import annotations

import io
import random
import signal
import subprocess
import sys

import pytest

from dare_core.workers.rank_output import (Collective, NativeNoiseFilter, lost_contact, native_error_message,
                                           parse_collective)
from pipeline_helpers import worker_env

# What a rank's worker writes when rank 1 stops answering: its own output (a log line, a progress
# bar that rewrites itself after \r), then NCCL's watchdog once the all-reduce has waited
# launch.timeout_s (60 s): glog lines prefixed by the rank, the C++ exception with its backtrace,
# std::terminate's report of it. Written for this test in the formats torch 2.x uses.
OWN = ("2026-11-26 10:14:00,100 INFO dare_core.process.threads: torch threads: 8 (launch.threads: auto)\n"
       "\rsft:   0%|          | 0/100 [00:00<?, ?it/s]"
       "\rsft:   1%|1         | 1/100 [00:01<02:10,  1.31s/it, loss=4.703]")
WATCHDOG = "WorkNCCL(SeqNum=57, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for 60012 milliseconds before timing out."
BACKTRACE = """\
Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:692 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3a11e2a498 in /opt/venv/lib/python3.11/site-packages/torch/lib/libc10.so)
frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >) + 0x23d (0x7f39c8a5b6cd in /opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so)
frame #2: c10d::ProcessGroupNCCL::watchdogHandler() + 0x6d8 (0x7f39c8a62f18 in /opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so)
frame #3: c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x14d (0x7f39c8a6440d in /opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so)
frame #4: <unknown function> + 0xdc253 (0x7f3a126dc253 in /lib/x86_64-linux-gnu/libstdc++.so.6)
frame #5: <unknown function> + 0x94ac3 (0x7f3a13294ac3 in /lib/x86_64-linux-gnu/libc.so.6)
frame #6: clone + 0x44 (0x7f3a13325a04 in /lib/x86_64-linux-gnu/libc.so.6)
"""
PG = "[PG ID 0 PG GUID 0(default_pg) Rank 0]"
NCCL = (
    f"[rank0]:[E1126 10:15:02.512345678 ProcessGroupNCCL.cpp:685] {PG} Watchdog caught collective operation timeout: {WATCHDOG}\n"
    f"[rank0]:[E1126 10:15:02.512987654 ProcessGroupNCCL.cpp:2252] {PG} failure detected by watchdog at work sequence id: "
    "57 PG status: last enqueued work: 57, last completed work: 56\n"
    "[rank0]:[E1126 10:15:02.512999999 ProcessGroupNCCL.cpp:733] Stack trace of the failed collective: \n"
    "#0 all_reduce from /opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3068\n"
    "#1 wrapper from /opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83\n"
    "#2 all_reduce_sum from /work/dare/dare_core/training/engine.py:158\n"
    "\n"
    f"[rank0]:[E1126 10:15:02.513000001 ProcessGroupNCCL.cpp:2584] {PG} First PG on this rank to signal dumping.\n"
    "[rank0]:[E1126 10:15:03.200000000 ProcessGroupNCCL.cpp:746] [Rank 0] Some NCCL operations have failed or timed out. "
    "Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.\n"
    "[rank0]:[E1126 10:15:03.200100000 ProcessGroupNCCL.cpp:760] [Rank 0] To avoid data inconsistency, we are taking "
    "the entire process down.\n"
    f"[rank0]:[E1126 10:15:03.201000000 ProcessGroupNCCL.cpp:2068] {PG} Process group watchdog thread terminated with "
    f"exception: [Rank 0] Watchdog caught collective operation timeout: {WATCHDOG}\n"
    f"{BACKTRACE}\n"
    "terminate called after throwing an instance of 'c10::DistBackendError'\n"
    f"  what():  {PG} Process group watchdog thread terminated with exception: [Rank 0] Watchdog caught collective "
    f"operation timeout: {WATCHDOG}\n"
    f"{BACKTRACE}"
    "Exception raised from ncclCommWatchdog at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2074 (most recent call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3a11e2a498 in /opt/venv/lib/python3.11/site-packages/torch/lib/libc10.so)\n"
    "frame #1: <unknown function> + 0xdc253 (0x7f3a126dc253 in /lib/x86_64-linux-gnu/libstdc++.so.6)\n"
    "\n")
# what ranks used to print at the end of a run that succeeded
TEARDOWN = ("[rank1]:[W1126 10:20:00.000000000 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=42, "
            "addr=[localhost]:51234, remote=[localhost]:29500): Broken pipe\n"
            "Exception raised from sendBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:697 (most recent call first):\n"
            "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3a11e2a498 in /opt/venv/lib/libc10.so)\n"
            "[rank1]:[W1126 10:20:00.100000000 ProcessGroupNCCL.cpp:1476] Warning: WARNING: destroy_process_group() was "
            "not called before program exit, which can leak resources. (function operator())\n")


def _filtered(text: str, chunks=0, seed: int = 0) -> NativeNoiseFilter:
    """`text` through a filter, in one piece, cut at `chunks` random places (a pipe's reads) or
    character by character ("every")."""
    out = io.StringIO()
    f = NativeNoiseFilter(out)
    if chunks == "every":
        cuts = list(range(1, len(text)))
    else:
        cuts = sorted(random.Random(seed).sample(range(1, len(text)), chunks)) if chunks else []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        f.feed(text[a:b])
    f.close()
    return f


@pytest.mark.parametrize("glued", [False, True], ids=["own-line", "after-the-progress-bar"])
@pytest.mark.parametrize("chunks", [0, 7, 300, "every"])
def test_the_watchdogs_page_is_held_back_and_the_rest_passes_as_it_was(chunks, glued):
    later = "error: rank 0: something the worker printed itself\n"
    own = OWN if glued else OWN + "\n"  # (glued: the C++ side writes on the progress bar's unfinished line)
    f = _filtered(own + NCCL + later + TEARDOWN, chunks, seed=len(str(chunks)))
    assert f.out.getvalue() == own + later  # byte for byte, \r included
    held = "\n".join(f.held)
    assert "frame #6" in held and "terminate called" in held and "destroy_process_group" in held
    assert f.collective_timeout() == Collective("ALLREDUCE", 57, 60.0)


def test_progress_bars_show_at_once():
    f = NativeNoiseFilter(io.StringIO())
    f.feed("\rsft:  10%|#         | 10/100")  # no line end yet
    assert f.out.getvalue() == "\rsft:  10%|#         | 10/100"
    f.feed(" [00:05<00:45, loss=4.1]\rsft:  11%")
    assert f.out.getvalue().endswith("loss=4.1]\rsft:  11%")
    f.feed("[rank0]:[W11")  # may be noise: held until it is known
    assert f.out.getvalue().endswith("sft:  11%")
    f.feed("26 10:20:00.0 x.cpp:1] a warning\nframe #12: x\nTraceback (most recent call last):\n")
    assert f.out.getvalue().endswith("sft:  11%Traceback (most recent call last):\n")
    # a rank's uncaught Python error, as torch prints it after C++ noise: all of it passes
    f.feed("[rank0]:[W1126 10:20:01.0 x.cpp:1] a warning\n")
    f.feed("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n[rank0]: KeyError: 'x'\n")
    assert f.out.getvalue().endswith("(most recent call last):\n[rank0]:   File \"x.py\", line 1\n[rank0]: KeyError: 'x'\n")


def test_a_successful_run_has_nothing_to_report():
    f = _filtered(OWN + "\n" + TEARDOWN)
    assert f.out.getvalue() == OWN + "\n" and f.collective_timeout() is None


def test_the_lines_name_the_collective():
    assert lost_contact(parse_collective(NCCL)) == (
        "lost contact with the other ranks: ALLREDUCE (collective #57) timed out after 60 s (launch.timeout_s); "
        "another rank died (its own error line, or the launcher's report, names it) or hangs")
    gloo = parse_collective("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation "
                            "to complete", "all_reduce")
    assert lost_contact(gloo).startswith("lost contact with the other ranks: all_reduce timed out after 10 s")
    closed = lost_contact(parse_collective("Connection closed by peer", "barrier"))
    assert closed.startswith("lost contact with the other ranks: barrier failed; another rank died")
    assert lost_contact(Collective()).endswith("or hangs (waited launch.timeout_s)")
    assert native_error_message(f"[rank0]:[E1126 10:15:02.5 ProcessGroupNCCL.cpp:685] {PG} boom") == f"{PG} boom"
    assert native_error_message("[W1126 10:15:02.5 x.cpp:1] only a warning") is None


# --------------------------------------------------------------------------- run_rank

STAND_IN = """\
import os, sys, time
sys.stderr.write({own!r})  # the progress bar's line left unfinished, as a worker that hangs leaves it
sys.stderr.flush()
time.sleep(0.2)
sys.stderr.write({nccl!r})
sys.stderr.flush()
os.abort()  # what std::terminate ends with
"""


@pytest.mark.parametrize("debug", [False, True])
def test_a_rank_killed_by_the_watchdog_ends_with_one_line(tmp_path, debug):
    (tmp_path / "stand_in_worker.py").write_text(STAND_IN.format(own=OWN, nccl=NCCL))
    env = worker_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    r = subprocess.run([sys.executable, "-m", "dare_core.workers.common", "stand_in_worker", "--params", "p.yaml",
                        *(["--debug"] if debug else [])], env=env, capture_output=True, timeout=120)
    err = r.stderr.decode()  # (not text=True: it would turn the progress bar's \r into \n)
    assert r.returncode == -signal.SIGABRT  # as the worker ended, for the launcher to report
    assert OWN in err
    if debug:  # everything, unfiltered
        assert NCCL in err and "error: rank 0: the worker" in err and "was killed by SIGABRT" in err
    else:  # the line starts a line of its own
        assert err == OWN + "\n" + (
            "error: rank 0: lost contact with the other ranks: ALLREDUCE (collective #57) timed out after 60 s "
            "(launch.timeout_s); another rank died (its own error line, or the launcher's report, names it) or hangs\n")
