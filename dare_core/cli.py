"""The `dare` command.

  dare stage <name>      run one pipeline stage by hand (what each dvc.yaml stage calls)
  dare upload <name>     copy a stage's outputs to run.artifact_root (as the stage does when it succeeds)
  dare run               the whole pipeline through the Prefect flow (same as `make run`)
  dare generate          sample from a model folder
  dare eval              OpenCompass benchmarks (or a prepared eval file) on any model folder
  dare workspaces prune  remove old workspaces of isolated flow runs (dare_core/process/workspaces.py)
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Callable, Mapping, Optional

if TYPE_CHECKING:
    from dare_core.config import DareConfig, LaunchConfig

PARAMS_FILE = "params.yaml"  # a stage's settings, at the project's root
STAGES = {
    # name: (worker module, needs the distributed launcher)
    "inputs": ("dare_core.workers.inputs", False),
    "prepare": ("dare_core.workers.prepare", False),
    "sft": ("dare_core.workers.sft", True),
    "preference": ("dare_core.workers.preference", True),
    "rl": ("dare_core.workers.rl", True),
    "convert": ("dare_core.workers.convert", False),
    "eval": ("dare_core.workers.eval", False),
}


def launch_command(module: str, launch: LaunchConfig, worker_args: list[str]) -> list[str]:
    """The command that starts `module` on every rank (`launch.nproc` per node). Under torchrun or
    the deepspeed launcher each rank runs `dare_core.workers.common`, which runs the worker and
    names the rank in the error when the worker is killed (workers/common.py `run_rank`)."""
    from dare_core.config import ConfigError

    if launch.launcher == "local":
        if launch.nproc != 1:
            raise ConfigError("launch.launcher 'local' runs one process; use torchrun or deepspeed for launch.nproc > 1")
        return [sys.executable, "-m", module, *worker_args]
    rank = ["dare_core.workers.common", module]
    if launch.launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        if launch.nnodes == 1 and launch.master_addr is None and launch.master_port is None:
            cmd.append("--standalone")  # a free port on this machine
        else:
            cmd += [f"--nnodes={launch.nnodes}", f"--node_rank={launch.node_rank}",
                    f"--master_addr={launch.master_addr or '127.0.0.1'}", f"--master_port={launch.master_port or 29500}"]
        return [*cmd, f"--nproc_per_node={launch.nproc}", "-m", *rank, *worker_args]
    if launch.launcher == "deepspeed":
        # the `deepspeed` script's own code, run by this interpreter: found without the venv on
        # PATH, and its launcher starts the ranks with sys.executable too
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
        # no hostfile: DeepSpeed's default (/job/hostfile) must not turn a one-node run into several
        cmd.append(f"--hostfile={launch.hostfile or os.devnull}")
        if launch.no_ssh:
            cmd += ["--no_ssh", f"--node_rank={_node_rank_in_hostfile(launch)}"]
        if launch.master_addr is not None:
            cmd.append(f"--master_addr={launch.master_addr}")
        if launch.master_port is not None:
            cmd.append(f"--master_port={launch.master_port}")
        return [*cmd, f"--num_gpus={launch.nproc}", "--module", *rank, *worker_args]
    raise ConfigError(f"unknown launch.launcher '{launch.launcher}' (local | torchrun | deepspeed)")


def _node_rank_in_hostfile(launch: LaunchConfig) -> int:
    """launch.node_rank, checked against the hostfile's nodes (DeepSpeed would fail with an
    assertion, or quietly run on this machine alone where the hostfile is missing)."""
    from dare_core.config import ConfigError

    try:
        lines = open(launch.hostfile, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise ConfigError(f"launch.hostfile {launch.hostfile}: {exc.strerror}") from None
    hosts = [line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not hosts:
        raise ConfigError(f"launch.hostfile {launch.hostfile} lists no nodes (lines like 'worker-1 slots=8')")
    if launch.node_rank >= len(hosts):
        raise ConfigError(f"launch.node_rank must name one of the {len(hosts)} nodes of launch.hostfile "
                          f"({launch.hostfile}): 0-{len(hosts) - 1}, got {launch.node_rank}")
    return launch.node_rank


def _config_sets(args: argparse.Namespace) -> list[str]:
    """The -S overrides of a `stage` or `upload` command, its --recipe first, so that an explicit
    -S recipe=... still wins."""
    return [f"recipe={args.recipe}", *args.set] if args.recipe else list(args.set)


def _work_in_project_root(args: argparse.Namespace) -> None:
    """Work in the project's root (env_file.project_root), as `dvc repro` runs every stage there: a
    `dare stage` typed in a subfolder would otherwise write `sub/data/prepared` and `sub/runs`. The
    command line's own paths (--params, a --recipe file) keep meaning what they meant where they were
    typed; the settings' paths start at the root, as they do under DVC."""
    from dare_core.process.env_file import enter_project_root
    from dare_core.recipes import names_a_file

    recipe_file = args.recipe if args.recipe and names_a_file(args.recipe) else None
    root, (args.params, recipe_file) = enter_project_root([args.params, recipe_file])
    args.recipe = recipe_file or args.recipe
    if root is not None:
        print(f"dare {args.command}: working in the project root {root}, where dvc repro runs the stages "
              f"(relative paths in the settings start there)", flush=True)
    args.params = args.params or PARAMS_FILE


