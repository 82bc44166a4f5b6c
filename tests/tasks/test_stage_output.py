"""Stage output -> Prefect log lines (rate-limited) and the line that explains a failure."""
from __future__ import annotations

import logging

from tasks.stage_output import LineForwarder, dvc_error, error_line, line_level


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_complete_lines_only_and_a_bar_once_in_its_final_state():
    out: list[str] = []
    fwd = LineForwarder(out.append)
    fwd.feed("step 1 lo")
    fwd.feed("ss 2.5\n")
    fwd.feed("\rsampling 1/3\rsampling 2/3", "stderr")
    assert out == ["step 1 loss 2.5"]  # the bar has not ended its line yet
    fwd.feed("\rsampling 3/3\n\x1b[32mgreen\x1b[0m\n\n", "stderr")
    fwd.feed("tail without newline")
    fwd.close()
    assert out == ["step 1 loss 2.5", "sampling 3/3", "green", "tail without newline"]


def test_streams_keep_their_own_partial_lines():
    out: list[str] = []
    fwd = LineForwarder(out.append)
    fwd.feed("out-a", "stdout")
    fwd.feed("err-a\n", "stderr")
    fwd.feed("-b\n", "stdout")
    assert out == ["err-a", "out-a-b"]


def test_rate_limit_counts_what_it_drops_and_never_drops_the_error_line():
    clock, out = Clock(), []
    fwd = LineForwarder(out.append, rate=2.0, burst=3, clock=clock)
    fwd.feed("".join(f"noise {i}\n" for i in range(10)))
    assert out == ["noise 0", "noise 1", "noise 2"]  # the burst
    fwd.feed("error: the real reason\n")  # through, after the count of what was dropped before it
    assert out[-2:] == ["... 7 lines not forwarded (more than 2/s; the worker's console has them)", "error: the real reason"]
    clock.t = 1.0  # two more tokens
    fwd.feed("after 1\nafter 2\nafter 3\n")
    assert out[-3:] == ["error: the real reason", "after 1", "after 2"]
    fwd.close()
    assert out[-1].startswith("... 1 lines not forwarded")


def test_error_line_prefers_the_workers_own_line():
    tail = ("Running stage 'sft':\n> dare stage sft\nloading\n"
            "\nerror: params.yaml: unknown config key 'sft.max_step' (did you mean 'max_steps'?)\n"
            "ERROR: failed to reproduce 'sft': failed to run: dare stage sft, exited with 2\n")
    assert error_line(tail) == "error: params.yaml: unknown config key 'sft.max_step' (did you mean 'max_steps'?)"
    assert dvc_error(tail).endswith("exited with 2")
    traceback = "Traceback (most recent call last):\n  File x\nRuntimeError: boom\nERROR: failed to reproduce 'rl': exited with 1\n"
    assert error_line(traceback) == "RuntimeError: boom"
    only_dvc = "Running stage 'boom':\n> exit 7\nERROR: failed to reproduce 'boom': exited with 7\n"
    assert error_line(only_dvc) == "ERROR: failed to reproduce 'boom': exited with 7"


def test_a_failure_of_dvc_itself_is_reported_as_dvcs_error():
    # the stage command finished (its bar's last frame) and DVC then refused to save an output
    tail = ("sft: 100%|##########| 3000/3000 [03:43<00:00, 13.40it/s, loss=0.054]\n"
            "ERROR: failed to reproduce 'sft':  output 'metrics/sft.json' is already tracked by SCM (e.g. Git).\n"
            "    You can remove it from Git, then add to DVC.\n")
    assert error_line(tail) == "ERROR: failed to reproduce 'sft':  output 'metrics/sft.json' is already tracked by SCM (e.g. Git)."


def test_a_progress_bar_is_never_the_error_line():
    # the bar's last frame (cut short: the stage died mid-redraw) follows the line that says why
    tail = ("Running stage 'sft':\n> dare stage sft\nRuntimeError: boom\n"
            "sft:  40%|####      | 4/10 [00:01<00:02, 3.21it/s]\rsft:  50%|#####   \n"
            "ERROR: failed to reproduce 'sft': failed to run: dare stage sft, exited with 1\n")
    assert error_line(tail) == "RuntimeError: boom"
    only_bar = "Running stage 'sft':\n> dare stage sft\nsft:  40%|####  | 4/10 [00:01<00:02]\nERROR: failed to reproduce 'sft': exited with 1\n"
    assert error_line(only_bar) == "ERROR: failed to reproduce 'sft': exited with 1"


def test_each_line_is_logged_at_the_level_it_states():
    errors = ["error: params.yaml: unknown config key 'sft.max_step'", "ERROR: failed to reproduce 'sft'",
              "ValueError: n_heads must divide d_model", "torch.OutOfMemoryError: CUDA out of memory",
              "2026-11-29 11:00:00,123 ERROR dare_core.training.stage: the run stopped"]
    warnings = ["WARNING: stage 'sft' is cached", "2026-11-29 11:00:00,123 WARNING dare_core.x: kept in superseded/"]
    infos = ["step 5 loss 1.000", "2026-11-29 11:00:00,123 INFO dare_core.x: resuming SFT", "Error rate 0.1: fine",
             "the errors: none", "sampling 3/3"]
    assert [line_level(line) for line in errors] == [logging.ERROR] * len(errors)
    assert [line_level(line) for line in warnings] == [logging.WARNING] * len(warnings)
    assert [line_level(line) for line in infos] == [logging.INFO] * len(infos)
