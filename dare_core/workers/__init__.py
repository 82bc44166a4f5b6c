"""Stage workers: one module per `dare stage <name>`, run under the launcher (dare_core/cli.py)."""
