"""d1's own RL step (dllm-reasoning/d1, `diffu-grpo/diffu_grpo_trainer.py`), run unchanged as the
baseline of the bench's RL step.

d1's trainer module imports trl, wandb and datasets at its top, none of which one step's work
touches, so its class cannot be imported on a machine without them. This reads the file and takes
the methods of `DiffuGRPOTrainer` that a step runs, as they are written (their source, compiled
from the file with its name, so tracebacks point into it): `generate` with its helpers, the scoring
`_get_per_token_logps` with `forward_process` and `get_logits`, and `compute_loss`. They run as
methods of `D1Trainer`, which holds the trainer state they read (args, beta, epsilon,
num_iterations, the step counter). Nothing of d1 lives in this repository: the file is read from a
checkout in an ignored folder (`PEERS`), whose commit the results record.

What runs around those methods is the part of d1's `_generate_and_score_completions` that a step
needs, in its order: rollouts in chunks of `generation_batch_size` prompts, the completion mask up
to the first EOS, old log-probabilities (num_iterations > 1) and the reference's (beta > 0; the LoRA
adapter disabled, as d1's `disable_adapter()`), rewards and group-mean advantages, then per inner
iteration `compute_loss` and its backward over the per-device batches, and an optimizer step.

    python3 bench/peer_d1.py --smoke     # CPU: d1's methods on the tiny LLaDA, a step timed by phase
"""
from __future__ import annotations

import argparse
import ast
import math
import subprocess
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO / "bench" / ".peers"  # (ignored by git)
D1_FILE = "diffu-grpo/diffu_grpo_trainer.py"
D1_CLASS = "DiffuGRPOTrainer"
D1_STEP_METHODS = ("add_gumbel_noise", "generate", "forward_process", "get_logits", "get_num_transfer_tokens",
                   "_get_per_token_logps", "compute_loss")


def load_methods(path: Path, cls: str = D1_CLASS, names: tuple[str, ...] = D1_STEP_METHODS) -> dict[str, Callable]:
    """The methods `names` of class `cls` in the Python file `path`, compiled from its own source
    (none of the file's imports run) in a namespace with what their bodies name: torch, F, np, nn,
    accelerate's `set_seed`, and TRL's `profiling_decorator` (a timing wrapper: here the identity)."""
    import numpy

    tree = ast.parse(path.read_text(), filename=str(path))
    klass = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if klass is None:
        raise ValueError(f"{path}: no class {cls}")
    found = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = sorted(set(names) - {f.name for f in found})
    if missing:
        raise ValueError(f"{path}: {cls} has no {', '.join(missing)}")
    namespace = {"torch": torch, "F": torch.nn.functional, "nn": torch.nn, "np": numpy, "set_seed": _set_seed(),
                 "profiling_decorator": lambda fn: fn, "__name__": f"peer:{path.name}"}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return {n: namespace[n] for n in names}


def _set_seed() -> Callable[[int], None]:
    """accelerate's `set_seed` (what d1 imports); where accelerate is absent, the same seeding of
    Python's, NumPy's and torch's generators."""
    try:
        from accelerate.utils import set_seed
        return set_seed
    except ImportError:
        import random

        import numpy

        def set_seed(seed: int) -> None:
            random.seed(seed)
            numpy.random.seed(seed)
            torch.manual_seed(seed)
            torch.cuda.manual_seed_all(seed)
        return set_seed


