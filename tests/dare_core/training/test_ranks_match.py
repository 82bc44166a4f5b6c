"""Two ranks train as one does (issue 18), on the CPU (gloo) with a tiny model: SFT, preference and
RL (d1, and BGPO with several Monte-Carlo rows per sequence) run on 2 ranks under ZeRO 0, 1, 2 and 3,
through torchrun and the deepspeed launcher, with the global batch and seeds of a 1-rank run, log
that run's losses and metrics step by step and end with its weights (the last checkpoint, and the
exported model of SFT and preference).

Each (stage, ZeRO stage) pair runs once, its launcher alternating (`LAUNCHER`), so that every stage
and every ZeRO stage runs under both launchers: 16 two-rank runs against 4 one-rank references,
3 steps each (4 minutes on 2 cores, 7-8 when other work shares them). Two more SFT runs rehearse two
nodes on this machine, a `dare stage` per node (10-15 s each), and two (SFT, d1 at ZeRO-3) run 2 ranks
as one sequence-parallel group (launch.sequence_parallel: 2) that trains as the 1-rank run (10-20 s
each). The 1-rank reference walks one after the other (grad_accum 2, or two RL micro-batches) the
micro-batches that the 2 ranks walk side by side.

The optimiser is set so that the comparison sees the gradients' scale: with its default eps, AdamW's
step m / (sqrt(v) + eps) is nearly invariant to it (and so is a clipped step), so ranks that averaged
their shares of a global-denominator sum instead of summing them (half the 1-rank gradient) would
still pass; with eps = 1 and no clipping the step is about lr * the gradient (|g| << 1)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dare_core.config import load_config
from dare_core.data.prepare import prepare
from dare_core.models.hf_folder import load_model
from dare_core.training.checkpoint import checkpoint_state_dict
from ports import unused_port
from pipeline_helpers import assert_no_native_noise, dare, tiny_params, worker_env, write_params

STEPS = 3
# one-digit sums: 90 of the 100 for SFT, the RL prompts among them
DATA = {"data__task_args": {"min_digits": 1, "max_digits": 1, "ops": "+", "zero_pad": True},
        "data__num_sft": 90, "data__num_rl": 20, "data__num_eval": 4, "data__num_val": 4, "data__num_preference": 32}
# the tiny model with a wide MLP: its 3200 x 32 weights are above DeepSpeed's ZeRO-3 persistence
# threshold (1e5 elements; `test_zero3_partitions_the_mlp`), so ZeRO-3 partitions them across the
# ranks and gathers them for each forward and the export (it keeps smaller parameters whole on every
# rank: with the usual tiny model ZeRO-3 would shard only the optimiser state)
MODEL = {"model__init": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 3200,
                         "max_sequence_length": 24}}
# the SFT model RL and preference start from: a short run that has learnt to answer with a number.
# RL scores a sum within 5 of the truth as right (`numeric`, abs_tol 5), so that most groups hold
# both rewards and every step has a gradient to compare (exact sums are rare after 60 steps)
BASE_SFT = {"sft__max_steps": 60, "sft__micro_batch_size": 16, "sft__log_every": 20, "sft__save_every": 1000,
            "sft__optim": {"lr": 5e-3, "schedule": "cosine", "warmup_steps": 10}}
# see the module docstring: eps = 1 and no clipping make the update follow the gradient's scale
OPTIM = {"eps": 1.0, "max_grad_norm": 0.0}
RL = {"rl__num_steps": STEPS, "rl__prompts_per_step": 4, "rl__group_size": 4, "rl__num_iterations": 2,
      "rl__micro_batch_size": 8, "rl__save_every": STEPS, "rl__keep_last": 1, "rl__log_every": 1,
      "rl__reward": "numeric", "rl__reward_args": {"abs_tol": 5}, "rl__optim": {**OPTIM, "lr": 0.2},
      # rows stop after as many steps as their confidences take: under ZeRO-3 the ranks' rollouts
      # end apart, and decode in lockstep (dare_core/sampling/lockstep.py)
      "rl__sampler__unmasking": "threshold", "rl__sampler__threshold": 0.5}
# per stage: the settings of every run, then those of the 1-rank run alone (the same global batch:
# 2 ranks x 1 micro-batch = 1 rank x 2; RL's rl.micro_batch_size is per rank, its batch the prompts')
STAGES = {
    "sft": ({"sft__max_steps": STEPS, "sft__log_every": 1, "sft__save_every": STEPS, "sft__keep_last": 1,
             "sft__micro_batch_size": 8, "sft__optim": {**OPTIM, "lr": 0.2}},
            {"sft__grad_accum": 2}),
    "preference": ({"preference__max_steps": STEPS, "preference__log_every": 1, "preference__save_every": STEPS,
                    "preference__keep_last": 1, "preference__micro_batch_size": 4, "preference__optim": {**OPTIM, "lr": 0.5}},
                   {"preference__grad_accum": 2}),
    "d1": (RL, {}),
    # BGPO's loss is ~10x d1's here: a smaller step keeps the model answering (a gradient at every step)
    "bgpo": ({**RL, "rl__algorithm": "bgpo", "rl__algorithm_args": {"bgpo": {"mc_num": 4}}, "rl__optim": {**OPTIM, "lr": 0.03}}, {}),
}
METRICS = {"sft": ("loss",), "preference": ("loss", "reward_margin", "reward_accuracy"),
           "d1": ("loss", "reward", "accuracy"), "bgpo": ("loss", "reward", "accuracy")}
LAUNCHER = {(stage, zero): ("torchrun", "deepspeed")[(i + zero) % 2] for i, stage in enumerate(STAGES) for zero in range(4)}

# Tolerances. The 2-rank runs add the ranks' gradients in another order than the 1-rank run
# accumulates its micro-batches (gloo's all-reduce, DeepSpeed's ZeRO buckets and partitions), and
# the 1-rank RL rollouts decode 16 rows per forward where each rank decodes 8: float32 sums in
# another order, ulps apart (~1e-7 relative), which 6 updates of the RL policy amplify a little.
# Measured over the 16 runs: metrics within 1e-6 (metrics.jsonl keeps 6 decimals; most are equal),
# weights within 1.5e-6 (d1 under ZeRO-3; 7.4e-7 under ZeRO 0-2; SFT, preference and BGPO within
# 3e-8), weights that moved by up to 0.3. The bounds leave a margin of ~7x over that and are more
# than 1000x below what a wrong gradient makes (ranks that average their gradients instead of
# summing them: 0.16 on SFT's third loss, 0.025 on the weights). A sequence-parallel group (packed,
# against the padded 1-rank run: the same per-token sums, in another order): weights within 1.2e-7.
LOSS_ATOL = 1e-5
WEIGHT_ATOL = 1e-5
TIMEOUT_S = 300  # a run that hangs (a rank waiting forever in a collective) fails the test


def _run(params: Path, stage: str, nodes: int = 1) -> None:
    """`dare stage` as a user starts it: once, or on each of `nodes` nodes (launch.nnodes, or the
    hostfile's with launch.no_ssh), here all on this machine, each with its node_rank and, on a GPU
    host, a GPU of its own."""
    name = "rl" if stage in ("d1", "bgpo") else stage
    logs = [params.parent / f"{name}-node{n}.err" for n in range(nodes)]
    # a session of its own, so that a hung run can be ended: SIGTERM has the launcher (in the session;
    # torchrun starts each rank in a session of its own) stop its ranks, SIGKILL follows
    procs = []
    for n, log in enumerate(logs):
        with open(log, "w") as err:
            procs.append(subprocess.Popen(
                dare("stage", name, "--params", str(params), *(["-S", f"launch.node_rank={n}"] if n else [])),
                env={**worker_env(), **({"CUDA_VISIBLE_DEVICES": str(n)} if nodes > 1 else {})},
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
    deadline = time.time() + TIMEOUT_S
    # (a node that fails leaves the others waiting for it: they are ended with it)
    while time.time() < deadline and any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
        time.sleep(0.2)
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in running:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    codes, errs = [p.wait() for p in procs], [log.read_text() for log in logs]
    assert codes == [0] * nodes, f"dare stage {name} failed or hung:\n" + "\n".join(
        f"{log.stem}: exit {code}\n{err[-4000:]}" for log, code, err in zip(logs, codes, errs) if code)
    for err in errs:
        assert_no_native_noise(err)
    # the deepspeed launcher's ranks share a CPU allreduce workspace named by the run's port, whose
    # names DeepSpeed never removes: left behind, each run held ~68 MB a rank of /dev/shm for good
    port = load_config(params).launch.master_port
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")) if port else []
    assert not left, f"shared memory left behind: {left}"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Prepared data and a short SFT run's model, the start of the RL and preference runs."""
    root = tmp_path_factory.mktemp("base")
    params = write_params(root / "params.yaml", tiny_params(root, **DATA, **MODEL, **BASE_SFT))
    prepare(load_config(params))
    _run(params, "sft")
    return root


def _train(base: Path, dest: Path, stage: str, ranks: int, zero: int = 0, launcher: str = "local",
           nodes: int = 1, sequence_parallel: int = 1) -> Path:
    """`stage` (sft, preference, d1, bgpo) from `base`'s data (and SFT model) in `dest`, its `ranks`
    spread over `nodes` nodes (rehearsed on this machine), in sequence-parallel groups of
    `sequence_parallel` ranks (packed: its scoring streams are the real tokens)."""
    shutil.copytree(base / "data", dest / "data")
    if stage != "sft":
        shutil.copytree(base / "runs" / "t" / "sft" / "model", dest / "runs" / "t" / "sft" / "model")
    common, one_rank = STAGES[stage]
    launch = {"launch__launcher": launcher, "launch__nproc": ranks // nodes, "launch__zero_stage": zero}
    if sequence_parallel > 1:
        launch.update(launch__sequence_parallel=sequence_parallel, model__packing="on")
    if launcher == "deepspeed" or nodes > 1:  # the default port, 29500, may be taken by another run on this machine
        launch["launch__master_port"] = unused_port()
    if nodes > 1:  # as README "Several nodes" has it, with this machine as every node
        # (each node's ranks would take all the cores of "their" machine: the same one here)
        launch.update(launch__master_addr="127.0.0.1", launch__threads=1)
        if launcher == "torchrun":
            launch["launch__nnodes"] = nodes
        else:
            hostfile = dest / "hostfile"  # (no ssh: the names are never looked up)
            hostfile.write_text("".join(f"node-{n} slots={ranks // nodes}\n" for n in range(nodes)))
            launch.update(launch__hostfile=str(hostfile), launch__no_ssh=True)
    settings = {**common, **(one_rank if ranks == 1 else {}), **(SP_BATCH[stage] if sequence_parallel > 1 else {})}
    params = write_params(dest / "params.yaml", tiny_params(dest, **DATA, **MODEL, **settings, **launch))
    _run(params, stage, nodes)
    return dest


def _outcome(root: Path, stage: str) -> dict:
    """Per metric its values at steps 1..STEPS; the weights the stage started from and those of its
    last checkpoint (our names; ZeRO-3's partitions consolidated as `dare stage convert` does); the
    exported model's (SFT and preference: what the next stage reads; RL exports nothing)."""
    out = root / "runs" / "t" / ("rl" if stage in ("d1", "bgpo") else stage)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if METRICS[stage][0] in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    start = root / "runs" / "t" / ("base" if stage == "sft" else "sft/model")
    weights, meta = checkpoint_state_dict(out / "checkpoints")
    assert meta["step"] == STEPS
    exported = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        exported.update(load_file(f))
    return {"metrics": {k: [r[k] for r in rows] for k in METRICS[stage]},
            "start": {k: v.detach().float() for k, v in load_model(start, dtype=torch.float32).net.state_dict().items()},
            "weights": {k: v.float() for k, v in weights.items()}, "exported": exported}


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    """The 1-rank run of each stage, made once, when a test first needs it."""
    made: dict = {}

    def get(stage: str) -> dict:
        if stage not in made:
            made[stage] = _outcome(_train(base, tmp_path_factory.mktemp(f"ref-{stage}"), stage, 1), stage)
        return made[stage]

    return get


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    for k in a:  # e.g. a ZeRO-3 export of one rank's empty partitions
        assert a[k].shape == b[k].shape, f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# Every loop at ZeRO-0 and ZeRO-3, RL also at ZeRO-2 (d1) and ZeRO-1 (bgpo); SFT meets ZeRO-1 in
# test_two_nodes_match_one: each stage's gradient and partition handling is met at least once,
# without the full 16-run matrix (about 13 s a run on 2 cores, and CI's time is counted)
CASES = [("sft", 0), ("sft", 3), ("preference", 0), ("preference", 3),
         ("d1", 0), ("d1", 2), ("d1", 3), ("bgpo", 1), ("bgpo", 3)]


@pytest.mark.parametrize("stage,zero", CASES, ids=[f"{s}-zero{z}-{LAUNCHER[s, z]}" for s, z in CASES])
def test_two_ranks_match_one(base, reference, tmp_path, stage, zero):
    ref = reference(stage)
    t0 = time.time()
    got = _outcome(_train(base, tmp_path, stage, 2, zero, LAUNCHER[stage, zero]), stage)
    seconds = time.time() - t0
    metric_diff = max(abs(a - b) for k in ref["metrics"] for a, b in zip(got["metrics"][k], ref["metrics"][k]))
    weight_diff = _max_diff(got["weights"], ref["weights"])
    export_diff = _max_diff(got["exported"], ref["exported"]) if ref["exported"] else 0.0
    moved = _max_diff(ref["weights"], ref["start"])
    print(f"\n{stage} zero{zero} {LAUNCHER[stage, zero]}: {seconds:.1f} s; 1 rank {ref['metrics']}; max |diff|: metrics "
          f"{metric_diff:.2e}, weights {weight_diff:.2e}, export {export_diff:.2e} (weights moved up to {moved:.2e})")
    assert _max_diff(got["start"], ref["start"]) == 0  # the same start
    for k in ref["metrics"]:
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=0, abs=LOSS_ATOL), k
    assert weight_diff <= WEIGHT_ATOL and export_diff <= WEIGHT_ATOL
    # the runs trained: a gradient at every RL step (a group's rewards differ), weights that moved
    if stage in ("d1", "bgpo"):
        assert all(loss != 0 for loss in ref["metrics"]["loss"]), ref["metrics"]
    else:
        assert ref["exported"]
    assert moved > 100 * WEIGHT_ATOL


# Ulysses sequence parallelism: 2 ranks in one group hold half of every (packed) sequence each, and
# train on the one rank's global batch (one data-parallel unit); SFT at ZeRO-0 and RL (d1: old and
# reference scores, the update) at ZeRO-3, whose gathers meet the all-to-alls
SP_CASES = [("sft", 0, "torchrun"), ("d1", 3, "deepspeed")]
# the group's global batch as one micro-batch (the 1-rank run's two, the same rows): ZeRO-3 with
# gradient accumulation does not update as ZeRO-0 does, on one rank as on several, sequence
# parallelism or not (1 rank, grad_accum 2: weights 0.11 apart after a step), which is another matter
SP_BATCH = {"sft": {"sft__micro_batch_size": 16}, "d1": {"rl__micro_batch_size": 16}}


@pytest.mark.parametrize("stage,zero,launcher", SP_CASES, ids=[f"{s}-zero{z}-{la}" for s, z, la in SP_CASES])
def test_a_sequence_parallel_group_matches_one_rank(base, reference, tmp_path, stage, zero, launcher):
    ref = reference(stage)
    t0 = time.time()
    got = _outcome(_train(base, tmp_path, stage, 2, zero, launcher, sequence_parallel=2), stage)
    weight_diff = _max_diff(got["weights"], ref["weights"])
    print(f"\n{stage} sequence-parallel zero{zero} {launcher}: {time.time() - t0:.1f} s; weights {weight_diff:.2e}")
    for k in ref["metrics"]:
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=0, abs=LOSS_ATOL), k
    assert weight_diff <= WEIGHT_ATOL
    if ref["exported"]:
        assert _max_diff(got["exported"], ref["exported"]) <= WEIGHT_ATOL


