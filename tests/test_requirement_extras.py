"""Every extra DARE's requirements ask for, directly or through a dependency, is one the installed
package declares, spelled as it declares it: pip otherwise warns at every install that a package
"does not provide the extra" (math-verify's antlr4-9-3 extra asked latex2sympy2_extended for
antlr4_9_3, which it spells antlr4-9-3)."""
from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def direct_requirements() -> list[Requirement]:
    lines = (REPO / "requirements" / "base.txt").read_text().splitlines()
    listed = [line.split("#")[0].strip() for line in lines]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(r) for r in listed + project if r]


def unknown_extras(requirement: Requirement, asked_by: str, seen: set[tuple[str, str]]) -> list[str]:
    try:
        dist = metadata.distribution(requirement.name)
    except metadata.PackageNotFoundError:
        return []  # not installed here (a marker excluded it): nothing pip resolved to check
    provided = set(dist.metadata.get_all("Provides-Extra") or [])
    problems = [f"{asked_by} asks {requirement.name} for extra {extra!r}; it provides {sorted(provided)}"
                for extra in sorted(requirement.extras) if extra not in provided]
    for extra in sorted(requirement.extras & provided):
        if (requirement.name, extra) in seen:
            continue
        seen.add((requirement.name, extra))
        for line in dist.requires or []:
            needed = Requirement(line)
            if needed.marker is not None and needed.marker.evaluate({"extra": extra}) and needed.extras:
                if not needed.marker.evaluate({"extra": ""}):  # only under this extra
                    problems += unknown_extras(needed, f"{requirement.name}[{extra}]", seen)
    return problems


def test_every_requested_extra_is_declared():
    seen: set[tuple[str, str]] = set()
    problems = [p for r in direct_requirements() for p in unknown_extras(r, "DARE", seen)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_extra_misspelled_one_level_down():
    problems = unknown_extras(Requirement("math-verify[antlr4-9-3]"), "DARE", set())
    assert problems == ["math-verify[antlr4-9-3] asks latex2sympy2_extended for extra 'antlr4_9_3'; "
                        "it provides ['antlr4-11-0', 'antlr4-13-2', 'antlr4-9-3', 'dev']"]
