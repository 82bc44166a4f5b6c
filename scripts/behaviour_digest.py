"""Digests of what the embedded pipeline computes, to show that a change of structure changed no
behaviour: `python scripts/behaviour_digest.py --out digest.json` before the change and
`python scripts/behaviour_digest.py --check digest.json` after it (exit status 1 and the differing
entries on any difference).

Each run is a tiny project (tests/pipeline_helpers.py's settings) driven through `dare stage`, the
command DVC runs, so the digest does not depend on where the library keeps its functions. What is
digested: every tensor of every safetensors file the stages wrote (names, dtypes, shapes, bytes) and
every metric they recorded, minus what measures time or names the machine."""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

# (label, stages, overrides over the tiny settings): the stages every schedule, objective family and
# checkpoint path passes through; each label is one project
RUNS = [
    ("d1_on_policy", ["prepare", "sft", "preference", "rl", "convert"], {}),
    ("off_policy_coupled_grpo", ["prepare", "sft", "rl"],
     {"rl__schedule": "one_step_off_policy", "rl__algorithm": "coupled_grpo", "rl__kl_beta": 0.04}),
    ("spg_lora", ["prepare", "sft", "rl"], {"rl__algorithm": "spg", "model__lora": {"r": 4, "alpha": 8}}),
    ("tree", ["prepare", "sft", "rl"], {"rl__algorithm": "d_tree_rpo", "rl__group_size": 8}),
    ("sdar_block_kv", ["prepare", "sft", "rl"],
     {"model__family": "sdar", "model__init": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64},
      "rl__sampler": {"gen_length": 4, "steps": 4, "block_length": 4, "temperature": 1.0, "cache": "block_kv", "batch_size": 16}}),
]
# metric keys that measure time, speed or the machine: they differ from run to run by nature
VOLATILE = re.compile(r"(time|_s$|seconds|per_s|/s$|elapsed|wall|throughput|tokens_per|date|host|mem|peak|started|finished|pid)", re.I)


def _tensor_digest(path: Path) -> dict[str, str]:
    import torch
    from safetensors.torch import load_file

    out = {}
    for name, t in sorted(load_file(str(path)).items()):
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()[:16]
    return out


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in sorted(value.items()) if not VOLATILE.search(str(k))}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _metrics_digest(path: Path) -> str:
    if path.suffix == ".jsonl":
        rows = [_clean(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    else:
        rows = _clean(json.loads(path.read_text()))
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def run_project(label: str, stages: list[str], overrides: dict, root: Path) -> dict[str, object]:
    from pipeline_helpers import tiny_params, worker_env, write_params

    root.mkdir(parents=True)
    params = tiny_params(root, **overrides)
    write_params(root / "params.yaml", params)
    env = worker_env()
    for stage in stages:
        r = subprocess.run([sys.executable, "-m", "dare_core.cli", "stage", stage], cwd=root, env=env,
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise SystemExit(f"{label}: dare stage {stage} failed:\n{r.stderr[-3000:]}")
    digest: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.suffix == ".safetensors":
            digest[rel] = _tensor_digest(path)
        elif path.suffix in (".json", ".jsonl") and ("metrics" in rel.split("/")[0] or path.name.startswith("metrics")):
            digest[rel] = _metrics_digest(path)
    return digest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the digest here")
    ap.add_argument("--check", help="compare with this digest; exit 1 on any difference")
    ap.add_argument("--only", action="append", help="run only this label (repeatable)")
    args = ap.parse_args(argv)
    result = {}
    with tempfile.TemporaryDirectory(prefix="dare-digest-") as tmp:
        for label, stages, overrides in RUNS:
            if args.only and label not in args.only:
                continue
            result[label] = run_project(label, stages, overrides, Path(tmp) / label)
            print(f"{label}: {len(result[label])} files digested", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.check:
        expected = json.loads(Path(args.check).read_text())
        diffs = []
        for label, files in result.items():
            want = expected.get(label, {})
            for rel in sorted(set(files) | set(want)):
                if files.get(rel) != want.get(rel):
                    diffs.append(f"{label}: {rel}")
        if diffs:
            print("differs from " + args.check + ":\n  " + "\n  ".join(diffs))
            return 1
        print(f"identical to {args.check}: {sum(len(f) for f in result.values())} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
