"""The rules an RL setup must satisfy that need more than the config's own fields, in one place:
which settings go together with the model and the algorithm (LoRA, batch shapes) and which
algorithms suit which models and settings. (Rules among the RL section's own fields, such as
rl.ref_sync_steps needing a KL term, are `RLConfig`'s own checks, run when the config loads.)

Each rule runs where its facts are first known: an algorithm's fit to the model when the algorithm
is built (`RLAlgorithm` calls `check_algorithm_fits`), the shapes once the algorithm says how many
training rows a prompt makes (`check_rl_config`, from the RL stage's checks). What one algorithm
alone asks of the rollout sampler stays with it (`RLAlgorithm.check_sampler`).

This module sits above the config schema (it reads its sections; the schema never imports it),
below the algorithms: it names their classes' facts (`families`, `allows_kl`, `token_level`) and
imports none of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from dare_core.errors import FieldError
from dare_core.models.family import noise_of

if TYPE_CHECKING:
    from dare_core.config import DareConfig, RLConfig


KIND_NAMES = {"masked": "masked-diffusion", "block": "block-diffusion", "uniform": "uniform-noise"}


def model_kind(model) -> str:
    """What an estimator must be defined for: "masked" (LLaDA, Dream), "block" (SDAR, LLaDA2) or
    "uniform" (uniform noise, no mask token: DiffusionGemma)."""
    if noise_of(model) == "uniform":
        return "uniform"
    return "block" if model.block_size is not None else "masked"


def check_algorithm_fits(algorithm: type, rl: RLConfig, kind: str, registry: Mapping[str, type]) -> None:
    """ValueError unless RL algorithm class `algorithm` is defined for the model's kind (`model_kind`)
    and for rl's KL and entropy settings; `registry` (the RL algorithms by name) names the alternatives."""
    if kind not in algorithm.families:
        fits = sorted(n for n, c in registry.items() if kind in c.families)
        raise ValueError(f"rl.algorithm '{algorithm.name}' is not defined for {KIND_NAMES[kind]} models "
                         f"(it supports: {', '.join(sorted(algorithm.families))}; algorithms for this model: {', '.join(fits)})")
    if getattr(rl.sampler, "edit_threshold", None) is not None and algorithm.refuses_editing:
        # docs/algorithms.md#edited-rollouts
        raise ValueError(f"rl.algorithm '{algorithm.name}' cannot train on rollouts with token editing "
                         f"(rl.sampler.edit_threshold): {algorithm.refuses_editing}; leave rl.sampler.edit_threshold empty")
    if rl.kl_beta > 0 and not algorithm.allows_kl:
        raise ValueError(f"rl.algorithm '{algorithm.name}' has no KL term: set rl.kl_beta: 0")
    if getattr(rl, "entropy_coeff", 0.0) > 0 and not algorithm.token_level:
        # docs/algorithms.md#entropy-bonus: an entropy is a property of the per-token distributions p(.|z, i);
        # a sequence score (an ELBO estimate) has none, and -e^l * l of it is not an entropy
        token = sorted(n for n, c in registry.items() if c.token_level)
        raise ValueError(f"rl.entropy_coeff = {rl.entropy_coeff}: rl.algorithm '{algorithm.name}' is a sequence-level "
                         f"estimator, and the entropy bonus is defined only for token-level ones ({', '.join(token)}); "
                         f"set rl.entropy_coeff: 0")


def check_rl_config(cfg: DareConfig, rows_per_prompt: Optional[int] = None) -> None:
    """`rows_per_prompt`: training rows the algorithm makes of one prompt (`RLAlgorithm.rows_per_prompt`;
    rl.group_size unless, like d-TreeRPO's transitions, they are not the rollouts)."""
    rl = cfg.rl
    if float((cfg.model.lora or {}).get("dropout", 0.0)) > 0:
        # every algorithm compares forwards of one set of weights: the clipped ratio is 1 at the old
        # policy only if scoring is deterministic, and the proxy-gradient replay (SPG, ESPO, EBPO,
        # BGPO) recomputes its rows exactly; dropout draws a different mask each time
        raise ValueError(f"rl needs model.lora.dropout: 0 (got {cfg.model.lora['dropout']}): {rl.algorithm}'s ratios and "
                         f"replayed forwards must score the same weights identically")
    if rl.ref_sync_steps > 0 and cfg.model.lora is not None:
        # with LoRA the reference is the base model with the adapter disabled (no second copy of the
        # weights): making it the current policy would mean merging the adapter into the base, i.e.
        # changing the weights the adapter trains on, which is not a reference sync
        raise ValueError(f"rl.ref_sync_steps = {rl.ref_sync_steps} needs full fine-tuning: with model.lora the KL reference "
                         f"is the adapter-disabled base model, which cannot be synced to the policy without merging the "
                         f"adapter into it; set rl.ref_sync_steps: 0 (the reference stays the base model) or model.lora: null")
    if rl.sampler.lora_merged and cfg.launch.zero_stage == 3:
        # folding an adapter writes over whole weights, which ZeRO-3 keeps only in partitions
        raise ValueError("rl.sampler.lora_merged needs whole weights on every rank: launch.zero_stage 0, 1 or 2 "
                         "(got 3); set rl.sampler.lora_merged: false")
    per_prompt = rows_per_prompt or rl.group_size
    rollouts = rl.prompts_per_step * per_prompt
    if rl.group_size < 2:  # also a config check; kept for configs built in code
        raise ValueError("rl.group_size must be >= 2 (group advantages need a group)")
    if rollouts % rl.mini_batches:
        what = "rl.group_size" if per_prompt == rl.group_size else f"{per_prompt} rows per prompt ({rl.algorithm})"
        raise ValueError(f"rl.prompts_per_step * {what} = {rollouts} must be divisible by rl.mini_batches = {rl.mini_batches}")
    mini = rollouts // rl.mini_batches
    if rl.micro_batch_size < mini and mini % rl.micro_batch_size:
        raise ValueError(f"rl.micro_batch_size = {rl.micro_batch_size} must divide the mini-batch size {mini}")
