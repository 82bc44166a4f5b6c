"""score_texts cannot be made to fail by a response: forged or flooded sandbox results, adversarial
text for the parsers, huge numbers and rewards that raise all score 0 with a reason; what is not a
response's fault (no sandbox, a wrong reward configuration) still raises. Code rewards of a batch run
concurrently, with the same results as one at a time."""
import json
import random
import re
import sys
import time

import pytest

from dare_core.errors import UserError
from dare_core.rewards import RewardError, sandbox
from dare_core.rewards.base import FAILURE_REASONS, RewardFailed
from dare_core.rewards.extract import _PYTHON_LANGS, python_blocks
from dare_core.rewards.gsm8k import _d1_soft, _d1_strict
from dare_core.rewards.sandbox import SandboxUnavailable
from dare_core.rewards.scoring import default_workers, failure_metrics, score_row, score_texts

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

STDIO = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
# the candidate finds its own result pipe: the start-up code's job, still alive in its process
WRITE_RESULT = ("import gc, os\nfd = next(o['result_fd'] for o in gc.get_objects() if type(o) is dict and 'result_fd' in o)\n"
                "blob = {blob}\nview = memoryview(blob)\nwhile view:\n    view = view[os.write(fd, view):]\nos._exit(0)\n")


def code_row(ground_truth: str, uid: str = "c") -> dict:
    return {"uid": uid, "task": "code", "reward": "code", "ground_truth": ground_truth, "prompt_text": "p"}


def row(reward: str, ground_truth: str, uid: str = "r") -> dict:
    return {"uid": uid, "task": reward, "reward": reward, "ground_truth": ground_truth, "prompt_text": "p"}


# ---- messages from a jail ---------------------------------------------------------------------------

@linux_only
def test_forged_and_flooded_result_messages_score_zero_with_a_reason():
    forgeries = {
        "b'not json'": "not JSON",
        "b'{\"cases\": 5}'": "exactly 1 case",
        "b'{\"cases\": [1]}'": "malformed case",
        "b'{\"cases\": [{\"ok\": true, \"error\": null, \"truncated\": false, \"stdout\": 4}]}'": "malformed case",
        "b'[' * 200000": "too many values",  # json.loads would hit its recursion limit
        "b'{\"cases\": [' + b'{},' * 2000 + b'{}]}'": "too many values",
        "b'{\"cases\": [\"' + b'x' * (64 << 20) + b'\"]}'": "result message over",  # the old cap: 64 MB
    }
    texts = [WRITE_RESULT.format(blob=blob) for blob in forgeries]
    started = time.monotonic()
    results = score_texts([code_row(STDIO, f"f{i}") for i in range(len(texts))], texts, workers=2)
    for result, why in zip(results, forgeries.values()):
        assert (result.score, result.extra["status"], result.extra["failure"]) == (0.0, "malformed", "malformed")
        assert why in result.extra["error"], result.extra
    assert time.monotonic() - started < 15
    # a forged message of the honest shape only claims an output, which is then compared like any output
    honest_shape = "json.dumps({'cases': [{'ok': True, 'error': None, 'truncated': False, 'stdout': '%s'}]}).encode()"
    forged = [WRITE_RESULT.format(blob=honest_shape % out).replace("import gc, os", "import gc, os, json") for out in ("4", "5")]
    assert [r.score for r in score_texts([code_row(STDIO)] * 2, forged)] == [1.0, 0.0]


@linux_only
def test_a_flood_at_import_is_an_output_limit_never_sandbox_unavailable():
    # the flood used to stop the run before the tests' jail's READY was read: "could not start"
    program = "print('x' * 10**7)\ndef f():\n    return 1\n"
    results = score_texts([code_row("assert f() == 1", f"u{i}") for i in range(6)], [program] * 6, workers=2)
    assert {(r.score, r.extra["status"], r.extra["failure"]) for r in results} == {(0.0, "output_limit", "output_limit")}
    stdio = score_texts([code_row(STDIO)], ["print('x' * 10**7)\nprint(int(input()) * 2)\n"])[0]
    assert (stdio.score, stdio.extra["status"]) == (0.0, "failed")  # stdout is a capped file here: a wrong output


