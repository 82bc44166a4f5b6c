"""Code and docs cite the project's own documentation, and every citation resolves.

(a) Every `docs/<file>.md#<anchor>` written anywhere in the repository, and every relative
    `](<file>.md#<anchor>)` / `](#<anchor>)` link inside docs/, names a file that exists and an
    anchor it defines: an explicit `<a id="...">` or the GitHub slug of one of its headings.
(b) Nothing outside docs/ cites the design spec that lives outside the repository: the explanations
    are in docs/ (diffusion.md, algorithms.md, sampling.md, evaluation.md), in the project's words.
Pure text, no imports of the package."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".sh", ".ini", ".json", ".env"}
PRUNE = {"__pycache__", "node_modules", "runs", "models", "prepared", "tokenizer", "dvc_plots"}
EXTERNAL_SPEC = "ALGORITHMS" + ".md"  # spelled in two parts so that this file does not cite it

DOC_REF = re.compile(r"(?<![\w/.-])docs/([\w/-]+\.md)#([\w-]+)")
RELATIVE_LINK = re.compile(r"\]\((?!https?:)([\w./-]*\.md)?#([\w-]+)\)")
EXPLICIT_ANCHOR = re.compile(r"""<a\s+(?:id|name)\s*=\s*["']([^"']+)["']""")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def repo_files() -> list[Path]:
    """Text files of the checkout: git's view (tracked and untracked, ignores applied), else a walk."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = []
        for folder, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in PRUNE]
            names += [os.path.relpath(os.path.join(folder, f), REPO) for f in files]
    paths = [REPO / n for n in names]
    return sorted(p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file())


def slug(heading: str) -> str:
    """GitHub's heading anchor: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Explicit anchors and heading slugs (repeats numbered -1, -2, ... as GitHub does)."""
    found, seen, fenced = set(), {}, False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(EXPLICIT_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_slug_follows_github():
    assert slug("One KV cache, four policies") == "one-kv-cache-four-policies"
    assert slug("Block-diffusion two-stream layout `[x_t ; x_0]`") == "block-diffusion-two-stream-layout-x_t--x_0"
    assert slug("d1 (diffu-GRPO)") == "d1-diffu-grpo"


def test_every_doc_citation_resolves():
    cache: dict[Path, set[str]] = {}
    broken = []
    for path in repo_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        refs = [(DOCS / f, a) for f, a in DOC_REF.findall(text)]
        if path.parent == DOCS:
            refs += [((DOCS / f) if f else path, a) for f, a in RELATIVE_LINK.findall(text)]
        for doc, anchor in refs:
            if doc not in cache:
                cache[doc] = anchors(doc) if doc.is_file() else set()
            if anchor not in cache[doc]:
                broken.append(f"{path.relative_to(REPO)}: {doc.relative_to(REPO)}#{anchor}")
    assert cache, "no citation of docs/ found at all: the pattern no longer matches"
    assert not broken, "citations whose file or anchor does not exist:\n" + "\n".join(broken)


def test_nothing_outside_docs_cites_the_external_spec():
    citing = [str(p.relative_to(REPO)) for p in repo_files()
              if DOCS not in p.parents and p != Path(__file__).resolve()
              and EXTERNAL_SPEC in p.read_text(encoding="utf-8", errors="replace")]
    assert not citing, (f"{len(citing)} files cite {EXTERNAL_SPEC}, which is not in this repository; link the "
                        f"docs/ section instead (docs/<file>.md#<anchor>):\n" + "\n".join(citing))
