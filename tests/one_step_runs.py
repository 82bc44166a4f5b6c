"""Runs training stages in one process, one after another, and prints one JSON line per run:
`python tests/one_step_runs.py runs.json`, each run {"label", "stage", "params", "overrides"}.
One process for many short runs: torch, DeepSpeed and the distributed group start once."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def main(spec: str) -> int:
    from dare_core.config import load_config
    from dare_core.training.preference_loop import run_preference
    from dare_core.training.rl.loop import run_rl
    from dare_core.training.sft_loop import run_sft

    stages = {"sft": run_sft, "preference": run_preference, "rl": run_rl}
    for run in json.loads(Path(spec).read_text()):
        try:
            cfg = load_config(run["params"], run["overrides"])
            metrics = stages[run["stage"]](cfg, progress=False)
            result = {"label": run["label"], "ok": True, "algorithm": cfg.rl.algorithm, "metrics": metrics}
        except Exception as exc:  # reported per run: one failure must not hide the others
            result = {"label": run["label"], "ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