@linux_only
def test_sandbox_unavailable_still_raises(monkeypatch):
    monkeypatch.setattr(sandbox, "_CHECKED", None)  # the once-per-process check runs again
    monkeypatch.setenv("DARE_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        score_texts([code_row("assert True"), row("arithmetic", "4")], ["x = 1", "4"])
    monkeypatch.setenv("DARE_BWRAP", "/bin/false")  # a jail that never starts
    with pytest.raises(SandboxUnavailable):
        score_texts([code_row("assert True")] * 3, ["x = 1"] * 3, workers=2)


# ---- parsers ----------------------------------------------------------------------------------------

N = 48 * 1024
ADVERSARIAL = [
    ("math", "\\boxed{" + "1\\text{a}" * (N // 10) + "}", "1"),
    ("math", "\\boxed{" + "{" * (N // 2) + "}" * (N // 2) + "}", "1"),
    ("math", "\\fbox{" * (N // 6), "1"),
    ("math", "\\boxed " * (N // 7) + "\\boxed{1}", "1"),
    ("gsm8k", "\\fbox{" * (N // 6) + "\\boxed{1}", "#### 1"),
    ("gsm8k_d1", "<reasoning>" + "</reasoning>\n<answer>\n" * (N // 22), "#### 1"),
    ("gsm8k_d1", "<reasoning>\n" + "\n</reasoning>\n<answer>\n" * (N // 24) + "1\n</answer>", "#### 1"),
    ("countdown", "<answer>1</answer>" * (N // 17) + "<answer>(1+2)*3</answer>", "9|1,2,3"),
    ("countdown", "<answer>" * (N // 8), "9|1,2,3"),
    ("sudoku", "<answer>" * (N // 8), "1030000100400200|1234341221434321"),
    ("choice", "answer" + " " * N, "A"),
    ("choice", "answer :" * (N // 8) + " the answer is (A)", "A"),
    ("numeric", "1," * (N // 2) + " 5", "5"),
    ("exact_match", "x" * N, "x"),
]


@pytest.mark.parametrize("reward, text, truth", ADVERSARIAL, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(ADVERSARIAL)])
def test_parsers_are_quick_on_48k_adversarial_text(reward, text, truth):
    started = time.monotonic()
    result = score_texts([row(reward, truth)], [text])[0]
    assert time.monotonic() - started < 1.0
    assert "failure" not in result.extra, result.extra
    if text.endswith(("{1}", "</answer>", "(A)", " 5")):  # a real answer after the noise is still found
        assert result.acc == 1.0, result


@linux_only
def test_unclosed_fences_are_extracted_quickly():
    started = time.monotonic()
    result = score_texts([code_row("assert f() == 1")], ["~~~python\n" * 6500 + "```python\ndef f():\n    return 1\n```\n"])[0]
    assert result.score == 1.0 and time.monotonic() - started < 2.0


def test_numbers_past_the_int_conversion_limit_do_not_match():
    huge = "1" * 4301
    cases = [(row("countdown", "9|1,2,3"), f"<answer>{huge}</answer>", 0.1), (row("countdown", "9|1,2,3|plain"), huge, 0.1),
             (row("arithmetic", "11"), huge, 0.0), (row("arithmetic", "-5"), "-" + "0" * 5000 + "5", 1.0),
             (row("numeric", "5"), huge, 0.0), (row("numeric", "5"), "1e" + "9" * 4301, 0.0),
             (row("gsm8k", "#### 5"), huge, 0.0), (row("math", "5"), f"\\boxed{{{huge}}}", 0.0)]
    results = score_texts([r for r, _, _ in cases], [t for _, t, _ in cases])
    assert [r.score for r in results] == [score for _, _, score in cases]
    assert not any("failure" in r.extra for r in results)


def test_linear_scans_decide_like_the_regular_expressions():
    # the earlier regular expressions, as oracles (quadratic on unclosed fences: fine for short texts)
    fence = re.compile(r"^[ \t]*(```|~~~)[ \t]*([^\n`]*)\n(.*?)^[ \t]*\1[ \t]*$", re.DOTALL | re.MULTILINE)
    strict = re.compile(r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?", re.DOTALL)
    soft = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
    rng = random.Random(0)
    tags = ["<reasoning>", "</reasoning>", "<answer>", "</answer>", "\n", " ", "x", "<reasoning>\n", "\n</answer>"]
    fences = ["```", "~~~", "```python", "```js", " ```", "\n", "\n", "x", "`", "````", "\t"]
    for _ in range(3000):
        text = "".join(rng.choice(tags) for _ in range(rng.randint(0, 9)))
        assert (_d1_strict(text), _d1_soft(text)) == (bool(strict.fullmatch(text)), bool(soft.match(text))), repr(text)
        text = "".join(rng.choice(fences) for _ in range(rng.randint(0, 14)))
        expected = [m.group(3) for m in fence.finditer(text)
                    if (m.group(2).strip().lower().split(" ")[0] if m.group(2).strip() else "") in _PYTHON_LANGS]
        assert python_blocks(text) == expected, repr(text)


# ---- rewards that raise, and configuration errors ---------------------------------------------------

@pytest.fixture
def mod(user_module):
    return user_module(
        "def picky(completion, ground_truth, row):\n"
        "    if completion == 'boom':\n        raise RuntimeError('kaput')\n"
        "    return float('nan') if completion == 'nan' else float(completion == ground_truth)\n")


def test_a_user_reward_that_raises_scores_zero_within_the_allowed_share(mod):
    """Within rl.reward_errors_allowed, a raise of the user's function scores 0 with its reason, like
    a built-in reward's parser failing on odd text (which never stops a batch)."""
    rows = [row(f"{mod}:picky", "ok", "a"), row(f"{mod}:picky", "ok", "b"), row(f"{mod}:picky", "ok", "c"),
            row("countdown", "not a ground truth", "d"), row("arithmetic", "4", "e")]
    results = score_texts(rows, ["boom", "ok", "boom", "1+1", "4"], errors_allowed=0.4)
    assert [r.score for r in results] == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert "raised RuntimeError on row a: kaput" in results[0].extra["error"] and "countdown" in results[3].extra["error"]
    assert [r.extra.get("failure") for r in results] == ["exception", None, "exception", "exception", None]
    assert [bool(r.extra.get("user_code")) for r in results] == [True, False, True, False, False]
    metrics = failure_metrics(results)
    assert metrics["reward_failed"] == metrics["reward_failed/exception"] == 0.6
    assert set(metrics) == {"reward_failed", *(f"reward_failed/{r}" for r in FAILURE_REASONS)}
    # a built-in reward failing on every response never stops the batch
    assert [r.score for r in score_texts([row("countdown", "not a ground truth", "d")] * 3, ["1+1"] * 3)] == [0.0] * 3


def test_a_broken_user_reward_stops_the_batch_with_one_line(mod):
    rows = [row(f"{mod}:picky", "ok", u) for u in "abcd"]
    with pytest.raises(RewardFailed, match=r"^reward '[^']+:picky' raised RuntimeError on row b: kaput \(1 of 4 responses "
                                           r"so far, errors_allowed 0\)$"):
        score_texts(rows, ["ok", "boom", "ok", "ok"])
    with pytest.raises(RewardFailed, match=r"raised RuntimeError on row c: kaput \(2 of 4 responses so far, "
                                           r"rl.reward_errors_allowed 0.25\)"):
        score_texts(rows, ["ok", "boom", "boom", "ok"], errors_allowed=0.25, setting="rl.reward_errors_allowed")
    # not a number: whatever the share
    with pytest.raises(RewardFailed, match=r"non-finite score nan on row c \(a reward must return a finite number\)"):
        score_texts(rows, ["ok", "ok", "nan", "ok"], errors_allowed=1.0)
    with pytest.raises(RewardFailed, match=r"raised RuntimeError on row a: kaput$"):  # eval grades one response at a time
        score_row(rows[0], "boom")


def test_configuration_errors_still_raise(mod):
    with pytest.raises(RewardError, match="unknown option"):
        score_texts([row("exact_match", "x")], ["x"], "exact_match", {"lower": True})
    with pytest.raises(RewardError, match="must be a number >= 0"):  # an option's value, checked when scoring
        score_texts([row("numeric", "5")], ["5"], "numeric", {"abs_tol": -1})
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        score_texts([row("arithmetic", "4")], ["4"], "nope")
    with pytest.raises(ValueError, match="column 'reward_args' must be a JSON object"):
        score_texts([dict(row("numeric", "5"), reward_args="[1]")], ["5"])
    with pytest.raises(ValueError, match="2 rows but 1 texts"):
        score_texts([row("arithmetic", "4")] * 2, ["4"])


# ---- concurrency ------------------------------------------------------------------------------------

@linux_only
def test_parallel_scoring_matches_serial_in_input_order():
    add = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    batch = [(code_row(add), "def add(a, b):\n    return a + b\n"), (row("arithmetic", "4"), "4"),
             (code_row(add), "def add(a, b):\n    return a - b\n"), (code_row(STDIO), "print(int(input()) * 2)"),
             (code_row(STDIO), "print(int(input()) + 1)"), (row("math", "\\frac{1}{2}"), "\\boxed{0.5}"),
             (code_row(add), "def add(a, b):\n    return a +"), (code_row(STDIO), "raise SystemExit(3)"),
             (code_row(add), "import os\nos._exit(0)\n"), (row("countdown", "9|1,2,3"), "<answer>(1+2)*3</answer>")]
    rows, texts = [r for r, _ in batch], [t for _, t in batch]
    serial, parallel = score_texts(rows, texts, workers=1), score_texts(rows, texts, workers=3)
    assert [(r.score, r.acc, r.pred, r.extra) for r in parallel] == [(r.score, r.acc, r.pred, r.extra) for r in serial]
    assert [r.score for r in serial] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_worker_count(monkeypatch):
    monkeypatch.setenv("DARE_REWARD_WORKERS", "3")
    assert default_workers() == 3
    monkeypatch.setenv("DARE_REWARD_WORKERS", "0")
    with pytest.raises(UserError, match="DARE_REWARD_WORKERS"):
        default_workers()
    monkeypatch.delenv("DARE_REWARD_WORKERS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cores = default_workers()
    assert cores >= 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))  # ranks of one host share its cores
    assert default_workers() == 1
