"""The README's measured numbers come from the results files it links: every decimal number, ratio
('2.13x') and percentage in a README section that links `bench/results/*.md` files must appear
verbatim in one of the files that section links."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\((bench/results/[\w.-]+\.md)\)")
# 33.3%, 2.13x, 51.11, 18x; not plain integers (batch sizes, lengths, model sizes are settings)
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:x|%)|\d+\.\d+)(?![\w.]*\d)")


def blocks(text: str) -> list[str]:
    """The README's sections (split at headings): a section's numbers are looked for in the results
    files linked anywhere in it (the link may sit in the sentence before or after a table or list)."""
    return [b for b in re.split(r"\n(?=#+ )", text) if b.strip()]


def unsourced(readme: str) -> list[tuple[str, list[str]]]:
    """(number, files it was looked for in) for every README number missing from its linked files."""
    missing = []
    for block in blocks(re.sub(r"```.*?```", "", readme, flags=re.S)):  # code blocks hold settings
        files = LINK.findall(block)
        if not files:
            continue
        texts = [(REPO / f).read_text() if (REPO / f).exists() else "" for f in files]
        for number in NUMBER.findall(LINK.sub("", block)):
            if not any(number in t for t in texts):
                missing.append((number, files))
    return missing


def test_every_readme_number_is_in_the_results_file_it_links():
    missing = unsourced((REPO / "README.md").read_text())
    assert not missing, "README numbers not found in their linked results files: " + "; ".join(
        f"{n} (looked in {', '.join(f)})" for n, f in missing)


def test_the_check_catches_a_number_typed_by_hand():
    measured = re.search(r"\d+\.\d+x", (REPO / "bench/results/train_step.md").read_text()).group()
    readme = f"DARE trains {measured} faster ([bench/results/train_step.md](bench/results/train_step.md)) at 99.9% MFU."
    assert unsourced(readme) == [("99.9%", ["bench/results/train_step.md"])]


COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def test_linked_results_were_measured_on_this_history():
    """Each commit a linked results file names on its 'Git commit' / 'Commit' line is this checkout's
    HEAD or one of its ancestors: a number measured on a branch that was dropped cannot stand."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("no git checkout: the results' commits cannot be looked up")
    files = set(LINK.findall((REPO / "README.md").read_text()))
    assert files
    for f in sorted(files):
        head = [line for line in (REPO / f).read_text().splitlines()[:12] if line.startswith(("Git commit:", "Commit:"))]
        assert head, f"{f}: no commit line at the top"
        for commit in COMMIT.findall(head[0]):
            ok = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO, capture_output=True).returncode == 0
            assert ok, f"{f}: commit {commit} is not in this checkout's history"