@pytest.mark.parametrize("launcher,zero", [
    ("torchrun", 1),
    # (on one GPU host its launcher would give both nodes GPU 0: README "Several nodes")
    pytest.param("deepspeed", 3, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="one GPU host")),
])
def test_two_nodes_match_one(base, reference, tmp_path, launcher, zero):
    """Two nodes of one rank each, rehearsed on this machine: `dare stage sft` started once per
    node as README "Several nodes" tells (torchrun: launch.nnodes 2; the deepspeed launcher: a
    hostfile of two nodes and launch.no_ssh), each with its launch.node_rank, train as the ranks of
    one node do (`test_two_ranks_match_one`: as one rank does). ZeRO-3 puts half the weights on
    each node; its checkpoint shards meet in the shared runs/ folder."""
    ref = reference("sft")
    t0 = time.time()
    got = _outcome(_train(base, tmp_path, "sft", 2, zero, launcher, nodes=2), "sft")
    print(f"\nsft on two nodes, zero{zero} {launcher}: {time.time() - t0:.1f} s")
    for k in ref["metrics"]:
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=0, abs=LOSS_ATOL), k
    assert _max_diff(got["weights"], ref["weights"]) <= WEIGHT_ATOL
    assert _max_diff(got["exported"], ref["exported"]) <= WEIGHT_ATOL
    assert _max_diff(ref["weights"], ref["start"]) > 100 * WEIGHT_ATOL


def test_zero3_partitions_the_mlp():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    init = MODEL["model__init"]
    assert init["d_model"] * init["mlp_hidden_size"] > DeepSpeedZeroConfig().param_persistence_threshold
