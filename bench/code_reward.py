"""Code reward throughput: one batch of code completions scored by `score_texts` one at a time and
concurrently, side by side in one run, on this machine's CPU cores.

    python3 bench/code_reward.py                       # writes bench/results/code_reward.md
    python3 bench/code_reward.py --n 16 --out /tmp/code_reward.md

The batch (`--n`, default 64) mixes what an RL step grades: correct, wrong and slow programs, half with
assertion tests (two jails each) and half with stdin/stdout tests, and a few that crash. Every program
does real CPU work first (a loop of `--work` million iterations, about 0.5 s here; slow ones twice
that), so the wall time is the jails' work, not their start-up. Both modes score the same batch and
must give identical results; the ratio is from one run of each.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dare_core.rewards.sandbox import check_available  # noqa: E402
from dare_core.rewards.scoring import default_workers, score_texts  # noqa: E402
from stamp import hardware, header, markdown_table  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "code_reward.md"
WORK = "def work(n):\n    s = 0\n    for i in range(n):\n        s += i * i % 7\n    return s\n"
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-4, 4) == 0\n"
STDIO = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]})
KINDS = ("correct", "wrong", "slow", "correct", "wrong", "slow", "correct", "crash")


def completion(kind: str, stdio: bool, iterations: int) -> tuple[dict, str]:
    """(row, response) of one completion: `kind` of program, in the stdin/stdout or assertion layout."""
    n = iterations * (2 if kind == "slow" else 1)
    op = "-" if kind == "wrong" else "+"
    fail = "raise RuntimeError('boom')\n" if kind == "crash" else ""
    if stdio:
        body = f"{WORK}work({n})\n{fail}a, b = map(int, input().split())\nprint(a {op} b)\n"
        truth = STDIO
    else:
        body = f"{WORK}work({n})\n{fail}def add(a, b):\n    return a {op} b\n"
        truth = ADD_TESTS
    row = {"uid": f"{kind}-{stdio}", "task": "code", "reward": "code", "ground_truth": truth, "prompt_text": ""}
    return row, f"Here is my solution.\n```python\n{body}```\n"


def batch(n: int, iterations: int) -> tuple[list[dict], list[str]]:
    pairs = [completion(KINDS[i % len(KINDS)], i % 2 == 1, iterations) for i in range(n)]
    return [r for r, _ in pairs], [t for _, t in pairs]


def timed(rows: list[dict], texts: list[str], workers: int) -> tuple[float, list]:
    started = time.perf_counter()
    results = score_texts(rows, texts, workers=workers)
    return time.perf_counter() - started, results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=64, help="completions in the batch")
    parser.add_argument("--work", type=float, default=5.0, help="million loop iterations per program (slow: twice)")
    parser.add_argument("--workers", type=int, default=None, help="concurrent jails (default: score_texts' default)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    command = "python3 bench/code_reward.py" + "".join(f" {shlex.quote(a)}" for a in (argv if argv is not None else sys.argv[1:]))
    workers = args.workers or default_workers()
    check_available()  # the one-off probe is not charged to either mode
    rows, texts = batch(args.n, int(args.work * 1_000_000))
    load_before = os.getloadavg()[0]
    serial_s, serial = timed(rows, texts, 1)
    parallel_s, parallel = timed(rows, texts, workers)
    load_after = os.getloadavg()[0]
    same = [(r.score, r.extra.get("status")) for r in serial] == [(r.score, r.extra.get("status")) for r in parallel]
    statuses = Counter(r.extra.get("status") for r in serial)
    lines = header("Code reward: one batch scored serially and concurrently", command, hardware(gpu=False, cpu_detail=True))
    lines += [f"{args.n} code completions in one `score_texts` call: {dict(Counter(r['uid'].split('-')[0] for r in rows))}"
              f" (half assertion tests, half stdin/stdout). Every program first runs a {args.work:g}M-iteration Python "
              "loop (slow ones twice that). Sandbox defaults: 10 s of CPU time per run (wall-clock backstop 30 s), "
              "1 core per jail, each jail with its own copy of the runtime.", ""]
    lines += markdown_table(["mode", "workers", "wall s", "s per completion", "speed-up"], [
        ["serial", 1, f"{serial_s:.1f}", f"{serial_s / args.n:.2f}", "1.00x"],
        ["parallel", workers, f"{parallel_s:.1f}", f"{parallel_s / args.n:.2f}", f"{serial_s / parallel_s:.2f}x"]])
    lines += ["",
              f"Sandbox statuses (serial run): {dict(statuses)}; mean score {sum(r.score for r in serial) / args.n:.3f}.  ",
              f"Parallel results identical to serial (score and status of every completion, in order): {'yes' if same else 'NO'}.  ",
              f"1-minute load average {load_before:.1f} before the serial run, {load_after:.1f} after the parallel one "
              "(other work on the machine takes cores from both modes).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    if not same:
        raise SystemExit("parallel scoring differs from serial")


if __name__ == "__main__":
    main()