def cmd_stage(args: argparse.Namespace) -> int:
    """Run the stage; its last line says how long it took, so a `dvc repro` log shows each stage's
    wall time where it ends (a failure ends with its error line instead)."""
    import time

    started = time.monotonic()
    code = _run_stage(args)
    if code == 0:
        print(f"dare stage {args.name}: done in {_duration(time.monotonic() - started)}", flush=True)
    return code


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min {rest:02d} s"


def _run_stage(args: argparse.Namespace) -> int:
    from dare_core.process.env_file import apply_env_defaults

    _work_in_project_root(args)
    # what the Makefile exports, for a stage not started by make (a deployment's worker, `dvc repro`):
    # DeepSpeed's ops built once into the project's .cache/torch_extensions, Hugging Face offline, ...
    apply_env_defaults(os.environ)
    module, distributed = STAGES[args.name]
    args.set = _config_sets(args)
    worker_args = ["--params", args.params] + [f"--set={s}" for s in args.set]
    if args.debug:
        worker_args.append("--debug")
    if args.restart != "never":
        worker_args.append("--restart" if args.restart == "always" else "--restart-if-changed")
    from dare_core.config import load_config

    if not distributed:
        import importlib

        from dare_core.process.lifeline import watch_parent

        watch_parent()  # killing dvc (or whatever started this) ends the stage
        code = importlib.import_module(module).main(worker_args)
        return code or _publish(args.name, load_config(args.params, args.set))
    cfg = load_config(args.params, args.set)
    cmd = launch_command(module, cfg.launch, worker_args)
    what = "the worker" if cfg.launch.launcher == "local" else f"the {cfg.launch.launcher} launcher"
    return _launch(cmd, launch_env(cfg.launch, os.environ), what) or _publish(args.name, cfg)


def _launch(cmd: list[str], env: dict, what: str = "the worker") -> int:
    """Run the launcher (or the one worker) to its end; its exit code. It ends with this process,
    and this process with its parent (process/lifeline.py); the watch starts after the fork (a
    preexec_fn is only safe while no other thread runs). Killed by a signal, it printed nothing
    about it: this names the signal in an `error:` line and exits as a shell would, 128 + N
    (`sys.exit(-9)` would end this process with 247, which reads as an ordinary exit code)."""
    from dare_core.process.exits import killed_by, signal_of
    from dare_core.process.lifeline import dies_with_parent, watch_parent

    launcher = subprocess.Popen(cmd, env=env, preexec_fn=dies_with_parent())
    watch_parent()
    try:
        code = launcher.wait()
    except BaseException:  # as subprocess.call does (Ctrl-C): the launcher goes too
        launcher.kill()
        launcher.wait()
        raise
    if code >= 0:
        return code
    died = signal_of(code)
    how = killed_by(died) if died else f"killed by signal {-code}"
    print(f"error: {what} (pid {launcher.pid}) was {how}", file=sys.stderr, flush=True)
    return 128 - code


