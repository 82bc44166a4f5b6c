"""Worker of the `inputs` stage: the identity of every input file, written to
`<run.metrics_dir>/inputs.json` for DVC to compare, and the list of project input files that
dvc.yaml reads, `data/input_files.yaml` (dare_core/inputs.py). It loads no model and
starts no torch, since DVC runs it on every `dvc repro`."""
import json
import sys
from typing import Optional

from dare_core.inputs import identities, inputs_file, project_input_files, write_input_files_list
from dare_core.storage import atomic_write_json
from dare_core.workers.common import debug_requested, parse, run_reporting_errors


def main(argv: Optional[list] = None) -> int:
    def work() -> int:
        cfg = parse(argv, "DARE inputs stage: record the content of the input files")
        found = identities(cfg)
        atomic_write_json(inputs_file(cfg), found)
        write_input_files_list(project_input_files(cfg))
        print(json.dumps(found, indent=2))
        return 0

    return run_reporting_errors(work, debug_requested(argv))


if __name__ == "__main__":
    sys.exit(main())
