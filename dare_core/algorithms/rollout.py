"""Rollouts as a training batch: G samples per prompt from the rollout engine, decoded, rewarded and
given group advantages, with the trajectory records the algorithm asked for. The default of
`RLAlgorithm.rollout`; the RL loop calls it through the algorithm."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dare_core.algorithms.common import group_advantages
from dare_core.batch import Batch
from dare_core.config import DareConfig
from dare_core.diffusion.seeding import sample_generators
from dare_core.rewards.scoring import failure_metrics, score_texts
from dare_core.sampling.decode import decode_responses
from dare_core.sampling.engines import RolloutEngine
from dare_core.sampling.trajectory import record_width
from dare_core.timing import phase


def record_level(requires: frozenset) -> str:
    """How much of the denoising trajectory the sampler must keep for an algorithm."""
    if requires & {"x0_hat", "confidence"}:
        return "full"
    return "steps" if requires & {"step_map", "decoded"} else "none"


def rollout(sampler: RolloutEngine, model, tokenizer, rows: list[dict], cfg: DareConfig, step: int,
            requires: frozenset = frozenset()) -> tuple[Batch, dict]:
    """G samples per prompt, rewarded and turned into a training batch with group advantages."""
    rl = cfg.rl
    expanded = prompt_rows_expanded(rows, rl.group_size)
    uids = [f"{r['uid']}/{g}" for r in rows for g in range(rl.group_size)]
    prompts = [tokenizer.encode(r["prompt_text"]) for r in expanded]
    device = next(model.parameters()).device
    model.eval()
    outs = []
    t0 = time.time()
    for o in range(0, len(prompts), rl.sampler.batch_size):
        gens = sample_generators((cfg.run.seed, "rollout", step), uids[o:o + rl.sampler.batch_size], device=device)
        outs.append(sampler.generate(prompts[o:o + rl.sampler.batch_size], rl.sampler, generators=gens, record=record_level(requires)))
    rollout_s = time.time() - t0
    model.train()
    with phase("reward"):
        batch, metrics = _rewarded_batch(outs, expanded, uids, tokenizer, model, rl, requires, rollout_s)
    return batch, metrics


def _rewarded_batch(outs: list, expanded: list[dict], uids: list, tokenizer, model, rl, requires: frozenset,
                    rollout_s: float) -> tuple[Batch, dict]:
    """The rollout chunks as one training batch: decoded, rewarded, with group advantages."""
    # one common prompt width so that all rollouts form one batch
    width = max(o.prompt_len for o in outs)
    seqs, attn, texts, nfe = [], [], [], 0
    for o in outs:
        pad = width - o.prompt_len
        seqs.append(torch.nn.functional.pad(o.sequences, (pad, 0), value=model.pad_token_id))
        attn.append(torch.nn.functional.pad(o.attention_mask, (pad, 0), value=0))
        texts += decode_responses(tokenizer, o)
        nfe += o.nfe
    input_ids, attention_mask = torch.cat(seqs), torch.cat(attn)
    results = score_texts(expanded, texts, rl.reward, rl.reward_args)
    rewards = torch.tensor([r.score for r in results])
    adv, adv_metrics = group_advantages(rewards, rl.group_size, rl.adv_estimator)
    response = input_ids[:, width:]
    # V: up to and including the first stop token (EOS or any of stop_token_ids), as the engine reports
    lengths = torch.cat([o.lengths.cpu() for o in outs]).to(response.device)
    valid = (torch.arange(response.shape[1], device=response.device) < lengths[:, None]) & attention_mask[:, width:].bool()
    batch = Batch(input_ids, attention_mask, width, valid, uids, adv, _records(outs, requires, model.block_size))
    steps = torch.cat([o.steps.float().cpu() for o in outs])
    metrics = {
        "rollout_steps": steps.mean().item(),
        "rollout_tokens_per_s": attention_mask[:, width:].sum().item() / max(rollout_s, 1e-9),
        "reward": rewards.mean().item(),
        "accuracy": sum(r.acc for r in results) / len(results),
        "response_tokens": valid.sum(-1).float().mean().item(),
        "extraction_failed": sum(1 for r in results if r.extra.get("extraction_failed")) / len(results),
        **failure_metrics(results),  # responses whose grading failed (a reward's error, a sandbox timeout, ...)
        "rollout_nfe": nfe,
        **adv_metrics,
    }
    return batch, metrics


def _records(outs: list, requires: frozenset, block_size: int | None = None) -> dict:
    """The trajectory records an algorithm asked for, concatenated over the rollout chunks (per-step
    records padded to the longest chunk: -1 proposals, NaN confidences). "step_map" and "decoded"
    keep a block-diffusion terminal block whole, past gen_length (`record_width`)."""
    records = {}
    cols = record_width(outs[0].response.shape[1], block_size) if outs else 0
    if "step_map" in requires:
        records["step_map"] = torch.cat([o.trajectory.response_step_map(cols) for o in outs])
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

    def rewards(self, rollout_index: list, responses: torch.Tensor) -> torch.Tensor:
        """Rewards of response ids [N, L] (cut at the first EOS) for the given rollouts' prompts."""
        eos = self.tokenizer.eos_token_id
        texts = []
        for row in responses.tolist():
            if eos in row:
                row = row[: row.index(eos)]
            texts.append(self.tokenizer.decode(row, skip_special_tokens=True))
        results = score_texts([self.rows[i] for i in rollout_index], texts, self.reward, self.reward_args)
        return torch.tensor([r.score for r in results], dtype=torch.float32)
