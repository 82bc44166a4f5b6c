"""Rollouts as a training batch: G samples per prompt from the rollout engine, decoded, rewarded and
given group advantages, with the trajectory records the algorithm asked for. The default of
`RLAlgorithm.rollout`; the RL loop calls it through the algorithm."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from dare_core.algorithms.common import group_advantages
from dare_core.batch import Batch
from dare_core.config import RLConfig, SamplerConfig
from dare_core.diffusion.block import through_stop_block
from dare_core.rewards.grading import grade
from dare_core.sampling.completions import Completions, DecodeShare, generate
from dare_core.sampling.decode import response_texts
from dare_core.sampling.rollout_engine import RolloutEngine
from dare_core.sampling.trajectory import record_width
from dare_core.timing import phase


@dataclass(frozen=True)
class RolloutSpec:
    """What one RL step's rollouts are drawn and graded with (the config's part of it)."""

    params: SamplerConfig  # rl.sampler: the decoding settings and how many prompts decode at once
    group_size: int  # rollouts per prompt
    seed: int  # run.seed
    step: int  # the RL step (the seeds name it)
    reward: str = "auto"
    reward_args: dict = field(default_factory=dict)
    errors_allowed: float = 0.0  # rl.reward_errors_allowed
    # ranks that decode the prompts together, each a share (a sequence-parallel group); None: alone
    share: Optional[DecodeShare] = None

    @classmethod
    def of(cls, rl: RLConfig, seed: int, step: int) -> "RolloutSpec":
        return cls(rl.sampler, rl.group_size, seed, step, rl.reward, rl.reward_args, rl.reward_errors_allowed)


def record_level(requires: frozenset) -> str:
    """How much of the denoising trajectory the sampler must keep for an algorithm."""
    if requires & {"x0_hat", "confidence"}:
        return "full"
    return "steps" if requires & {"step_map", "decoded"} else "none"


def rollout(engine: RolloutEngine, tokenizer, rows: list[dict], spec: RolloutSpec, adv_estimator: str,
            requires: frozenset = frozenset(), trim_after_stop: bool = False) -> tuple[Batch, dict]:
    """G samples per prompt, rewarded and turned into a training batch with group advantages.
    `trim_after_stop` (block diffusion, an objective that scores only up to the stop): the canvas
    after the stop token's block is left out of the batch's attention mask."""
    expanded = prompt_rows_expanded(rows, spec.group_size)
    uids = [f"{r['uid']}/{g}" for r in rows for g in range(spec.group_size)]
    prompts = [tokenizer.encode(r["prompt_text"]) for r in expanded]
    seeds = [(spec.seed, "rollout", spec.step, uid) for uid in uids]
    done = generate(engine, tokenizer, prompts, spec.params, seeds, spec.params.batch_size, record_level(requires), spec.share)
    with phase("reward"):
        batch, metrics = _rewarded_batch(done, expanded, uids, engine.model, spec, adv_estimator, requires, trim_after_stop)
    return batch, metrics


def _rewarded_batch(done: Completions, expanded: list[dict], uids: list, model, spec: RolloutSpec, adv_estimator: str,
                    requires: frozenset, trim_after_stop: bool) -> tuple[Batch, dict]:
    """The rollout chunks as one training batch: rewarded, with group advantages."""
    outs = done.outputs
    # one common prompt width so that all rollouts form one batch
    width = max(o.prompt_len for o in outs)
    seqs, attn = [], []
    for o in outs:
        pad = width - o.prompt_len
        seqs.append(torch.nn.functional.pad(o.sequences, (pad, 0), value=model.pad_token_id))
        attn.append(torch.nn.functional.pad(o.attention_mask, (pad, 0), value=0))
    input_ids, attention_mask = torch.cat(seqs), torch.cat(attn)
    graded = grade(expanded, done.texts, spec.reward, spec.reward_args, spec.errors_allowed)
    adv, adv_metrics = group_advantages(graded.rewards, spec.group_size, adv_estimator)
    response = input_ids[:, width:]
    # V: up to and including the first stop token (EOS or any of stop_token_ids), as the engine reports
    lengths = torch.cat([o.lengths.cpu() for o in outs]).to(response.device)
    valid = (torch.arange(response.shape[1], device=response.device) < lengths[:, None]) & attention_mask[:, width:].bool()
    canvas_tokens = attention_mask[:, width:].sum().item()
    if trim_after_stop:
        attention_mask = through_stop_block(attention_mask, width, lengths, model.block_size)
    batch = Batch(input_ids, attention_mask, width, valid, uids, adv, _records(outs, requires, model.block_size))
    steps = torch.cat([o.steps.float().cpu() for o in outs])
    metrics = {
        "rollout_steps": steps.mean().item(),
        "rollout_tokens_per_s": canvas_tokens / max(done.seconds, 1e-9),
        **graded.metrics,
        "response_tokens": valid.sum(-1).float().mean().item(),
        # what scoring and the update read per rollout (prompt + response), for their tokens/s and MFU
        "sequence_tokens": attention_mask.sum(-1).float().mean().item(),
        "rollout_nfe": done.nfe,
        # what the rollout's forwards encoded (`GenerationOutput.work`): its model FLOPs follow from them
        **{f"rollout_{k}": sum(o.work.get(k, 0) for o in outs) for k in ("encoded_tokens", "key_pairs", "logit_tokens")},
        **adv_metrics,
    }
    if any(o.edits is not None for o in outs):  # token editing: how much of what was committed the rollouts replaced
        metrics["rollout_edits"] = torch.cat([o.edits.float().cpu() for o in outs]).mean().item()
    return batch, metrics


def _records(outs: list, requires: frozenset, block_size: int | None = None) -> dict:
    """The trajectory records an algorithm asked for, concatenated over the rollout chunks (per-step
    records padded to the longest chunk: -1 proposals, NaN confidences). "step_map" and "decoded"
    keep a block-diffusion terminal block whole, past gen_length (`record_width`). With the step map
    come, where the rollout edited tokens, "edit_steps" and "edit_from" ([B, W, E], padded to the
    most edits of a position: step 0 is no edit)."""
    records = {}
    cols = record_width(outs[0].response.shape[1], block_size) if outs else 0
    if "step_map" in requires:
        records["step_map"] = torch.cat([o.trajectory.response_step_map(cols) for o in outs])
        edits = [o.trajectory.response_edits(cols) for o in outs]
        if any(steps.shape[-1] for steps, _ in edits):  # token editing: which step edited what
            e = max(steps.shape[-1] for steps, _ in edits)
            pad = lambda t: torch.nn.functional.pad(t, (0, e - t.shape[-1]))  # noqa: E731 (0: no edit)
            records["edit_steps"] = torch.cat([pad(steps) for steps, _ in edits])
            records["edit_from"] = torch.cat([pad(replaced) for _, replaced in edits])
    if "decoded" in requires:
        records["decoded"] = torch.cat([o.trajectory.response_tokens(cols) for o in outs])
    for key, fill in (("x0_hat", -1), ("confidence", float("nan"))):
        if key in requires:
            parts = [getattr(o.trajectory, key) for o in outs]
            k = max(p.shape[1] for p in parts)
            records[key] = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, k - p.shape[1]), value=fill) for p in parts])
    return records


def prompt_rows_expanded(rows: list[dict], group_size: int) -> list[dict]:
    """The prompt row of every rollout, in rollout order."""
    return [r for r in rows for _ in range(group_size)]


@dataclass
class RolloutContext:
    """What `RLAlgorithm.prepare` may use beyond the batch: rewarding other token sequences than the
    final responses (MDPO rewards every step's predicted completion)."""

    tokenizer: object
    rows: list  # the prompt row of every rollout
    reward: str
    reward_args: dict = field(default_factory=dict)  # rl.reward_args
    errors_allowed: float = 0.0  # rl.reward_errors_allowed

    def rewards(self, rollout_index: list, responses: torch.Tensor) -> torch.Tensor:
        """Rewards of response ids [N, L] (cut at the first EOS) for the given rollouts' prompts."""
        texts = response_texts(self.tokenizer, responses)
        return grade([self.rows[i] for i in rollout_index], texts, self.reward, self.reward_args, self.errors_allowed).rewards
