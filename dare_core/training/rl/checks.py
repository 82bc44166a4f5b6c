"""The RL stage's own checks, before it writes anything or starts DeepSpeed (`check_rl`), and the
plan they leave for the loop (training/rl/loop.py); its checkpoints and outputs are checked by the
`plan` step of training/stage.py, from what `check_rl` declares."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.registry import build_algorithm
from dare_core.algorithms.rollout import record_level
from dare_core.config import ConfigError, DareConfig
from dare_core.data.schema import DataError, check_ground_truths, read_rows, table_row
from dare_core.inputs import reward_inputs
from dare_core.models.hf_folder import inspect_model
from dare_core.models.lm import DiffusionLM
from dare_core.rl_rules import check_rl_config
from dare_core.rl_schedules import RL_SCHEDULES
from dare_core.sampling.cache import check_cache_fits
from dare_core.sampling.engines import check_engine
from dare_core.training import engine as eng
from dare_core.training.export_choice import protected_tags
from dare_core.training.parallel import check_sequence_parallel
from dare_core.training.rl.validation import RLValidator, check_validation_config, validation_params
from dare_core.training.setup import prepare_for_training, stage_tokenizer
from dare_core.training.stage import CheckpointFacts


def rl_start_folder(cfg: DareConfig) -> Path:
    """RL starts from the SFT stage's exported model."""
    return cfg.stage_dir("sft") / "model"


# rl.validate_*: validation neither draws from the training randomness nor changes the weights, so
# changing them resumes the run (left out of the fingerprint, like the keys of COSMETIC_KEYS)
VALIDATION_KEYS = ("validate_every", "validate_k", "validate_prompts", "validate_temperature")


@dataclass
class RLPlan:
    """What `check_rl` read and decided, before anything is written."""

    rows: list
    validator: RLValidator
    tokenizer: object
    algo: RLAlgorithm
    checkpoints: CheckpointFacts


def _check_sampler(cfg: DareConfig, spec) -> None:
    """The rollout cache must suit the start model's family (block diffusion or not)."""
    try:
        check_cache_fits(cfg.rl.sampler, spec.block_size is not None)
    except ValueError as exc:
        raise ConfigError(f"rl.sampler.cache: {exc} (the model in {rl_start_folder(cfg)} is {spec.family.model_type})") from None


def _check_engine(cfg: DareConfig, spec, record: str) -> None:
    """The rollout engine decodes this model with the rollouts' and the validations' settings (an
    external engine refuses what it cannot honour exactly; better now than after the model loads)."""
    rl = cfg.rl
    validating = [("rl.validate_temperature", validation_params(rl))] if rl.validate_every > 0 else []
    for what, params in [("rl.sampler", rl.sampler)] + validating:
        try:
            check_engine(rl.sampler.engine, spec, params, record if what == "rl.sampler" else "none")
        except ValueError as exc:
            raise ConfigError(f"rl.sampler.engine '{rl.sampler.engine}' with {what}: {exc}") from None
        except RuntimeError as exc:  # it cannot run on this machine
            raise ConfigError(f"rl.sampler.engine '{rl.sampler.engine}': {exc}") from None


def _check_prompt_lengths(path: Path, rows: list[dict], tokenizer, gen_length: int, limit: int) -> None:
    for i, row in enumerate(rows):
        n = len(tokenizer.encode(row["prompt_text"]))
        if n + gen_length > limit:
            raise DataError(f"{table_row(path, i)}: prompt of {n} tokens + rl.sampler.gen_length {gen_length} "
                            f"exceeds the model maximum {limit}")


def check_rl_settings(cfg: DareConfig, spec: DiffusionLM) -> RLAlgorithm:
    """The checks of the RL settings against the model (`spec`, weightless): sampler and engine,
    the algorithm's options and batch shapes, the ranks, validation; no data read. Returns the
    algorithm (it keeps the model's token ids and block size only: the loaded model's are the same)."""
    _check_sampler(cfg, spec)
    algo = build_algorithm(cfg.rl, spec)
    _check_engine(cfg, spec, record_level(algo.requires))
    check_rl_config(cfg, algo.rows_per_prompt)
    check_rl_ranks(cfg, algo.rows_per_prompt)
    check_sequence_parallel(cfg.launch, spec, algo)
    check_validation_config(cfg.rl)
    return algo


def check_rl(cfg: DareConfig) -> RLPlan:
    """The RL stage's own checks, before it writes anything or starts DeepSpeed: the config, the
    SFT model (its config only) and the sampler's fit to its family, the algorithm's options and
    batch shapes, the prompts and their ground truths (train and val)."""
    rl = cfg.rl
    out_dir = cfg.stage_dir("rl")
    start_folder = rl_start_folder(cfg)
    if not (start_folder / "config.json").is_file():
        raise FileNotFoundError(f"{start_folder}: no SFT model to start from (run the sft stage first)")
    spec = prepare_for_training(inspect_model(start_folder), cfg)
    algo = check_rl_settings(cfg, spec)

    data_path = Path(cfg.data.prepared_dir) / "rl.parquet"
    rows = read_rows(data_path, "rl")
    if not rows:
        raise DataError(f"{data_path}: no prompts to train on")
    check_ground_truths(rows, rl.reward, str(data_path), rl.reward_args)
    # reads the val split now: a missing one fails before the model loads
    validator = RLValidator(cfg, out_dir)
    check_ground_truths(validator.rows, rl.reward, str(Path(cfg.data.prepared_dir) / "val.parquet"), rl.reward_args)
    tokenizer = stage_tokenizer(cfg)
    _check_prompt_lengths(data_path, rows, tokenizer, rl.sampler.gen_length, spec.max_sequence_length)

    # rl.schedule is recorded where its record says (on_policy's is not: checkpoints made before
    # the key existed, all on-policy, still resume)
    # reward_errors_allowed only decides whether a failing reward stops the run: a run stopped by it
    # resumes under a looser share
    # export and export_metric choose what convert reads, never what is trained
    unrecorded = VALIDATION_KEYS + ("reward_errors_allowed", "export", "export_metric") + (
        () if RL_SCHEDULES.lookup(rl.schedule).in_fingerprint else ("schedule",))
    # a user reward's sources are inputs: checkpoints trained under another version of it are another run's
    inputs = {"data file": data_path, "start model": start_folder, **reward_inputs(rl.reward)}
    return RLPlan(rows, validator, tokenizer, algo,
                  CheckpointFacts(spec, inputs, unrecorded, protect=_best_validated(rl, validator)))


def _best_validated(rl, validator: RLValidator):
    """What pruning keeps for `rl.export: best`: the best validated checkpoint (training/export_choice.py)."""
    if rl.export != "best":
        return None
    return lambda tags: protected_tags(validator.history, rl.export_metric, tags)


def check_rl_ranks(cfg: DareConfig, rows_per_prompt: int) -> None:
    """Each rank walks its own share of every mini-batch, so the shares must be whole."""
    rl = cfg.rl
    mini = rl.prompts_per_step * rows_per_prompt // rl.mini_batches
    ranks = eng.planned_data_ranks(cfg.launch)
    if rl.prompts_per_step % ranks or mini % ranks:
        what = f"{ranks} ranks" if cfg.launch.sequence_parallel == 1 else f"{ranks} sequence-parallel groups"
        raise ValueError(f"rl.prompts_per_step = {rl.prompts_per_step} (mini-batch {mini}) must be divisible by the {what}")
    # validation runs on every rank (each its share of the val prompts, padded to one length: the
    # same sampling calls everywhere), so ZeRO-3's collective forwards are no obstacle to it