def launch_env(launch: LaunchConfig, environ: Mapping[str, str]) -> dict:
    """`environ` for the launcher and its ranks (what the user set wins)."""
    from dare_core.process.threads import launcher_env

    # each rank starts with its share of the cores (torchrun would otherwise give every rank one)
    env = launcher_env(launch.threads, launch.nproc, environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # when a collective times out, NCCL's watchdog waits for the flight recorder's debug dump
    # before it ends the process: 60 s with torch 2.11's default, 40 s with this set to 10000
    # (seen on H100s, the dump never written). With 2500, a rank that hangs ends the job about
    # 10 s after launch.timeout_s.
    env.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "2500")
    # the ranks find this interpreter's tools (ninja, for the ops DeepSpeed builds on first use) as
    # in an activated venv, also when `.venv/bin/dare` was run without activating it
    tools = os.path.dirname(sys.executable)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    if tools not in path:
        env["PATH"] = os.pathsep.join([tools, *path])
    return env


def _publish(stage: str, cfg: DareConfig, missing_only: bool = False) -> int:
    """Once a stage has succeeded: copy its outputs to run.artifact_root, if set (training
    checkpoints went up as they were saved; dare_core/artifacts.py). Here, in the one process that
    started the stage, not in its ranks; with torchrun on several nodes, on the first node only."""
    if cfg.run.artifact_root and cfg.launch.node_rank == 0:
        from dare_core.artifacts import publish_stage

        publish_stage(cfg, stage, missing_only)
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    """What a stage does after it succeeded, without running it: for a stage DVC restored from its
    cache (it never ran `dare stage`), or outputs made before run.artifact_root was set."""
    from pathlib import Path

    from dare_core.artifacts import stage_outputs
    from dare_core.config import load_config
    from dare_core.errors import UserError

    _work_in_project_root(args)
    cfg = load_config(args.params, _config_sets(args))
    if not cfg.run.artifact_root:
        raise UserError(f"{args.params}: run.artifact_root is not set, so there is nowhere to upload to "
                        f"(set it to s3://bucket/prefix or a folder)")
    if cfg.launch.node_rank != 0:
        raise UserError(f"launch.node_rank is {cfg.launch.node_rank}: the first node (node_rank 0) uploads a stage's outputs")
    outputs = stage_outputs(cfg, args.name)
    if not any(Path(p).exists() for p in outputs):
        raise UserError(f"stage {args.name} has no outputs here ({', '.join(map(str, outputs))}): "
                        f"run it first (dvc repro {args.name})")
    return _publish(args.name, cfg, args.missing)


def upload_argv(stage_cmd: str) -> Optional[list[str]]:
    """The `dare` arguments that copy what the command `stage_cmd` (a dvc.yaml stage's cmd, `dare
    stage <name> ...`) writes: `upload <name>` with its params file, -S keys and recipe. None when
    `stage_cmd` is not such a command."""
    import contextlib
    import io
    import shlex

    try:
        tokens = shlex.split(stage_cmd)
    except ValueError:
        return None
    if len(tokens) < 3 or os.path.basename(tokens[0]) != "dare" or tokens[1] != "stage":
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text: not ours to show
            args = build_parser().parse_args(tokens[1:])
    except SystemExit:
        return None
    return ["upload", args.name, "--params", args.params or PARAMS_FILE, *(f"--set={s}" for s in _config_sets(args))]


