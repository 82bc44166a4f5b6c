"""Code reward (ALGORITHMS.md section 7): run the generated program against its tests in the sandbox.

The program is the last fenced Python block of the response (```python, ```py or an untagged fence),
else the whole text (completion-style prompts such as HumanEval's "complete the following code").

Ground truth, one of:
- test code (a plain string): assertion tests run after the program in its namespace (HumanEval(+),
  MBPP, KodCode). `from solution import f` works, and top-level `test*` functions are called;
- JSON `{"tests": "<code>", "entry_point": "f", "setup": "<code>"}`: the same, plus `check(f)` when the
  tests define `check` (the HumanEval layout); `setup` (MBPP's test_setup_code, e.g. imports that
  reference solutions rely on) runs after the program in its jail and before the tests in theirs;
- JSON `{"inputs": [...], "outputs": [...]}`: stdin/stdout tests (LiveCodeBench, TACO, APPS,
  Codeforces in rLLM's layout). Each input is fed on stdin; the output must equal the expected one
  line by line, compared on whitespace-separated tokens (trailing blank lines and spaces ignored).
  An input or output given as a list of lines is joined with newlines;
- JSON `{"inputs": [[args...], ...], "outputs": [value, ...], "fn_name": "f"}`: call-based tests
  (TACO/APPS LeetCode style): `f(*args) == value`, with `f` a top-level function or a method of
  `Solution`.

Score and acc: 1 if every test passes, else 0 (failures, timeouts and crashes alike); `extra`
carries the sandbox status. `extra["timeout"]` (seconds) overrides the wall-clock limit. Verdicts
never come from the candidate's process (`dare_core.rewards.sandbox`): stdin/stdout outputs are
compared here, assertion tests run in a jail of their own. Without the OS sandbox the reward raises
`SandboxUnavailable` rather than run anything.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.extract import extract_code
from dare_core.rewards.registry import ground_truth_check, register_reward
from dare_core.rewards.sandbox import SandboxLimits, SandboxResult, check_available, run_python

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
    """{"kind": "assert", "tests": str, "setup": str} or {"kind": "stdio", "inputs": [...], "outputs": [...]}."""
    text = ground_truth.strip()
    spec = None
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError:
            spec = None
    if not isinstance(spec, dict):
        return {"kind": "assert", "tests": ground_truth, "setup": ""}
    if "inputs" in spec and "outputs" in spec:
        inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError("code reward: 'inputs' and 'outputs' must be non-empty and of equal length")
        if spec.get("fn_name"):
            return {"kind": "assert", "tests": _call_tests(str(spec["fn_name"]), inputs, outputs), "setup": ""}
        return {"kind": "stdio", "inputs": [_as_text(i) for i in inputs], "outputs": [_as_text(o) for o in outputs]}
    if "tests" in spec:
        tests = str(spec["tests"])
        entry = spec.get("entry_point")
        if entry and "def check(" in tests:
            tests += f"\n\ncheck({entry})\n"
        return {"kind": "assert", "tests": tests, "setup": str(spec.get("setup") or "")}
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
    lines = [f"_f = globals().get({fn_name!r}) or getattr(Solution(), {fn_name!r})"]
    for args, expected in zip(inputs, outputs):
        args = args if isinstance(args, list) else [args]
        lines.append(f"assert _f(*json.loads({json.dumps(args)!r})) == json.loads({json.dumps(expected)!r})")
    return "import json\n" + "\n".join(lines) + "\n"


def run_tests(code: str, ground_truth: str, limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run `code` against the tests of `ground_truth`; `passed` is the verdict."""
    spec = parse_ground_truth(ground_truth)
    if spec["kind"] == "assert":
        setup = spec["setup"]
        if setup:
            return run_python(f"{code}\n\n{setup}\n", tests=f"{setup}\n\n{spec['tests']}", limits=limits)
        return run_python(code, tests=spec["tests"], limits=limits)
    result = run_python(code, inputs=spec["inputs"], limits=limits)
    if result.passed:
        for case, expected in zip(result.cases, spec["outputs"]):
            case["match"] = bool(case.get("ok")) and not case.get("truncated") and outputs_match(
                case.get("stdout", ""), expected)
        if len(result.cases) != len(spec["outputs"]) or not all(case["match"] for case in result.cases):
            result.passed, result.status = False, "failed"
    return result


@register_reward("code")
def code_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    code = extract_code(response_text)
    if not code.strip():
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    limits = DEFAULT_LIMITS
    timeout = (extra or {}).get("timeout")
    if timeout is not None:
        limits = dataclasses.replace(limits, wall_s=float(timeout))
    result = run_tests(code, ground_truth, limits)
    info: dict = {"status": result.status}
    if result.timed_out:
        info["timeout"] = True
    if result.error:
        info["error"] = result.error[:300]
    if result.cases:
        info["cases_passed"] = sum(bool(c.get("match")) for c in result.cases)
        info["cases"] = len(result.cases)
    score = 1.0 if result.passed else 0.0
    return RewardResult(score, score, code, info)
