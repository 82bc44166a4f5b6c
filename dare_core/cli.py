"""The `dare` command.

  dare stage <name>      run one pipeline stage by hand (what each dvc.yaml stage calls)
  dare run               the whole pipeline through the Prefect flow (same as `make run`)
  dare generate          sample from a model folder
  dare eval              held-out accuracy of any model folder on a prepared eval file
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Optional

STAGES = {
    # name: (worker module, needs the distributed launcher)
    "prepare": ("dare_core.workers.prepare", False),
    "sft": ("dare_core.workers.sft", True),
    "preference": ("dare_core.workers.preference", True),
    "rl": ("dare_core.workers.rl", True),
    "convert": ("dare_core.workers.convert", False),
    "eval": ("dare_core.workers.eval", False),
}


def launch_command(module: str, launcher: str, nproc: int, worker_args: list[str]) -> list[str]:
    """The command that starts `module` on every rank."""
    if launcher == "local":
        if nproc != 1:
            raise SystemExit("error: launch.launcher 'local' runs one process; use torchrun or deepspeed for launch.nproc > 1")
        return [sys.executable, "-m", module, *worker_args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module, *worker_args]
    if launcher == "deepspeed":
        exe = shutil.which("deepspeed") or "deepspeed"
        return [exe, f"--num_gpus={nproc}", "--module", module, *worker_args]
    raise SystemExit(f"error: unknown launch.launcher '{launcher}' (local | torchrun | deepspeed)")


def cmd_stage(args: argparse.Namespace) -> int:
    module, distributed = STAGES[args.name]
    worker_args = ["--params", args.params] + [f"--set={s}" for s in args.set]
    if not distributed:
        import importlib

        return importlib.import_module(module).main(worker_args)
    from dare_core.config import ConfigError, load_config

    try:
        cfg = load_config(args.params, args.set)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cmd = launch_command(module, cfg.launch.launcher, cfg.launch.nproc, worker_args)
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return subprocess.call(cmd, env=env)


def cmd_run(args: argparse.Namespace) -> int:
    # the flow lives outside the library (dare_core never imports Prefect)
    cmd = [sys.executable, "-m", "flows.pipeline"] + (["--force"] if args.force else [])
    if args.stages:
        cmd += ["--stages", args.stages]
    return subprocess.call(cmd)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from dare_core.diffusion.seeding import generator
    from dare_core.models.registry import load_model
    from dare_core.models.tokenizer import load_tokenizer
    from dare_core.sampling.decode import decode_responses, generate

    model = load_model(args.model).eval()
    tok = load_tokenizer(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if not args.raw else args.prompt
    params = _sampling_params(args)
    with torch.no_grad():
        out = generate(model, [tok.encode(text)], params, generators=[generator(args.seed, "generate")])
    print(decode_responses(tok, out)[0])
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from dare_core.data.schema import read_rows
    from dare_core.eval.quick import evaluate
    from dare_core.models.registry import load_model
    from dare_core.models.tokenizer import load_tokenizer

    rows = read_rows(args.data, "eval")[: args.max_samples or None]
    params = _sampling_params(args)
    res = evaluate(load_model(args.model).eval(), load_tokenizer(args.model), rows, params, args.batch_size, args.seed)
    print(f"| model | accuracy | samples |\n|---|---|---|\n| {args.model} | {res['accuracy']:.3f} | {res['num_samples']} |")
    return 0


def _sampler_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    for flag, kind in (("--gen-length", int), ("--steps", int), ("--block-length", int), ("--temperature", float),
                       ("--unmasking", str), ("--threshold", float), ("--cache", str)):
        p.add_argument(flag, type=kind, default=None, help="default: the folder's generation_config.json")
    p.add_argument("--seed", type=int, default=0)
    return p


def _sampling_params(args: argparse.Namespace):
    """Sampler settings: command line first, then what the checkpoint was trained to decode with."""
    import json
    from pathlib import Path

    from dare_core.sampling.params import SamplingParams

    gen_cfg = Path(args.model) / "generation_config.json"
    saved = json.loads(gen_cfg.read_text()).get("dare_sampler", {}) if gen_cfg.exists() else {}
    keys = ("gen_length", "steps", "block_length", "temperature", "unmasking", "threshold", "cache")
    chosen = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    return SamplingParams(**{**{k: v for k, v in saved.items() if k in SamplingParams.__dataclass_fields__}, **chosen})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dare", description="DARE: post-training and evaluation of diffusion LLMs.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("stage", help="run one pipeline stage (prepare, sft, preference, rl, convert, eval)")
    s.add_argument("name", choices=list(STAGES))
    s.add_argument("--params", default="params.yaml")
    s.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    s.set_defaults(func=cmd_stage)

    r = sub.add_parser("run", help="run the whole pipeline through the Prefect flow (DVC skips unchanged stages)")
    r.add_argument("--stages", help="comma-separated subset, e.g. sft,rl")
    r.add_argument("--force", action="store_true", help="re-run stages even if DVC thinks they are up to date")
    r.set_defaults(func=cmd_run)

    g = sub.add_parser("generate", help="sample one answer from a model folder")
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _sampler_args(g).set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="held-out accuracy of a model folder on an eval parquet/jsonl file")
    e.add_argument("--data", default="data/prepared/eval.parquet")
    e.add_argument("--max-samples", type=int, default=0)
    e.add_argument("--batch-size", type=int, default=64)
    _sampler_args(e).set_defaults(func=cmd_eval)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
