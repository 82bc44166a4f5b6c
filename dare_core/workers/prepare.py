"""Worker of the `prepare` stage: synthetic task or raw file -> validated parquet + tokenizer."""
import json
import sys

from dare_core.data.prepare import prepare
from dare_core.workers.common import run_worker


def _run(cfg) -> None:
    summary = prepare(cfg)
    print(json.dumps(summary, indent=2))


def main(argv=None) -> int:
    return run_worker(_run, argv, "DARE prepare stage")


if __name__ == "__main__":
    sys.exit(main())