def source_commit(path: Path, checkout: Path = PEERS / "d1") -> Optional[str]:
    """The git commit of the peer's checkout `checkout`, which holds `path`; None unless `checkout` is
    itself a git checkout: a copied folder there sits inside this repository (an ignored folder of it),
    and git would name this repository's commit for it."""
    def git(*args: str) -> Optional[str]:
        r = subprocess.run(["git", "-C", str(path.parent), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != checkout.resolve():
        return None
    return git("rev-parse", "HEAD")


class HFView:
    """A DARE model as d1's methods call a Hugging Face one: `model(x).logits`, `.dtype`, `.device`."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, input_ids: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.model(input_ids))


@dataclass
class D1Settings:
    """d1's training arguments that one step reads (its defaults: diffu-grpo/slurm_scripts/train.yaml)."""

    gen_length: int = 256
    block_length: int = 32
    diffusion_steps: int = 128
    temperature: float = 0.9
    generation_batch_size: int = 6
    per_device_batch: int = 6
    num_iterations: int = 2
    beta: float = 0.04
    epsilon: float = 0.5
    p_mask_prompt: float = 0.15
    lr: float = 3e-6
    random_masking: bool = True


class D1Trainer:
    """d1's step methods bound to the trainer state they read."""

    def __init__(self, methods: dict[str, Callable], s: D1Settings, mask_id: int):
        for name, fn in methods.items():
            setattr(self, name, types.MethodType(fn, self))
        self.args = types.SimpleNamespace(fp16=False, p_mask_prompt=s.p_mask_prompt, mask_id=mask_id, cfg_scale=0.0,
                                          num_iterations=s.num_iterations, remasking="low_confidence")
        self.beta, self.epsilon, self.num_iterations, self._step = s.beta, s.epsilon, s.num_iterations, 0
        self.control = types.SimpleNamespace(should_evaluate=False)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.accelerator = types.SimpleNamespace(gather_for_metrics=lambda t: t)


def d1_step(trainer: D1Trainer, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, prompts: list[list[int]],
            group: int, s: D1Settings, eos_id: int, pad_id: int, reward: Callable[[torch.Tensor], torch.Tensor],
            no_adapter: Callable) -> dict:
    """One RL step of d1 on `prompts` (token ids), `group` rollouts each; its seconds by phase and the
    mean reward. `reward` maps completion ids [N, L] to rewards [N]; `no_adapter` is a context in
    which `policy` is the reference (LoRA disabled)."""
    from dare_core.sampling.decode import left_pad
    from dare_core.timing import PhaseTimer

    view = HFView(policy)
    device = view.device
    timer = PhaseTimer(enabled=True)  # the same phase clock (GPU-synchronised boundaries) as DARE's loops
    timer.step_begin()
    timed = timer.phase

    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(group)], pad_id, device)
    with timed("rollout"), torch.no_grad():
        chunks = [trainer.generate(model=view, prompt=prompt_ids[i:i + s.generation_batch_size], steps=s.diffusion_steps,
                                   gen_length=s.gen_length, block_length=s.block_length, temperature=s.temperature,
                                   cfg_scale=0.0, remasking="low_confidence", mask_id=trainer.args.mask_id)
                  for i in range(0, len(prompt_ids), s.generation_batch_size)]
    full = torch.cat(chunks)
    completion_ids = full[:, prompt_ids.shape[1]:]
    # up to and including the first EOS (d1's completion mask)
    is_eos = completion_ids == eos_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], is_eos.shape[1], dtype=torch.long))
    completion_mask = (torch.arange(is_eos.shape[1], device=device)[None] <= first[:, None]).int()
    mu, keep = s.num_iterations, completion_ids.shape[1]
    seeds = torch.randint(0, 2**12, (mu,), device=device).tolist() if s.random_masking else [42] * mu
    micro = [slice(i, i + s.per_device_batch) for i in range(0, len(full), s.per_device_batch)]
    old, ref = [], []
    with timed("scoring"), torch.no_grad():
        for m in micro:
            expanded = full[m].unsqueeze(0).expand(mu, -1, -1)
            old.append(trainer._get_per_token_logps(view, expanded, keep, seeds) if mu > 1 else None)
            if s.beta != 0.0:
                with no_adapter():
                    ref.append(trainer._get_per_token_logps(view, expanded, keep, seeds))
    with timed("reward"):
        rewards = reward(completion_ids).float().to(device)
        advantages = rewards - rewards.view(-1, group).mean(1).repeat_interleave(group)
    policy.train()
    for it in range(mu):
        trainer._step = it  # compute_loss reads iteration `_step % num_iterations`'s seeds and scores
        with timed("forward_backward"):
            for k, m in enumerate(micro):
                inputs = {"prompt_ids": prompt_ids[m], "prompt_mask": prompt_mask[m], "completion_ids": completion_ids[m],
                          "completion_mask": completion_mask[m], "mask_seeds": seeds, "advantages": advantages[m],
                          "old_per_token_logps": old[k], "ref_per_token_logps": ref[k] if ref else None}
                (trainer.compute_loss(view, inputs) / len(micro)).backward()  # (the Trainer's accumulation scale)
        with timed("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    spread = rewards.view(-1, group).std(1)
    times = {k[len("time/"):]: v for k, v in timer.step_metrics().items() if k.startswith("time/") and "startup" not in k}
    return {**times, "reward": rewards.mean().item(),
            "zero_std_ratio": (spread == 0).float().mean().item()}


def smoke() -> int:
    """d1's methods (from PEERS' checkout) on the tiny LLaDA on the CPU: one short step, by phase."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from conftest import make_tiny_llada
    from dare_core.models.lora import LoraSettings, adapter_disabled, apply_lora

    path = PEERS / "d1" / D1_FILE
    if not path.exists():
        print(f"no d1 checkout at {path.parent.parent}: clone dllm-reasoning/d1 there", file=sys.stderr)
        return 2
    model = make_tiny_llada()
    apply_lora(model, LoraSettings(r=4, alpha=8))
    s = D1Settings(gen_length=8, block_length=4, diffusion_steps=4, generation_batch_size=3, per_device_batch=3)
    trainer = D1Trainer(load_methods(path), s, model.mask_token_id)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    out = d1_step(trainer, model, optimizer, prompts, 3, s, model.eos_token_id, model.pad_token_id,
                  lambda ids: (ids % 7 == 0).float().mean(1), lambda: adapter_disabled(model))
    print({"d1_commit": source_commit(path), **{k: round(v, 4) if isinstance(v, float) and math.isfinite(v) else v
                                                  for k, v in out.items()}})
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one short step of d1's code on the tiny LLaDA (CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    p.error("the GPU comparison runs from bench/train_step.py; --smoke checks the loading here")
    return 2


if __name__ == "__main__":
    sys.exit(main())