def cmd_run(args: argparse.Namespace) -> int:
    # the flow lives outside the library (dare_core never imports Prefect)
    cmd = [sys.executable, "-m", "flows.pipeline"] + (["--force"] if args.force else [])
    if args.stages:
        cmd += ["--stages", args.stages]
    return subprocess.call(cmd)


def cmd_server(args: argparse.Namespace) -> int:
    """`prefect server start ARGS` with dare.env filled in (it reads none of it itself, so a server
    started bare sent Prefect its telemetry): flows/server.py, which also keeps the server's one
    outbound call without a setting local. The server keeps its database where Prefect does
    (PREFECT_HOME, default ~/.prefect), not in the project's .cache, which `make clean` deletes."""
    from dare_core.process.env_file import apply_env_defaults, find_env_file

    env = apply_env_defaults(dict(os.environ), skip=("PREFECT_HOME",))
    project = find_env_file()
    if project is not None:  # flows/ is the project's, also when started from a subfolder
        env["PYTHONPATH"] = os.pathsep.join([str(project.parent), *filter(None, [env.get("PYTHONPATH")])])
    # (replaced, not a child: a service manager's signals reach the server itself)
    os.execve(sys.executable, [sys.executable, "-m", "flows.server", *args.prefect_args], env)


def cmd_generate(args: argparse.Namespace) -> int:
    from dare_core.errors import UserError
    from dare_core.eval.lm import EvalModel

    if not args.prompt.strip():
        raise UserError("--prompt is empty; give the text to continue")
    # sampler settings: the command line over what the checkpoint was trained to decode with; the
    # folder and the settings are checked before any weight is read
    # (over the family's defaults, as `dare eval` takes them: a DiffusionGemma folder decodes with its rule)
    lm = EvalModel(args.model, sampler=_sampler_overrides(args), seed=args.seed, family_defaults=True)
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    print(lm.generate([prompt])[0])
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """OpenCompass on any checkpoint folder(s): the same path as the pipeline's eval stage. Every
    input is checked before OpenCompass starts; the run folder appears complete or not at all."""
    import time
    from pathlib import Path

    from dare_core.eval.configs import get_benchmark, parse_benchmarks
    from dare_core.eval.labels import checkpoint_labels
    from dare_core.eval.report import results_table
    from dare_core.eval.runner import benchmark_specs, evaluate_folders

    _at_least(args, 1, "--batch-size", "--ll-mc-num")
    _at_least(args, 0, "--shots", "--max-samples")
    names = parse_benchmarks(args.benchmarks or "task")  # an unknown name lists the known ones
    overrides = _sampler_overrides(args)
    bench_args, notes = {}, []
    for name in names:
        mode = args.mode
        if mode not in get_benchmark(name).modes:
            notes.append(f"note: {name} has no '{mode}' mode; it ran as gen")
            mode = "gen"
        bench_args[name] = {"mode": mode, "shots": args.shots, **({"sampler": overrides} if overrides else {})}
    models = checkpoint_labels(args.model, args.name, _project_config(args.params))
    specs = benchmark_specs(names, Path(args.data), bench_args, args.max_samples)
    options = {"seed": args.seed, "chat": not args.no_chat, "ll_mc_num": args.ll_mc_num}
    run_dir = Path(args.work_dir) / time.strftime("%Y%m%d_%H%M%S")
    results = evaluate_folders(models, specs, run_dir.parent, options, args.batch_size, run_name=run_dir.name)
    for note in notes:  # after the run: stderr holds only the error line when a check fails
        print(note, file=sys.stderr)
    print(results_table(results))
    print(f"\npredictions and OpenCompass summary: {run_dir}")
    return 0


def cmd_workspaces_prune(args: argparse.Namespace) -> int:
    from dare_core.process.workspaces import DEFAULT_KEEP, keep_setting, prune

    keep = args.keep if args.keep is not None else keep_setting() or DEFAULT_KEEP  # ('off' is for the automatic prune)
    prune(args.repo, keep, args.failed_for, dry_run=args.dry_run)
    return 0


