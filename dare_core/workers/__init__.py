"""Stage workers: one module per `dare stage <name>`, run under the launcher (dare_core/cli.py)."""
import os

from dare_core.training.threads import wait_policy_env

# here, before any worker module imports torch: OpenMP reads its wait policy once, as torch loads it
# (a worker started by `dare stage`'s launcher has it in its environment already)
os.environ.update(wait_policy_env(os.environ))
