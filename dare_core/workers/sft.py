"""Worker of the `sft` stage, launched on every rank (`dare stage sft`)."""
import sys

from dare_core.training.sft_loop import run_sft
from dare_core.workers.common import run_worker


def main(argv=None) -> int:
    return run_worker(run_sft, argv, "DARE sft stage worker")


if __name__ == "__main__":
    sys.exit(main())