def _project_config(params: Optional[str]) -> DareConfig:
    """The config whose run layout tells `dare eval` which folders are stage outputs. An explicit
    --params must load; the default params.yaml only where it does: `dare eval` also runs outside a
    project, or in one whose params.yaml is being edited, and labels are not worth failing for."""
    from dare_core.config import DareConfig, load_config

    if params is not None:
        return load_config(params)
    try:
        return load_config("params.yaml")
    except (ValueError, OSError):  # missing, unreadable or invalid
        return DareConfig()


def _at_least(args: argparse.Namespace, minimum: int, *flags: str) -> None:
    from dare_core.errors import UserError

    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < minimum:
            raise UserError(f"{flag} must be >= {minimum}, got {value}")


SAMPLER_FLAGS = (("--gen-length", int), ("--steps", int), ("--block-length", int), ("--temperature", float),
                 ("--unmasking", str), ("--threshold", float), ("--cache", str), ("--edit-threshold", float),
                 ("--post-edit-steps", int), ("--editing", str))


def _sampler_overrides(args: argparse.Namespace) -> dict:
    import math

    from dare_core.errors import UserError

    out = {f[2:].replace("-", "_"): getattr(args, f[2:].replace("-", "_")) for f, _ in SAMPLER_FLAGS
           if getattr(args, f[2:].replace("-", "_")) is not None}
    for flag, kind in SAMPLER_FLAGS:
        value = out.get(flag[2:].replace("-", "_"))
        if kind is float and value is not None and not math.isfinite(value):  # argparse's float() takes "nan"
            raise UserError(f"{flag} must be a finite number, got {value}")
    return out


def _sampler_args(p: argparse.ArgumentParser, many: bool = False) -> argparse.ArgumentParser:
    if many:
        p.add_argument("--model", required=True, action="append", help="a Hugging Face model folder (repeat for several)")
    else:
        p.add_argument("--model", required=True, help="a Hugging Face model folder")
    for flag, kind in SAMPLER_FLAGS:
        p.add_argument(flag, type=kind, default=None, help="default: the benchmark's, else the folder's generation_config.json")
    p.add_argument("--seed", type=int, default=0)
    return p


def _config_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A stage's name and the config it reads (`stage` and `upload` read the same one)."""
    p.add_argument("name", choices=list(STAGES))
    p.add_argument("--params", default=None, help=f"the settings file (default: the project's {PARAMS_FILE})")
    p.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--recipe", metavar="NAME", help="apply a paper recipe (configs/recipes/NAME.yaml, or a path) over "
                                                  "--params; -S still overrides it (same as -S recipe=NAME)")
    return p


