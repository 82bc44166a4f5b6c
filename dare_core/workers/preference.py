"""Worker of the `preference` stage (ELBO-DPO / VRPO), launched on every rank (`dare stage preference`)."""
import sys

from dare_core.training.preference_loop import run_preference
from dare_core.workers.common import run_worker


def main(argv=None) -> int:
    return run_worker(run_preference, argv, "DARE preference stage worker")


if __name__ == "__main__":
    sys.exit(main())
