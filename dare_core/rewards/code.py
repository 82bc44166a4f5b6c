"""Code reward (docs/algorithms.md#rewards): run the generated program against its tests in the sandbox.

The program is the last fenced Python block of the response (```python, ```py or an untagged fence),
else the whole text (completion-style prompts such as HumanEval's "complete the following code").

Ground truth, one of:
- test code (a plain string): assertion tests (HumanEval(+), MBPP, KodCode), run in a jail of their own
  against the program's names: those they use without defining them (`dare_core.rewards.sandbox.test_names`).
  `from solution import f` works, top-level `test*` functions, `Test*` and `unittest` classes run
  (also after `unittest.main()`);
- JSON `{"tests": "<code>", "entry_point": "f", "setup": "<code>", "prompt": "<text>"}`: the same, with
  `f` the only name of the program's (besides `from solution` imports), plus `check(f)` when the tests
  define `check` (the HumanEval layout); `setup` (MBPP's test_setup_code, e.g. imports that reference
  solutions rely on) runs after the program in its jail and before the tests in theirs;
- JSON `{"inputs": [...], "outputs": [...]}`: stdin/stdout tests (LiveCodeBench, TACO, APPS,
  Codeforces in rLLM's layout). Each input is fed on stdin; the output must equal the expected one
  line by line, compared on whitespace-separated tokens (trailing blank lines and spaces ignored).
  An input or output given as a list of lines is joined with newlines;
- JSON `{"inputs": [[args...], ...], "outputs": [value, ...], "fn_name": "f"}`: call-based tests
  (TACO/APPS LeetCode style): `f(*args) == value`, with `f` a top-level function or a method of
  `Solution`.

Helpers that the problem's prompt defines (HumanEval/32's `poly`) are the problem's: their definitions, from
the prompt's code, run in the tests' jail. The prompt is the graded row's (`extra["row"]["prompt"]`,
as `dare_core.rewards.scoring` passes it), or the ground truth's `"prompt"`.

Score and acc: 1 if every test passes, else 0 (failures, timeouts and crashes alike); `extra`
carries the sandbox status, `failure` (the status) for a run that ended without a verdict and
`error` (for a timeout: which limit, the run's CPU time or the wall-clock backstop). The time limit
(`SandboxLimits.wall_s`: CPU seconds of the run where cgroups count them) is the reward's option
`timeout` (`reward_args`), or `extra["timeout"]` for one call. Verdicts never come from the
candidate's process (`dare_core.rewards.sandbox`): stdin/stdout outputs are compared here, assertion
tests run in a jail of their own. Without the OS sandbox the reward raises `SandboxUnavailable`
rather than run anything.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.extract import extract_code
from dare_core.rewards.registry import ground_truth_check, register_reward
from dare_core.rewards.sandbox import SandboxLimits, SandboxResult, check_available, run_python
from dare_core.rewards.problem_names import builtin_entries, prompt_helpers, prompt_stubs
from dare_core.rewards.sandbox.test_names import MODULES, names_for, used_names

DEFAULT_LIMITS = SandboxLimits()


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def outputs_match(got: str, expected: str) -> bool:
    """Line-by-line equality of whitespace-separated tokens, trailing blank lines ignored."""
    def lines(text: str) -> list[list[str]]:
        rows = [line.split() for line in text.strip().splitlines()]
        while rows and not rows[-1]:
            rows.pop()
        return rows

    return lines(got) == lines(expected)


def parse_ground_truth(ground_truth: str) -> dict:
    """{"kind": "stdio", "inputs": [...], "outputs": [...]} or {"kind": "assert", "tests": str, "setup": str,
    "entry": [names], "required": [names], "prompt": str or None}: `entry` are the program's names the
    problem declares (empty: the tests' own rule, `dare_core.rewards.sandbox.test_names`), `required` those the
    program must define."""
    text = ground_truth.strip()
    spec = None
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError:
            spec = None
    if not isinstance(spec, dict):
        return {"kind": "assert", "tests": ground_truth, "setup": "", "entry": [], "required": [], "prompt": None}
    if "inputs" in spec and "outputs" in spec:
        inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError("code reward: 'inputs' and 'outputs' must be non-empty and of equal length")
        if spec.get("fn_name"):
            fn_name = str(spec["fn_name"])
            return {"kind": "assert", "tests": _call_tests(fn_name, inputs, outputs), "setup": "",
                    "entry": [fn_name, "Solution"], "required": [], "prompt": None}
        return {"kind": "stdio", "inputs": [_as_text(i) for i in inputs], "outputs": [_as_text(o) for o in outputs]}
    if "tests" in spec:
        tests, entry = str(spec["tests"]), spec.get("entry_point")
        if entry and not str(entry).isidentifier():
            raise ValueError(f"code reward: entry_point {entry!r} is not an identifier")
        if entry and "def check(" in tests:
            tests += f"\n\ncheck({entry})\n"
        prompt = spec.get("prompt")
        return {"kind": "assert", "tests": tests, "setup": str(spec.get("setup") or ""),
                "entry": [str(entry)] if entry else [], "required": [str(entry)] if entry else [],
                "prompt": prompt if isinstance(prompt, str) else None}
    raise ValueError(f"code reward: JSON ground truth needs 'tests' or 'inputs'/'outputs', got keys {sorted(spec)}")


@ground_truth_check("code")
def check_gradable(ground_truth: str) -> None:
    """The ground truth parses, and the sandbox runs here: a stage checks its rows with this before
    it trains (a missing bubblewrap then stops it at once, not at the first rollout)."""
    parse_ground_truth(ground_truth)
    check_available()


def _call_tests(fn_name: str, inputs: list, outputs: list) -> str:
    if not fn_name.isidentifier():
        raise ValueError(f"code reward: fn_name {fn_name!r} is not an identifier")
    cases = json.dumps([[args if isinstance(args, list) else [args], out] for args, out in zip(inputs, outputs)])
    # a top-level function of the program, else a method of its `Solution`; `is None`, since a proxy
    # of the program's function has no truth value
    return (f"import json as _json\n_f = globals().get({fn_name!r})\nif _f is None:\n"
            f"    _f = getattr(Solution(), {fn_name!r})\n"
            f"for _args, _expected in _json.loads({cases!r}):\n    assert _f(*_args) == _expected\n")


def run_tests(code: str, ground_truth: str, limits: Optional[SandboxLimits] = None,
              prompt: Optional[str] = None) -> SandboxResult:
    """Run `code` against the tests of `ground_truth`; `passed` is the verdict. `prompt`, the problem's
    prompt, supplies the helpers it defines to the tests (a prompt in the ground truth wins)."""
    spec = parse_ground_truth(ground_truth)
    if spec["kind"] == "assert":
        setup, tests, entry, prompt = spec["setup"], spec["tests"], spec["entry"], spec["prompt"] or prompt
        free, imported = used_names(f"{setup}\n\n{tests}")
        helpers, defined = prompt_helpers(prompt, {*entry, *imported})
        if not entry and free - MODULES and free - MODULES <= defined:
            # with no entry point declared, a prompt that defines every name the tests use shows what
            # the program must write (an example, a slower version): its definitions are not helpers
            helpers = ""
        program = f"{code}\n\n{setup}\n" if setup else code
        tests = "\n\n".join(part for part in (helpers, setup, tests) if part)
        names, required = entry or None, spec["required"]
        if not entry:  # builtin-named functions the problem means as the program's (`max`)
            others = names_for(tests)[0]
            own = builtin_entries(tests, code, prompt_stubs(prompt), bool(others))
            if own:
                names, required = sorted({*others, *own}), own
        return run_python(program, tests=tests, limits=limits, names=names, required=required)
    result = run_python(code, inputs=spec["inputs"], limits=limits)
    if result.passed:
        for case, expected in zip(result.cases, spec["outputs"]):
            case["match"] = bool(case.get("ok")) and not case.get("truncated") and outputs_match(
                case.get("stdout", ""), expected)
        if len(result.cases) != len(spec["outputs"]) or not all(case["match"] for case in result.cases):
            result.passed, result.status = False, "failed"
    return result


def _prompt_of(extra: Optional[dict]) -> Optional[str]:
    """The problem's prompt: scoring passes the graded row as extra["row"] (`dare_core.rewards.scoring`)."""
    extra = extra or {}
    row = extra.get("row")
    prompt = row.get("prompt") if isinstance(row, dict) else extra.get("prompt")
    return prompt if isinstance(prompt, str) else None


@register_reward("code")
def code_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None, *,
                timeout: Optional[float] = None) -> RewardResult:
    code = extract_code(response_text)
    if not code.strip():
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    limits = DEFAULT_LIMITS
    timeout = (extra or {}).get("timeout", timeout)
    if timeout is not None:
        limits = dataclasses.replace(limits, wall_s=float(timeout))
    result = run_tests(code, ground_truth, limits, _prompt_of(extra))
    info: dict = {"status": result.status}
    if result.status not in ("passed", "failed"):  # timeout, output_limit, crashed, malformed
        info["failure"] = result.status
    if result.timed_out:
        info["timeout"] = True
    if result.error:
        info["error"] = result.error[:300]
    if result.cases:
        info["cases_passed"] = sum(bool(c.get("match")) for c in result.cases)
        info["cases"] = len(result.cases)
    score = 1.0 if result.passed else 0.0
    return RewardResult(score, score, code, info)
