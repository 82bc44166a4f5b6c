"""Tiny copies of every public benchmark, written in the benchmark's own on-disk format.

`write_benchmark_fixtures(root, n)` writes them under `root` (the data folder the benchmarks read)
and returns, per benchmark name, the rows its `load(root)` gives (0-shot). Items are generated, so
any `n` works: `n` test items per benchmark (MMLU splits them over two subjects), plus the dev/train
files few-shot prompts draw from. All text is plain ASCII; code items' canonical solutions pass
their tests. Use `from eval_fixtures import write_benchmark_fixtures` in tests.
"""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path



def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _sum_item(rng: random.Random, i: int) -> tuple[str, list[str], int]:
    """An addition question with four distinct numeric options; the gold position cycles A-D."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    right = a + b
    wrong = [right + 1, right - 1, right + 10]
    gold = i % 4
    options = wrong[:gold] + [right] + wrong[gold:]
    return f"What is {a} + {b}?", [str(o) for o in options], gold


def _mmlu(root: Path, n: int) -> None:
    rng = random.Random("mmlu")
    for subject, count in (("elementary_mathematics", n - n // 2), ("high_school_arithmetic", n // 2)):
        for split, rows in (("test", count), ("dev", 5)):
            if rows == 0:
                continue
            path = root / "mmlu" / split / f"{subject}_{split}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                for i in range(rows):
                    q, options, gold = _sum_item(rng, i)
                    writer.writerow([f"{q} ({split} {i}, {subject})", *options, "ABCD"[gold]])


def _mmlu_pro(root: Path, n: int) -> None:
    import pyarrow as pa  # here, so the GPU benchmark (gsm8k only) needs no pyarrow
    import pyarrow.parquet as pq

    rng = random.Random("mmlu_pro")

    def rows(split: str, count: int, start: int) -> list[dict]:
        out = []
        for i in range(count):
            category = ("math", "physics")[i % 2]
            size = 10 if i % 3 else 4  # most MMLU-Pro items have 10 options, some fewer
            a, b = rng.randint(2, 30), rng.randint(2, 30)
            gold = (i * 3) % size
            options = [str(a * b + k - gold) for k in range(size)]
            out.append({"question_id": start + i, "question": f"What is {a} times {b}? ({split} {i})",
                        "options": options, "answer": "ABCDEFGHIJ"[gold], "answer_index": gold,
                        "cot_content": f"A: Let's think step by step. {a} * {b} = {a * b}. The answer is "
                                       f"({'ABCDEFGHIJ'[gold]}).",
                        "category": category, "src": f"fixture-{category}"})
        return out

    folder = root / "mmlu_pro" / "data"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows("test", n, 70)), folder / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows("validation", 10, 0)), folder / "validation-00000-of-00001.parquet")


# (activity label, ctx_a, ctx_b, endings, index of the sensible ending)
_ACTIVITIES = [("Washing dishes", "A man fills a sink with water.", "He",
                ["adds soap and scrubs the plates.", "flies the sink to the moon.",
                 "paints the water blue with a roller.", "reads the plates a bedtime story."], 0),
               ("Making tea", "[header] How to make tea [title] Boil water.", "Then you",
                ["sing to the kettle until it freezes.", "pour the hot water over a tea bag in a cup.",
                 "put the cup in the freezer for a week.", "throw the tea bag out of the window."], 1),
               ("Riding a bike", "A girl puts on a helmet and sits on a bike.", "She",
                ["eats the helmet.", "folds the bike into a paper plane.",
                 "pushes the pedals and rides down the street.", "turns into a bicycle bell."], 2)]


def _hellaswag(root: Path, n: int) -> None:
    def rows(split: str, count: int, start: int) -> list[dict]:
        out = []
        for i in range(count):
            label, ctx_a, ctx_b, endings, gold = _ACTIVITIES[i % len(_ACTIVITIES)]
            shift = i % 4  # rotate so the gold ending moves over A-D
            endings = endings[shift:] + endings[:shift]
            out.append({"ind": start + i, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b,
                        "ctx": f"{ctx_a} {ctx_b} ({split} {i})", "endings": endings, "label": (gold - shift) % 4,
                        "split": split, "split_type": "indomain", "source_id": f"fixture~{start + i}"})
        return out

    _write_jsonl(root / "hellaswag" / "hellaswag_val.jsonl", rows("val", n, 1000))
    _write_jsonl(root / "hellaswag" / "hellaswag_train.jsonl", rows("train", 3, 0))


def _arc(root: Path, n: int) -> None:
    rng = random.Random("arc")

    def rows(prefix: str, count: int) -> list[dict]:
        out = []
        for i in range(count):
            q, options, gold = _sum_item(rng, i)
            if i % 5 == 2:  # a few ARC items have five options
                options = options + ["none of these"]
            labels = [str(k + 1) for k in range(len(options))] if i % 3 == 1 else list("ABCDE"[:len(options)])
            out.append({"id": f"{prefix}_{i}", "question": {"stem": q, "choices": [
                {"text": t, "label": lab} for t, lab in zip(options, labels)]}, "answerKey": labels[gold]})
        return out

    _write_jsonl(root / "ARC-Challenge" / "ARC-Challenge-Test.jsonl", rows("Fixture_test", n))
    _write_jsonl(root / "ARC-Challenge" / "ARC-Challenge-Train.jsonl", rows("Fixture_train", 3))


def gsm8k_item(i: int, split: str = "test") -> dict:
    """A simple two-step word problem with a GSM8K-style solution (calculator annotations included)."""
    rng = random.Random(f"gsm8k-{split}-{i}")
    name = ["Tom", "Ana", "Lee", "Maya", "Omar", "Zoe"][i % 6]
    thing = ["apples", "stamps", "marbles", "books"][i % 4]
    a, b, c = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 12)
    bought, total = b * c, a + b * c
    return {"question": f"{name} has {a} {thing}. {name} buys {b} boxes with {c} {thing} in each box. "
                        f"How many {thing} does {name} have now?",
            "answer": f"{name} buys {b} * {c} = <<{b}*{c}={bought}>>{bought} {thing}.\n"
                      f"Now {name} has {a} + {bought} = <<{a}+{bought}={total}>>{total} {thing}.\n#### {total}"}


def _gsm8k(root: Path, n: int) -> None:
    _write_jsonl(root / "gsm8k" / "test.jsonl", [gsm8k_item(i) for i in range(n)])
    _write_jsonl(root / "gsm8k" / "train.jsonl", [gsm8k_item(i, "train") for i in range(8)])


_MATH = [("algebra", "Algebra", "Solve for $x$: $2x + 1 = 2$.",
          "Subtracting 1 gives $2x = 1$, so $x = \\boxed{\\frac{1}{2}}$."),
         ("number_theory", "Number Theory", "What is the remainder when $17$ is divided by $5$?",
          "Since $17 = 3 \\cdot 5 + 2$, the remainder is $\\boxed{2}$."),
         ("algebra", "Algebra", "Simplify $\\sqrt{8}/2$.",
          "We have $\\sqrt{8} = 2\\sqrt{2}$, so the result is $\\boxed{\\sqrt{2}}$."),
         ("number_theory", "Number Theory", "How many positive divisors does $12$ have?",
          "The divisors are 1, 2, 3, 4, 6 and 12, so there are $\\boxed{6}$.")]


def _math(root: Path, n: int) -> None:
    for split, count in (("test", n), ("train", 3)):
        for i in range(count):
            subject, kind, problem, solution = _MATH[i % len(_MATH)]
            path = root / "math" / split / subject / f"{i}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"problem": f"{problem} (item {i})", "level": f"Level {1 + i % 5}",
                                        "type": kind, "solution": solution}, indent=4))


def _gpqa(root: Path, n: int) -> None:
    path = root / "gpqa" / "gpqa_diamond.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Pre-Revision Question", "Question", "Correct Answer", "Incorrect Answer 1",
                         "Incorrect Answer 2", "Incorrect Answer 3", "Explanation", "Record ID", "High-level domain"])
        for i in range(n):
            q = f"Which gas makes up most of Earth's atmosphere, by volume?\nConsider dry air, sample {i}."
            writer.writerow([q, q, f"Nitrogen ({i})", f"Oxygen ({i})", f"Argon, a noble gas ({i})",
                             f"Carbon dioxide ({i})", "About 78 percent is nitrogen.", f"recFixture{i:04d}", "Chemistry"])


def _aime24(root: Path, n: int) -> None:
    # as Maxwell-Jia/AIME_2024 exported to jsonl
    _write_jsonl(root / "aime24" / "aime24.jsonl", [
        {"ID": f"2024-I-{i + 1}", "Problem": f"Find the remainder when $7^{{{i + 2}}}$ is divided by $1000$.",
         "Solution": "Compute the power modulo 1000.", "Answer": pow(7, i + 2, 1000)} for i in range(n)])


def _aime25(root: Path, n: int) -> None:
    # as OpenCompass's AIME file: question/answer, no ids
    _write_jsonl(root / "aime25" / "aime25.jsonl", [
        {"question": f"Find the number of ordered pairs $(a, b)$ of positive integers with $a + b = {i + 12}$.",
         "answer": str(i + 11)} for i in range(n)])


def _olympiadbench(root: Path, n: int) -> None:
    items = []
    for i in range(n):
        item = {"id": 2000 + i, "subfield": "Algebra", "context": None, "unit": None, "answer_type": "Numerical",
                "error": None, "question": f"Compute $\\frac{{{i + 1}}}{{{2 * (i + 1)}}} + {i}$.",
                "final_answer": [f"$\\frac{{{2 * i + 1}}}{{2}}$"], "is_multiple_answer": False,
                "solution": [f"The fraction equals $\\frac{{1}}{{2}}$, so the sum is $\\frac{{{2 * i + 1}}}{{2}}$."]}
        if i % 3 == 1:
            item.update(question=f"Find all real $x$ with $(x - {i})(x - {i + 1}) = 0$, in increasing order.",
                        final_answer=[f"${i}$", f"${i + 1}$"], is_multiple_answer=True, answer_type="Numerical")
        if i % 3 == 2:  # the release also writes several answers as one comma-separated string
            item.update(question=f"Find all ordered pairs $(a, b)$ with $a + b = {i + 1}$ and $a b = {i}$.",
                        final_answer=[f"$(1,{i}), ({i},1)$"], is_multiple_answer=True, answer_type="Tuple")
        items.append(item)
    path = root / "olympiadbench" / "OE_TO_maths_en_COMP.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(items, indent=2))


_HUMANEVAL = [
    ("running_max", "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
     "    \"\"\"Return the running maximum of the list.\n    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n"
     "    \"\"\"\n",
     "    result = []\n    best = None\n    for x in numbers:\n        best = x if best is None else max(best, x)\n"
     "        result.append(best)\n    return result\n",
     "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate([]) == []\n"
     "    assert candidate([1, 3, 2, 5]) == [1, 3, 3, 5]\n    assert candidate([4, 1]) == [4, 4]\n"),
    ("is_palindrome_word", "\n\ndef is_palindrome_word(text: str) -> bool:\n"
     "    \"\"\"Whether text reads the same backwards, ignoring case.\n    >>> is_palindrome_word('Level')\n"
     "    True\n    \"\"\"\n",
     "    lowered = text.lower()\n    return lowered == lowered[::-1]\n",
     "\n\ndef check(candidate):\n    assert candidate('Level') is True\n    assert candidate('abc') is False\n"
     "    assert candidate('') is True\n"),
    ("count_vowels", "\n\ndef count_vowels(s: str) -> int:\n    \"\"\"Number of vowels (a, e, i, o, u) in s.\n"
     "    >>> count_vowels('banana')\n    3\n    \"\"\"\n",
     "    return sum(1 for ch in s.lower() if ch in 'aeiou')\n",
     "\n\ndef check(candidate):\n    assert candidate('banana') == 3\n    assert candidate('xyz') == 0\n"
     "    assert candidate('AEIOU') == 5\n"),
]


def _humaneval(root: Path, n: int) -> None:
    rows = []
    for i in range(n):
        if i < len(_HUMANEVAL):
            entry, prompt, solution, test = _HUMANEVAL[i]
        else:
            entry = f"add_{i}"
            prompt = f"\n\ndef {entry}(x: int) -> int:\n    \"\"\"Return x plus {i}.\n    >>> {entry}(1)\n    {i + 1}\n    \"\"\"\n"
            solution, test = f"    return x + {i}\n", f"\n\ndef check(candidate):\n    assert candidate(1) == {i + 1}\n"
        rows.append({"task_id": f"HumanEval/{i}", "prompt": prompt, "canonical_solution": solution, "test": test,
                     "entry_point": entry})
    _write_jsonl(root / "humaneval" / "HumanEval.jsonl", rows)


def _mbpp_item(task_id: int) -> dict:
    """Items 2-4 (few-shot) and the rest differ in the constant they use; the code has CRLF line ends."""
    k = task_id % 7 + 1
    setup = "import math" if task_id % 4 == 0 else ""
    body = f"  return math.floor(sum(x * {k} for x in nums))" if setup else f"  return sum(x * {k} for x in nums)"
    return {"text": f"Write a function to return the sum of the list elements each multiplied by {k}.",
            "code": f"def scaled_sum_{task_id}(nums):\r\n{body}", "task_id": task_id, "test_setup_code": setup,
            "test_list": [f"assert scaled_sum_{task_id}([1, 2]) == {3 * k}", f"assert scaled_sum_{task_id}([]) == 0"],
            "challenge_test_list": []}


def _mbpp(root: Path, n: int) -> None:
    ids = [1, 2, 3, 4, 5] + list(range(11, 11 + n)) + [511, 601]
    _write_jsonl(root / "mbpp" / "mbpp.jsonl", [_mbpp_item(t) for t in ids])


WRITERS = {"mmlu": _mmlu, "mmlu_pro": _mmlu_pro, "hellaswag": _hellaswag, "arc_c": _arc, "gsm8k": _gsm8k,
           "math": _math, "gpqa": _gpqa, "aime24": _aime24, "aime25": _aime25,
           "olympiadbench": _olympiadbench, "humaneval": _humaneval, "mbpp": _mbpp}


def write_benchmark_fixtures(root: Path, n: int = 3) -> dict[str, list[dict]]:
    """Write every benchmark's fixture files under `root`; per benchmark, the rows `load(root)` returns."""
    from dare_core.eval.configs import get_benchmark

    if n < 1 or n > 500:
        raise ValueError(f"n must be in 1..500 (MBPP's test split has 500 ids), got {n}")
    root = Path(root)
    for write in WRITERS.values():
        write(root, n)
    return {name: get_benchmark(name).load(root) for name in WRITERS}
