"""Several nodes rehearsed on one host (bench/multi_gpu.py's `multinode` part): the embedded tiny
model's SFT and RL stages as one node of N ranks, and as several "nodes" (2 of N/2 ranks from N = 4,
else N of one rank), started the way the README tells a user to start them on a cluster: the same
`dare stage` command on every node, each with its own `launch.node_rank`, `launch.nnodes` and the
first node's address (127.0.0.1 here). On a GPU host each "node" sees GPUs of its own
(CUDA_VISIBLE_DEVICES), as it would on its own machine.
Both layouts must log the same losses (SFT) and rewards (RL)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
# short runs of the embedded model: SFT long enough that some rollouts earn a reward, so that RL's
# advantages and losses are not all 0
SETTINGS = {"sft.max_steps": 400, "sft.log_every": 50, "sft.save_every": 1000, "rl.num_steps": 3, "rl.log_every": 1,
            "rl.save_every": 1000, "rl.validate_every": 0, "launch.timeout_s": 180, "launch.launcher": "torchrun",
            "data.num_sft": 4000, "data.num_rl": 400, "data.num_eval": 40, "data.num_val": 16}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dare_stage(stage: str, root: Path, name: str, **over) -> list[str]:
    settings = {**SETTINGS, "run.name": name, "run.runs_dir": str(root / "runs"), "run.models_dir": str(root / "models"),
                "run.metrics_dir": str(root / "runs" / name / "metrics"), "data.prepared_dir": str(root / "data" / "prepared"),
                "data.tokenizer_dir": str(root / "data" / "tokenizer"), **over}
    sets = [f"--set={k}={json.dumps(v)}" for k, v in settings.items()]
    return [sys.executable, "-m", "dare_core.cli", "stage", stage, "--params", str(REPO / "params.yaml"), *sets]


def env_for(gpus: Optional[range]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env


def node_layout(n: int) -> tuple[int, int]:
    """(nodes, ranks a node) that rehearse N ranks: 2 nodes of N/2 from N = 4 (the intra-node and
    the inter-node links both in play), else N nodes of one rank."""
    return (2, n // 2) if n >= 4 and n % 2 == 0 else (n, 1)


def logged(root: Path, name: str, stage: str, keys: tuple[str, ...]) -> list[float]:
    """`keys`' values at every logged step, in order."""
    path = root / "runs" / name / stage / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r[k] for r in rows for k in keys if k in r]


def one_node(stage: str, root: Path, n: int, timeout: Optional[float]) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(dare_stage(stage, root, "one-node", **{"launch.nproc": n}), env=env_for(None), cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, time.perf_counter() - t0, r.stderr[-3000:]


def several_nodes(stage: str, root: Path, n: int, timeout: Optional[float]) -> tuple[int, float, str]:
    """One `dare stage` process a node (node_layout), started together as on separate machines."""
    port = free_port()
    nodes, per_node = node_layout(n)
    cuda = _cuda()
    t0 = time.perf_counter()
    procs = [subprocess.Popen(dare_stage(stage, root, "nodes", **{"launch.nproc": per_node, "launch.nnodes": nodes, "launch.node_rank": i,
                                                                  "launch.master_addr": "127.0.0.1", "launch.master_port": port}),
                              env=env_for(range(i * per_node, (i + 1) * per_node) if cuda else None), cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for i in range(nodes)]
    errors = [p.communicate(timeout=timeout)[1] for p in procs]
    code = max(abs(p.returncode) for p in procs)
    return code, time.perf_counter() - t0, "\n".join(e[-1500:] for e in errors)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def rehearse(root: Path, n: int, timeout: Optional[float]) -> list[dict]:
    """Rows for multi_gpu.py: per stage and layout, the wall time and the logged values, and whether
    the N-node values equal the one-node ones."""
    root.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(dare_stage("prepare", root, "one-node"), env=env_for(None), cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        return [{"part": "multinode", "name": "multinode-prepare", "stage": "prepare", "layout": "-", "error": r.stderr[-300:]}]
    rows = []
    for stage, keys in (("sft", ("loss",)), ("rl", ("reward", "loss"))):
        ref = None
        nodes, per_node = node_layout(n)
        for layout, fn in ((f"1 node x {n} ranks", one_node), (f"{nodes} nodes x {per_node} rank{'s' if per_node > 1 else ''}", several_nodes)):
            name = "one-node" if fn is one_node else "nodes"
            row = {"part": "multinode", "name": f"multinode-{stage}-{name}", "stage": stage, "layout": layout,
                   "logged": "/".join(keys)}
            print(f"[multinode] {stage}: {layout} ...", flush=True)
            code, wall, err = fn(stage, root, n, timeout)
            if code:
                print(err, flush=True)
                lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
                rows.append({**row, "error": f"exit code {code}: {(lines or ['see the output'])[-1][:300]}"})
                continue
            values = logged(root, name, stage, keys)
            row.update(wall_s=wall, values=values)
            if ref is None:
                ref = values
            else:
                row["equal"] = "yes, bit for bit" if values == ref else f"no: max |diff| {max(abs(a - b) for a, b in zip(values, ref)):.2e}"
            rows.append(row)
    return rows
