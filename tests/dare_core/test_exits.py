"""Exit statuses read back as the signals behind them, from real processes killed by real signals,
and `dare stage`'s own line for a worker a signal killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dare_core.cli import _launch
from dare_core.process.exits import is_progress_bar, killed_by, signal_of


def status_of(*cmd: str) -> int:
    return subprocess.run(cmd, capture_output=True).returncode


def test_every_spelling_of_a_killed_process_names_its_signal():
    killed = status_of("sh", "-c", "kill -KILL $$")  # Python's subprocess: -9
    assert killed == -9 and signal_of(killed) is signal.SIGKILL
    shell = status_of("sh", "-c", 'sh -c "kill -TERM \\$\\$"; exit $?')  # a shell passing it on: 128 + 15
    assert shell == 143 and signal_of(shell) is signal.SIGTERM
    # a Python process passing on subprocess's -9 with sys.exit: 256 - 9 (what DeepSpeed's launcher does)
    relayed = status_of(sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(['sh', '-c', 'kill -KILL $$']))")
    assert relayed == 247 and signal_of(relayed) is signal.SIGKILL


@pytest.mark.parametrize("code", [0, 1, 2, 7, 100, 127, 128, 200, 255])
def test_ordinary_exit_codes_name_no_signal(code):
    assert signal_of(code) is None  # 255: DVC's and ssh's code for any error, never SIGHUP


def test_the_message_names_the_signal_and_what_to_check():
    assert killed_by(signal.SIGKILL) == "killed by SIGKILL (out of memory? see dmesg)"
    assert killed_by(signal.SIGSEGV) == "killed by SIGSEGV (a crash in native code)"
    assert killed_by(signal.SIGTERM) == "killed by SIGTERM"


@pytest.mark.parametrize("line", ["sft:  40%|####      | 4/10 [00:01<00:02, 3.21it/s, loss=2.3]", "sft:  40%|###",
                                  "| 4/10 [00:01<00:02", "0it [00:00, ?it/s]", "12.5s/it, loss=0.1]"])
def test_progress_bar_frames_whole_or_cut(line):
    assert is_progress_bar(line)


@pytest.mark.parametrize("line", ["RuntimeError: CUDA out of memory", "sft step 10: loss=2.31 lr=1e-05",
                                  "error: params.yaml: unknown config key 'sft.max_step'", "took 100% of the disk"])
def test_other_lines_are_not_bars(line):
    assert not is_progress_bar(line)


def test_dare_stage_names_the_signal_that_killed_its_worker(capsys):
    code = _launch(["sh", "-c", "kill -KILL $$"], dict(os.environ))
    err = capsys.readouterr().err
    assert code == 137 and signal_of(code) is signal.SIGKILL  # as a shell says it, not sys.exit(-9)'s 247
    assert err.startswith("error: the worker (pid ") and err.endswith(") was killed by SIGKILL (out of memory? see dmesg)\n")
    assert _launch(["sh", "-c", "kill -SEGV $$"], dict(os.environ), "the deepspeed launcher") == 139
    assert "error: the deepspeed launcher (pid " in capsys.readouterr().err
    assert _launch(["sh", "-c", "exit 3"], dict(os.environ)) == 3 and capsys.readouterr().err == ""
