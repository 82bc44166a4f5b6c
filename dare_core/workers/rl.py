"""Worker of the `rl` stage, launched on every rank (`dare stage rl`)."""
import sys

from dare_core.training.rl.loop import run_rl
from dare_core.workers.common import run_worker


def main(argv=None) -> int:
    return run_worker(run_rl, argv, "DARE rl stage worker")


if __name__ == "__main__":
    sys.exit(main())
