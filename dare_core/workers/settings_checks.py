"""Every check of the stages' settings, made by the inputs stage, the first one `dvc repro` runs.

A stage checks everything before it writes, but under DVC a setting that only a later stage reads
(a `model.init` typo, an RL option that does not fit the model) was found one stage or more into
the run, and a refused prepare had already lost its outputs (DVC removes them before it runs the
stage). So the inputs stage makes, before any other stage runs:

- prepare's checks, as a dry run that writes nothing (`check_prepare`), unless the prepared data on
  disk was made from the same settings and inputs (data/made_from.py): then prepare would pass again;
- the settings checks of sft, preference, rl and eval against the model the pipeline will train, as
  a weightless (meta-device) model built from `model.init` or `model.path`'s config.json: the
  same functions those stages call. Nothing here reads a dataset beyond prepare's dry run or a
  model's weights; what depends on the prepared rows (their lengths, ground truths), on earlier
  stages' outputs or on checkpoints stays with the stage that reads them.
"""
from __future__ import annotations

from typing import Optional

from dare_core.config import ConfigError, DareConfig
from dare_core.data.lengths import resolve as resolve_lengths
from dare_core.data.made_from import made_from, prepared_summary
from dare_core.data.prepare import check_prepare
from dare_core.eval.runner import benchmark_settings
from dare_core.models.tokenizer import char_tokenizer
from dare_core.training.preference_loop import check_preference_settings
from dare_core.training.rl.checks import check_rl_settings
from dare_core.training.setup import initial_spec
from dare_core.training.sft_loop import check_sft_settings


def prepare_would_pass(cfg: DareConfig, inputs: Optional[dict] = None) -> dict:
    """The summary prepare writes, or wrote, for these settings and inputs (`inputs`: their
    identities, inputs.identities): the one on disk where it was made from them, else that of a
    dry run of prepare, which raises what prepare would refuse."""
    summary = prepared_summary(cfg)
    if summary is not None and summary.get("made_from") == made_from(cfg, inputs):
        return summary
    return check_prepare(cfg).summary


def _preference_runs(cfg: DareConfig, summary: dict) -> bool:
    """Whether the preference stage will train (`auto` runs it only when prepare made pairs)."""
    enabled = cfg.preference.enabled
    return enabled is True or (enabled == "auto" and bool((summary.get("counts") or {}).get("preference")))


def check_stage_settings(cfg: DareConfig, summary: dict) -> None:
    """The settings checks of the training and eval stages (module docstring); `summary`: the
    prepared data's, for the lengths prepare derives (`auto`)."""
    cfg = resolve_lengths(cfg, summary)
    # a from-scratch model's tokenizer is the one prepare makes; a model folder's own is not needed here
    spec = initial_spec(cfg, char_tokenizer())
    check_sft_settings(cfg, spec)
    if _preference_runs(cfg, summary):
        check_preference_settings(cfg, spec)
    check_rl_settings(cfg, spec)  # RL starts from the SFT model: the same shapes and family
    try:
        benchmark_settings(cfg.eval.benchmarks, cfg.eval.benchmark_args, cfg.eval.max_samples or 0)
    except ValueError as exc:  # (its words are `dare eval`'s too, which names no setting)
        raise ConfigError(f"eval.benchmarks / eval.benchmark_args: {exc}") from None


def check_settings(cfg: DareConfig, inputs: Optional[dict] = None) -> None:
    """Every check the inputs stage makes for the stages after it (module docstring)."""
    check_stage_settings(cfg, prepare_would_pass(cfg, inputs))
