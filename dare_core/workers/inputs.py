"""Worker of the `inputs` stage, the first stage of every `dvc repro`: it checks every stage's
settings (workers/settings_checks.py: prepare's dry run, the later stages' settings against the
model), then writes the identity of every input file to `<run.metrics_dir>/inputs.json` for DVC to
compare, and the list of project input files that dvc.yaml reads, `data/input_files.yaml`
(dare_core/inputs.py). DVC runs it every time, so the checks are made only when something they
depend on changed (the settings, the inputs, the prepared data, DARE's code): otherwise it loads
no model and starts no torch."""
import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Optional

from dare_core.config import DareConfig, to_dict
from dare_core.data.made_from import prepared_summary
from dare_core.inputs import identities, inputs_file, project_input_files, write_input_files_list
from dare_core.storage import atomic_write_json, atomic_write_text
from dare_core.workers.common import debug_requested, parse, run_reporting_errors

# the digest of what the last checks that passed depended on (under the project, beside the other caches)
CHECKED = Path(".cache") / "checks" / "inputs_stage"
CODE = Path(__file__).resolve().parents[1]  # dare_core


def _code_digest() -> str:
    """DARE's own code: a new version may check more."""
    digest = hashlib.sha256()
    for path in sorted(CODE.rglob("*.py")):
        digest.update(path.relative_to(CODE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def checks_digest(cfg: DareConfig, found: dict) -> str:
    """What the checks' outcome depends on: every setting, the inputs' identities, what the prepared
    data on disk was made from, and the code."""
    prepared = (prepared_summary(cfg) or {}).get("made_from")
    record = {"settings": to_dict(cfg), "inputs": found, "prepared": prepared, "code": _code_digest()}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def check_when_changed(cfg: DareConfig, found: dict) -> str:
    """Every stage's settings checked (raising what a stage would refuse), unless nothing they depend
    on changed since they last passed; a line saying which."""
    digest = checks_digest(cfg, found)
    with contextlib.suppress(OSError):
        if CHECKED.read_text() == digest:
            return "settings and inputs unchanged since their last check"
    from dare_core.workers.settings_checks import check_settings  # (torch: only when something changed)

    check_settings(cfg, found)
    with contextlib.suppress(OSError):  # a project without a writable .cache checks again next time
        atomic_write_text(CHECKED, digest)
    return "every stage's settings checked"


def main(argv: Optional[list] = None) -> int:
    def work() -> int:
        cfg = parse(argv, "DARE inputs stage: check the settings, record the content of the input files")
        found = identities(cfg)
        checked = check_when_changed(cfg, found)
        atomic_write_json(inputs_file(cfg), found)
        write_input_files_list(project_input_files(cfg))
        print(json.dumps(found, indent=2))
        print(f"inputs: {checked}")
        return 0

    return run_reporting_errors(work, debug_requested(argv))


if __name__ == "__main__":
    sys.exit(main())