DEBUG_HELP = "on an error, print the full traceback as well as the one-line message"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dare", description="DARE: post-training and evaluation of diffusion LLMs.")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # `dare <command> --debug` too; SUPPRESS keeps a subcommand from resetting `dare --debug`
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    sub_parser = functools.partial(sub.add_parser, parents=[debug])

    s = _config_args(sub_parser("stage", help="run one pipeline stage (prepare, sft, preference, rl, convert, eval)"))
    restart = s.add_mutually_exclusive_group()
    restart.add_argument("--restart", dest="restart", action="store_const", const="always", default="never",
                         help="train from the start: the stage's checkpoints are set aside (into <stage>/superseded, "
                              "once every check has passed)")
    restart.add_argument("--restart-if-changed", dest="restart", action="store_const", const="if_changed",
                         help="resume checkpoints made with these settings; set other ones aside and start fresh "
                              "(what the DVC pipeline does)")
    s.set_defaults(func=cmd_stage)

    u = _config_args(sub_parser("upload", help="copy a stage's outputs to run.artifact_root, as the stage does when it "
                                                "succeeds (for outputs DVC restored from its cache, or made before "
                                                "artifact_root was set)"))
    u.add_argument("--missing", action="store_true",
                   help="send only the files whose copy is missing or has another size (and checkpoints not there yet)")
    u.set_defaults(func=cmd_upload)

    r = sub_parser("run", help="run the whole pipeline through the Prefect flow (DVC skips unchanged stages)")
    r.add_argument("--stages", help="comma-separated subset, e.g. sft,rl")
    r.add_argument("--force", action="store_true", help="re-run stages even if DVC thinks they are up to date")
    r.set_defaults(func=cmd_run)

    # every option goes to `prefect server start` (main passes what argparse does not know)
    sub.add_parser("server", add_help=False, help="Prefect's server with dare.env (no telemetry, nothing fetched from "
                   "the internet): `dare server --host 127.0.0.1 --port 4200`; `dare server --help` for its options"
                   ).set_defaults(func=cmd_server)

    g = sub_parser("generate", help="sample one answer from a model folder")
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _sampler_args(g).set_defaults(func=cmd_generate)

    e = sub_parser("eval", help="evaluate model folders on benchmarks through OpenCompass (a table per benchmark)")
    e.add_argument("--benchmarks", default=None,
                   help="comma-separated: mmlu, mmlu_pro, hellaswag, arc_c, gsm8k, math, gpqa, aime24, aime25, olympiadbench, "
                        "humaneval, mbpp, or task (a prepared eval file; the default)")
    e.add_argument("--data", default="data/prepared/eval.parquet",
                   help="the folder holding the benchmarks' files in their public layouts (for task: the eval file)")
    e.add_argument("--mode", default="gen", choices=["gen", "ll"], help="ll: multiple choice by ELBO log-likelihood")
    e.add_argument("--shots", type=int, default=0, help="few-shot examples from each benchmark's dev/train split")
    e.add_argument("--max-samples", type=int, default=0, help="items per benchmark (0: all)")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--ll-mc-num", type=int, default=32, help="Monte-Carlo rows per option in ll mode")
    e.add_argument("--no-chat", action="store_true", help="do not apply the chat template (base models)")
    e.add_argument("--work-dir", default="runs/dare-eval", help="where the OpenCompass run is written")
    e.add_argument("--name", action="append", default=None,
                   help="the table's label for each --model, in order (default: the DARE stage that wrote the "
                        "folder, e.g. sft or rl, else the folder's name)")
    e.add_argument("--params", default=None,
                   help="the project config whose runs_dir/models_dir locate stage outputs (default: params.yaml if it loads)")
    _sampler_args(e, many=True).set_defaults(func=cmd_eval)
    _workspaces_parser(sub_parser)
    return p


def _workspaces_parser(sub_parser: Callable[..., argparse.ArgumentParser]) -> None:
    from dare_core.process.workspaces import DEFAULT_FAILED_FOR_H, DEFAULT_KEEP, KEEP_ENV

    w = sub_parser("workspaces", help="the git worktrees of isolated flow runs (.cache/workspaces)")
    prune = w.add_subparsers(dest="action", required=True).add_parser(
        "prune", help="remove old workspaces: never one in use; keep the newest N, and failed runs' for a while")
    prune.add_argument("--keep", type=int, default=None, metavar="N",
                       help=f"keep the newest N ended workspaces (default: ${KEEP_ENV}, else {DEFAULT_KEEP})")
    prune.add_argument("--failed-for", type=float, default=DEFAULT_FAILED_FOR_H, metavar="HOURS",
                       help=f"keep a failed run's workspace this long after it ended (default: {DEFAULT_FAILED_FOR_H:g})")
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    prune.add_argument("--repo", default=".", help="the project's checkout, or one of its workspaces (default: .)")
    prune.set_defaults(func=cmd_workspaces_prune)


def main(argv: Optional[list[str]] = None) -> int:
    from dare_core.workers.common import run_reporting_errors

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.func is cmd_server:
        args.prefect_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # expected failures (bad input, missing files, a full disk): one `error:` line, exit 2 or 1
    return run_reporting_errors(lambda: args.func(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
