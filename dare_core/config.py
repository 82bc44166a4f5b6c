"""Typed configuration tree read from params.yaml.

Every stage reads the same file; each section is a dataclass, and an unknown key anywhere is an
error that names the full key path (a typo must never silently fall back to a default).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Optional, Union

import yaml

from dare_core.errors import ConfigError, FieldError
from dare_core.output_paths import RUN_STAGES, Place, output_conflict
from dare_core.recipes import all_auto, apply_recipe
from dare_core.remote import cache_path, redact
from dare_core.rl_schedules import RL_SCHEDULES
from dare_core.sampling.params import EDITING_MODES, SamplingParams
from dare_core.storage import DuplicateKeyError, is_remote, load_yaml, read_yaml_mapping


def _at_least(section: Any, minimum: float, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        # a value of the wrong type is from_dict's to name (a section built in code may hold one)
        if isinstance(value, (int, float)) and value < minimum:
            raise FieldError(name, f"must be >= {minimum}, got {value}")


def _int_or_auto(section: Any, name: str) -> None:
    value = getattr(section, name)
    if isinstance(value, str) and value != "auto":
        raise FieldError(name, f"must be a positive integer or auto, got {value!r}")
    if isinstance(value, int) and value < 1:
        raise FieldError(name, f"must be >= 1, got {value}")


def _one_of(section: Any, name: str, allowed: Collection) -> None:
    value = getattr(section, name)
    if value not in allowed:
        raise FieldError(name, f"must be one of {list(allowed)}, got {value!r}")


# --------------------------------------------------------------------------- sections


def _local_output(section: Any, *names: str) -> None:
    """Outputs DVC tracks live on the local (or shared) file system: a URL there would become a
    folder named `s3:` in the project. Copies in object storage are what run.artifact_root is for."""
    for name in names:
        value = getattr(section, name)
        if isinstance(value, str) and "://" in value:
            raise FieldError(name, f"is a DVC output and must be a local path, got {redact(value)!r}; set "
                                   f"run.artifact_root: s3://... to copy run artifacts to object storage")


@dataclass
class RunConfig:
    name: str = "embedded"
    seed: int = 0
    runs_dir: str = "runs"
    models_dir: str = "models"
    metrics_dir: str = "metrics"
    # where copies of the run's artifacts go (dare_core/artifacts.py): an fsspec URL (s3://bucket/prefix)
    # or a folder; null = none. <artifact_root>/<name>/runs/..., models/..., metrics/...
    artifact_root: Optional[str] = None

    def __post_init__(self) -> None:
        _local_output(self, "runs_dir", "models_dir", "metrics_dir")
        if self.artifact_root is not None and not self.artifact_root.strip():
            raise FieldError("artifact_root", "is empty; give a URL (s3://bucket/prefix) or a folder, or null")


@dataclass
class DataConfig:
    task: str = "arithmetic"
    task_args: dict = field(default_factory=dict)
    # raw input instead of a synthetic task: a JSONL or parquet file with prompt, response and
    # ground_truth columns (task, uid optional); `task` above then names the built-in task whose
    # answer-format instruction and reward its rows follow (rl.reward overrides the reward)
    source: Optional[str] = None
    # the name scores are labelled by; null: the source file's stem (else the task's name). A row's
    # own `task` column wins
    task_name: Optional[str] = None
    # the user's own test / validation files (prompt, ground_truth; task, uid optional): used as they
    # are, never carved from `source`; null carves num_eval / num_val rows out of the pool
    eval_source: Optional[str] = None
    val_source: Optional[str] = None
    # preference pairs: a JSONL or parquet file with prompt/chosen/rejected columns (task, uid
    # optional), used whole; null derives up to num_preference pairs from the training problems
    # (chosen = the correct answer, rejected = the task's own demonstration error where it made
    # one, else the answer with one digit off by one)
    preference_source: Optional[str] = None
    num_sft: int = 20000
    num_rl: int = 2000
    num_eval: int = 500
    num_preference: int = 2000  # derived pairs (never on eval problems)
    # held out for in-loop RL validation (rl.validate_every): disjoint from sft, rl and eval
    num_val: int = 64
    seed: int = 1234
    prepared_dir: str = "data/prepared"
    tokenizer_dir: str = "data/tokenizer"

    def __post_init__(self) -> None:
        _at_least(self, 0, "num_sft", "num_rl", "num_eval", "num_preference", "num_val")
        _local_output(self, "prepared_dir", "tokenizer_dir")


DTYPES = ("auto", "float32", "bfloat16", "fp32", "bf16")


@dataclass
class ModelConfig:
    family: str = "llada"
    # a Hugging Face folder to start from, or a URL of one (s3://bucket/prefix: fetched into the
    # download cache, `inputs.model_folder`); null means initialise from `init` with run.seed
    path: Optional[str] = None
    init: dict = field(default_factory=dict)
    dtype: str = "auto"  # auto | float32 | bfloat16
    gradient_checkpointing: bool = False
    # LoRA adapter instead of full fine-tuning: {r, alpha, dropout, targets}; null = full weights
    lora: Optional[dict] = None
    # training forwards over the real tokens only, sequences packed back to back (no padding):
    # auto = where a packed kernel runs (GPU: varlen, FlexAttention for block diffusion), padded
    # SDPA otherwise; on = always (CPU: SDPA with a block-diagonal mask); off = padded batches
    # YAML reads a bare on / off as true / false: those mean on / off here (`on_off`)
    packing: str = field(default="auto", metadata={"on_off": True})
    # training forwards run each decoder layer through torch.compile (fused norms, RoPE, SwiGLU and
    # LoRA adds); rollouts stay eager. Costs a compile (about a minute on a GPU) at the first step
    compile: bool = False
    # logits-free scoring: every training and scoring forward turns the hidden states into
    # per-token log-probs (and entropies) this many scored tokens at a time, recomputing each
    # chunk's logits in the backward, so no [tokens, vocab] logits are ever held whole; 0 = whole
    # logits. Equal up to float rounding (docs/diffusion.md#logits-free-scoring)
    logits_chunk: int = 0

    def __post_init__(self) -> None:
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "packing", ("auto", "on", "off"))
        _at_least(self, 0, "logits_chunk")


LR_SCHEDULES = ("constant", "cosine")


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        _at_least(self, 0, "lr", "weight_decay", "warmup_steps", "min_lr_ratio", "max_grad_norm")
        _one_of(self, "schedule", LR_SCHEDULES)
        if self.eps <= 0:
            raise FieldError("eps", f"must be > 0, got {self.eps}")
        if self.min_lr_ratio > 1:
            raise FieldError("min_lr_ratio", f"must be <= 1, got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise FieldError("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")


# where ZeRO may keep what it offloads (launch.offload_*): host memory, or nowhere
OFFLOAD_DEVICES = ("none", "cpu")


@dataclass
class LaunchConfig:
    launcher: str = "local"  # local (one process) | torchrun | deepspeed
    nproc: int = 1
    zero_stage: int = 0
    # ZeRO offload, for full-parameter training that does not fit the GPUs. optimizer cpu: the fp32
    # master weights, their gradients and Adam's moments (16 bytes a parameter) live in host memory
    # and DeepSpeedCPUAdam steps them there (needs zero_stage >= 1); params cpu: ZeRO-3's partitions
    # of the weights wait in host memory between uses (zero_stage 3)
    offload_optimizer: str = "none"  # none | cpu
    offload_params: str = "none"  # none | cpu
    # what RL rollouts and validation decode on under ZeRO-3. whole: every rank gathers the whole
    # weights once a step and decodes without collectives (as fast as ZeRO 0-2, CUDA graphs allowed;
    # costs one copy of the weights in GPU memory while decoding). partitioned: each forward gathers
    # the layer it needs and the ranks decode in lockstep (for models whose weights do not fit a GPU)
    rollout_weights: str = "whole"  # whole | partitioned
    # torch CPU threads per rank: auto = (physical cores available - those other processes keep
    # busy) / local ranks (an explicit OMP_NUM_THREADS wins over auto); an int wins over both
    # (dare_core/process/threads.py)
    threads: Union[str, int] = "auto"
    # seconds a rank waits for the others (rendezvous, every collective) before it fails with an
    # error instead of hanging: must exceed the longest time one rank works alone while the others
    # wait (rank 0's checkpoint writes and exports)
    timeout_s: int = 600
    # several nodes (README "Several GPUs and nodes"); nproc is then the ranks per node.
    # deepspeed: the nodes are the hostfile's ("worker-1 slots=8" lines; null: this machine only)
    hostfile: Optional[str] = None
    # the rendezvous host and port: torchrun with nnodes > 1 needs master_addr; the deepspeed
    # launcher takes its first host's address and port 29500 when they are null
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    # torchrun: the number of nodes and this node's index (`dare stage` runs on every node)
    nnodes: int = 1
    node_rank: int = 0
    # deepspeed: start only this node's ranks (node_rank: its line in the hostfile), no ssh; run
    # `dare stage` on every node, as with torchrun
    no_ssh: bool = False
    # Ulysses sequence parallelism: groups of this many consecutive ranks of one node each hold 1/N of
    # every sequence in the training forwards, attention trading sequence slices for head slices
    # (dare_core/models/ulysses.py); a group sees one batch, the groups split the data
    # (docs/diffusion.md#sequence-parallelism). It must divide nproc and the attention and key/value
    # heads (checked when a stage starts); sequences are padded to a multiple of it
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        _one_of(self, "launcher", ("local", "torchrun", "deepspeed"))
        _one_of(self, "zero_stage", (0, 1, 2, 3))
        _one_of(self, "offload_optimizer", OFFLOAD_DEVICES)
        _one_of(self, "offload_params", OFFLOAD_DEVICES)
        _one_of(self, "rollout_weights", ("whole", "partitioned"))
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise FieldError("offload_optimizer", "needs launch.zero_stage 1, 2 or 3 (ZeRO's partitioned optimizer is what "
                                                  "moves to the CPU), got zero_stage 0")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise FieldError("offload_params", "needs launch.zero_stage 3 (only ZeRO-3 partitions the weights), got "
                                               f"zero_stage {self.zero_stage}")
        _at_least(self, 1, "nproc", "threads", "timeout_s", "nnodes", "master_port", "sequence_parallel")
        self._check_sequence_parallel()
        _at_least(self, 0, "node_rank")
        if isinstance(self.threads, str) and self.threads != "auto":
            raise FieldError("threads", f"must be 'auto' or a number of threads, got {self.threads!r}")
        if self.no_ssh and self.launcher != "deepspeed":
            raise FieldError("no_ssh", f"is the deepspeed launcher's; launch.launcher is {self.launcher!r}")
        if self.no_ssh and not (self.hostfile and self.master_addr):
            raise FieldError("hostfile" if not self.hostfile else "master_addr",
                             "must be set with launch.no_ssh (the nodes, and the first node's address that the "
                             "others reach)")
        if self.launcher == "deepspeed" and not self.no_ssh and isinstance(self.node_rank, int) and self.node_rank > 0:
            raise FieldError("node_rank", "is read by torchrun, or by the deepspeed launcher with launch.no_ssh "
                                          "(without it, the first node starts every node's ranks)")
        # (with no_ssh, node_rank is checked against the hostfile when the stage starts: cli.py)
        if (isinstance(self.node_rank, int) and isinstance(self.nnodes, int) and self.node_rank >= self.nnodes
                and not self.no_ssh):
            raise FieldError("node_rank", f"must be below launch.nnodes ({self.nnodes}), got {self.node_rank}")
        if isinstance(self.master_port, int) and self.master_port > 65535:
            raise FieldError("master_port", f"must be a TCP port (1-65535), got {self.master_port}")
        if self.hostfile is not None and self.launcher != "deepspeed":
            raise FieldError("hostfile", f"is read by the deepspeed launcher; launch.launcher is {self.launcher!r}")
        if self.nnodes > 1 and self.launcher != "torchrun":
            raise FieldError("nnodes", "is torchrun's (run `dare stage` on every node); the deepspeed launcher takes "
                                       "its nodes from launch.hostfile")
        if self.nnodes > 1 and not self.master_addr:
            raise FieldError("master_addr", "must name the first node's address for torchrun on several nodes "
                                            f"(launch.nnodes = {self.nnodes})")
        if self.launcher == "local" and (self.master_addr or self.master_port):
            raise FieldError("master_addr" if self.master_addr else "master_port",
                             "is for torchrun or the deepspeed launcher; launch.launcher is 'local'")

    def _check_sequence_parallel(self) -> None:
        n = self.sequence_parallel
        if not isinstance(n, int) or not isinstance(self.nproc, int) or n == 1:
            return
        if self.nproc % n:
            raise FieldError("sequence_parallel", f"({n}) must divide launch.nproc ({self.nproc}): a sequence-parallel "
                                                  "group is made of ranks of one node, whose all-to-alls are the fastest")


@dataclass
class SamplerConfig(SamplingParams):
    """The sampler's own settings (validated on load), how many prompts decode at once, and which
    rollout engine runs them (`native`: our loop; `lmdeploy`: block diffusion through lmdeploy)."""

    # or auto: derived from the data by the prepare stage (dare_core/data/lengths.py)
    gen_length: Union[int, str] = 8
    steps: Union[int, str] = 8
    block_length: Union[int, str] = 8
    batch_size: int = 64
    engine: str = "native"
    engine_args: dict = field(default_factory=dict)

    # what an unknown key's error says beside it (`from_dict`): a name users bring from elsewhere
    UNKNOWN_KEY_HINTS: typing.ClassVar[dict] = {
        "editing": "the editing modes name settings for `dare generate/eval --editing` and sampler layers, where the "
                   "keys beside a mode win; here write the mode's settings themselves, e.g. quality: "
                   + ", ".join(f"{k}: {v}" for k, v in EDITING_MODES["quality"].items()) + " (docs/sampling.md#token-editing)",
    }

    def __post_init__(self) -> None:
        lengths = {k: getattr(self, k) for k in ("gen_length", "block_length", "steps")}
        for key, value in lengths.items():
            _int_or_auto(self, key)
        if "auto" in lengths.values():
            # the other settings are checked now, the lengths once the data has fixed them: stand-ins
            # that satisfy every rule the explicit ones leave open
            gen = lengths["gen_length"] if lengths["gen_length"] != "auto" else (
                lengths["block_length"] if lengths["block_length"] != "auto" else 1)
            block = lengths["block_length"] if lengths["block_length"] != "auto" else gen
            steps = lengths["steps"] if lengths["steps"] != "auto" else gen
            SamplingParams(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)},
                              "gen_length": gen, "block_length": block, "steps": steps})
        else:
            super().__post_init__()
        _at_least(self, 1, "batch_size")

    def decoding_settings(self) -> dict:
        """The sampler's own settings, without how many prompts decode at once or which engine runs
        them: what an exported checkpoint stores as its generation defaults."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("batch_size", "engine", "engine_args")}


@dataclass
class SFTConfig:
    # 0: no SFT; the stage exports the starting model (model.path) unchanged as the SFT model, so RL
    # and preference start from a released checkpoint (what the paper recipes do)
    max_steps: int = 1000
    micro_batch_size: int = 64
    grad_accum: int = 1
    # response canvas: responses are right-padded with EOS to this length (the sampler's gen_length);
    # auto: the longest tokenized response + 1 EOS, derived by the prepare stage
    pad_to: Union[int, str] = 8
    loss_norm: str = "answer_length"  # answer_length | token | batch
    mask_law: str = "bernoulli"  # bernoulli (t ~ U(eps,1), LLaDA) | count (l ~ U{1..n}, bounded 1/p weights)
    # token-to-token training for token editing (LLaDA2.1, docs/diffusion.md#edit-noise): each response
    # token left unmasked is replaced, with this probability, by a random token that the model must
    # correct; 0: the masked loss alone (a model that never saw such a stream cannot edit)
    edit_noise: float = 0.0
    optim: OptimConfig = field(default_factory=OptimConfig)
    log_every: int = 10
    save_every: int = 200
    keep_last: int = 2

    def __post_init__(self) -> None:
        _at_least(self, 0, "max_steps")
        _at_least(self, 1, "micro_batch_size", "grad_accum", "log_every", "save_every", "keep_last")
        _int_or_auto(self, "pad_to")


@dataclass
class RLConfig:
    algorithm: str = "d1"
    # options per algorithm, e.g. {d1: {p_mask_prompt: 0.0}, bgpo: {mc_num: 8}}: switching
    # `algorithm` picks that algorithm's entry (defaults where it has none)
    algorithm_args: dict = field(default_factory=dict)
    # the reward: a registered name (exact_match, numeric, math, ...), a function of your own as
    # "module:function" (importable from the repository root), or "auto": each row's own `reward`
    # column, else its task's reward
    reward: str = "auto"
    # options of rl.reward, passed to it as keyword arguments, e.g. {case: false} for exact_match;
    # needs a reward named above (with "auto", a row's options come from its `reward_args` column)
    reward_args: dict = field(default_factory=dict)
    # the share of a batch's responses (a step's rollouts, a validation) on which a reward function
    # of your own may fail (raise or time out) before the stage stops with its error; each failure
    # scores 0 until then. A return that is not a finite number always stops it. (DARE's rewards
    # failing on a response, e.g. a crashing program under `code`, score 0 and never stop it.)
    reward_errors_allowed: float = 0.0
    num_steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8
    num_iterations: int = 2
    mini_batches: int = 1
    micro_batch_size: int = 128
    # on_policy: each step rolls out with the weights it then updates; one_step_off_policy: the
    # rollouts of step t+1 are drawn with the weights before step t's update (they may overlap it),
    # so the ratios compare the policy with the behaviour policy one update older
    schedule: str = "on_policy"
    adv_estimator: str = "grpo_no_std"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 3.0
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    # every ref_sync_steps RL steps the reference policy of the KL term becomes the current policy
    # (0 = never: the reference stays the SFT model). Needs kl_beta > 0 (nothing else reads the
    # reference) and full fine-tuning: with model.lora the reference is the adapter-disabled base
    # model, and syncing it would mean merging the adapter into the base (docs/algorithms.md#reference-policy)
    ref_sync_steps: int = 0
    # entropy bonus: the loss gets - entropy_coeff * (the entropy of p_theta(.|z, i) at the scored
    # tokens, aggregated like the policy term); token-level estimators only, a sequence-level one
    # (spg, bgpo, espo, ebpo) refuses a nonzero value (docs/algorithms.md#entropy-bonus). Logged as `entropy`
    entropy_coeff: float = 0.0
    # Monte-Carlo rows / trajectory steps per forward: estimators forward and backpropagate this
    # many rows at a time, so memory is flat in the number of rows (mc_num, steps, positions)
    rows_per_forward: int = 8
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(temperature=1.0))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    log_every: int = 1
    save_every: int = 20
    keep_last: int = 2
    # in-loop validation on data/prepared/val.parquet: validate_k samples per prompt, mean@k /
    # best@k / maj@k at step 0 (the SFT model), every validate_every steps and at the last step
    # (0 = off); validate_prompts: the first that many val prompts (0 = all); decoding is
    # rl.sampler's at validate_temperature (k samples need a stochastic sampler)
    validate_every: int = 0
    validate_k: int = 4
    validate_prompts: int = 0
    validate_temperature: float = 1.0
    # what the convert stage exports: the kept checkpoint whose validation scored highest on
    # export_metric@k (mean | best | maj; kept past keep_last), or the last (training/export_choice.py)
    export: str = "best"
    export_metric: str = "mean"

    def __post_init__(self) -> None:
        _one_of(self, "export", ("best", "last"))
        _one_of(self, "export_metric", ("mean", "best", "maj"))
        # rl.validate_* are checked with the stage (training/rl/validation.py check_validation_config)
        _at_least(self, 1, "num_steps", "prompts_per_step", "num_iterations", "mini_batches", "micro_batch_size",
                  "rows_per_forward", "log_every", "save_every", "keep_last")
        _at_least(self, 2, "group_size")  # group advantages need a group
        _one_of(self, "schedule", RL_SCHEDULES)  # the records of dare_core/rl_schedules.py
        _at_least(self, 0, "clip_eps_low", "clip_eps_high", "kl_beta", "ref_sync_steps", "entropy_coeff")
        if self.ref_sync_steps > 0 and self.kl_beta == 0:
            raise FieldError("ref_sync_steps", f"needs rl.kl_beta > 0 (got ref_sync_steps {self.ref_sync_steps} with "
                                               f"kl_beta 0): only the KL term reads the reference policy, so there is "
                                               f"nothing to sync; set rl.ref_sync_steps: 0 or a kl_beta")
        if self.dual_clip < 0 or 0 < self.dual_clip <= 1:
            raise FieldError("dual_clip", f"must be > 1 (or 0: off), got {self.dual_clip}")
        if not self.reward:
            raise FieldError("reward", "is empty; name a reward, a module:function, or auto")
        # "auto" may pick a different reward per row: options meant for one would be rejected by another
        if not 0.0 <= self.reward_errors_allowed <= 1.0:
            raise FieldError("reward_errors_allowed", f"must be a share in [0, 1], got {self.reward_errors_allowed}")
        if self.reward == "auto" and self.reward_args:
            raise FieldError("reward_args", f"needs rl.reward set to a reward, not auto (got {self.reward_args})")


@dataclass
class PreferenceConfig:
    """The `preference` stage (docs/algorithms.md#preference-optimisation): ELBO-DPO / VRPO on preference pairs, starting
    from the SFT model. A micro-batch holds `micro_batch_size` pairs (2x as many sequences)."""

    # auto: the stage runs when the prepared data holds pairs, else it is off (logged, outputs say so);
    # true: it must run (no pairs stops prepare); false: off
    enabled: Union[bool, str] = "auto"
    algorithm: str = "vrpo"  # vrpo (stratified, reference under the policy's masks) | elbo_dpo
    beta: float = 0.2  # the reference recipe's beta, which assumes elbo_norm: fixed
    mc_num: int = 4  # n: Monte-Carlo rows per ELBO (VRPO: n timesteps, one mask each)
    elbo_norm: str = "fixed"  # fixed: B = ELBO / pad_to (beta means the same in every batch) | none
    tail_policy: str = "mask"  # the EOS tail after the first EOS: mask (never scored) | keep
    # ablations; null takes the algorithm's own setting (vrpo: true / true, elbo_dpo: false / false)
    shared_masks: Optional[bool] = None  # the reference scores the policy's masks (antithetic)
    stratified: Optional[bool] = None  # stratified timesteps over the mc_num rows
    rows_per_forward: int = 4  # MC rows per forward: memory stays flat in mc_num
    max_steps: int = 100
    micro_batch_size: int = 16
    grad_accum: int = 1
    # response canvas, as in SFT: chosen and rejected are right-padded with EOS to this length
    # (auto: the longest of them + 1 EOS)
    pad_to: Union[int, str] = 8
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-7))
    log_every: int = 10
    save_every: int = 50
    keep_last: int = 2

    def __post_init__(self) -> None:
        _at_least(self, 1, "mc_num", "rows_per_forward", "max_steps", "micro_batch_size", "grad_accum",
                  "log_every", "save_every", "keep_last")
        _int_or_auto(self, "pad_to")
        if self.enabled not in (True, False, "auto"):
            raise FieldError("enabled", f"must be true, false or auto, got {self.enabled!r}")
        if self.beta <= 0:
            raise FieldError("beta", f"must be > 0, got {self.beta}")


EVAL_CHECKPOINTS = ("base", "sft", "preference", "rl")


@dataclass
class EvalConfig:
    """The `eval` stage: OpenCompass on the pipeline's checkpoints (docs/evaluation.md)."""

    # every benchmark's defaults (the prepared task uses them as they are; public benchmarks
    # bring their own gen_length/steps, see dare_core/eval/configs); batch_size = prompts per batch
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    max_samples: Optional[int] = None  # cap on items per benchmark (null: all)
    # names from dare_core/eval/configs: task (this pipeline's prepared eval split), mmlu, mmlu_pro,
    # hellaswag, arc_c, gsm8k, math, gpqa, aime24, aime25, olympiadbench, humaneval, mbpp
    benchmarks: list = field(default_factory=lambda: ["task"])
    # the folder holding the public benchmark files, in each benchmark's own layout (never downloaded)
    data_dir: Optional[str] = None
    # per benchmark: {mode: gen | ll, shots: N, max_samples: N, sampler: {gen_length: ..., ...}}
    benchmark_args: dict = field(default_factory=dict)
    # which of the pipeline's models to evaluate: base, sft, preference, rl
    checkpoints: list = field(default_factory=lambda: ["base", "sft", "rl"])
    chat: bool = True  # render public benchmarks' questions with the checkpoint's chat template
    ll_mc_num: int = 32  # Monte-Carlo rows per option in log-likelihood (ll) mode

    def __post_init__(self) -> None:
        unknown = [c for c in self.checkpoints if c not in EVAL_CHECKPOINTS]
        if unknown or not self.checkpoints:
            raise ValueError(f"checkpoints must be a non-empty subset of {list(EVAL_CHECKPOINTS)}, got {self.checkpoints}")
        if not self.benchmarks:
            raise ValueError("benchmarks must name at least one benchmark")
        _at_least(self, 1, "ll_mc_num")


@dataclass
class DareConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # what a training stage does with checkpoints made with other settings or inputs (a command-line
    # flag, never a params.yaml key): "never" refuses them (one line naming what changed),
    # "always" (`--restart`) starts fresh whatever they are, "if_changed" (`--restart-if-changed`,
    # the DVC pipeline's: DVC reruns a stage when its params changed) resumes matching ones and
    # starts fresh otherwise. Starting fresh sets the old checkpoints aside, once every check passed.
    restart: str = field(default="never", metadata={"cli_only": True})
    # a paper recipe applied over params.yaml (configs/recipes/<name>.yaml or a path; dare_core/recipes.py)
    recipe: Optional[str] = None
    # `auto`: every length from the data (recipes.all_auto), whatever the sections say; empty: as they say
    lengths: Optional[str] = None

    def __post_init__(self) -> None:
        if self.lengths not in (None, "auto"):
            raise FieldError("lengths", f"must be auto or empty, got {self.lengths!r}")

    # ---- derived artifact locations (one place, so stages and dvc.yaml agree)
    @property
    def run_dir(self) -> Path:
        return Path(self.run.runs_dir) / self.run.name

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    @property
    def base_model_dir(self) -> Path:
        return self.run_dir / "base"

    @property
    def final_model_dir(self) -> Path:
        return Path(self.run.models_dir) / self.run.name

    @property
    def checkpoint_dirs(self) -> dict[str, Path]:
        """The pipeline's checkpoints, in pipeline order: base (untrained or the given model; for a
        URL, where `inputs.model_folder` puts its copy), SFT, preference (the side branch), RL."""
        given = self.model.path
        return {
            "base": (cache_path(given) if is_remote(given) else Path(given)) if given else self.base_model_dir,
            "sft": self.stage_dir("sft") / "model",
            "preference": self.stage_dir("preference") / "model",
            "rl": self.final_model_dir,
        }


# --------------------------------------------------------------------------- loading

    def output_places(self) -> list[Place]:
        """Every folder a run writes (output_paths.py checks them as a set): the run folder and each
        stage's folder in it, the exported model, the metrics files, the prepared data, the tokenizer
        of a from-scratch model, and a local artifact copy."""
        run, data = self.run, self.data
        run_dir = Path(run.runs_dir) / run.name
        places = [
            Place("run.runs_dir", run_dir, "run folder", container=True),
            *(Place("run.runs_dir", run_dir / stage, f"{stage} folder") for stage in RUN_STAGES),
            Place("run.models_dir", Path(run.models_dir) / run.name, "model folder"),
            Place("run.metrics_dir", run.metrics_dir),
            Place("data.prepared_dir", data.prepared_dir),
        ]
        if not self.model.path:  # with a given model its tokenizer is used, and prepare writes none
            places.append(Place("data.tokenizer_dir", data.tokenizer_dir))
        if run.artifact_root and not is_remote(run.artifact_root):
            places.append(Place("run.artifact_root", Path(run.artifact_root) / run.name, "copy of the run"))
        return places

    def input_places(self) -> list[Place]:
        """The user's files a run reads (local ones; a URL is fetched into the download cache)."""
        given = {"data.source": self.data.source, "data.eval_source": self.data.eval_source,
                 "data.val_source": self.data.val_source, "data.preference_source": self.data.preference_source,
                 "model.path": self.model.path, "eval.data_dir": self.eval.data_dir, "launch.hostfile": self.launch.hostfile}
        return [Place(key, value) for key, value in given.items() if value and not is_remote(value)]


def _type_matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_type_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp in (tuple, list) or origin in (tuple, list):
        return isinstance(value, (list, tuple))
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _accepts_float(tp: Any) -> bool:
    return tp is float or (typing.get_origin(tp) in (Union, types.UnionType) and float in typing.get_args(tp))


def from_dict(cls: type, data: Any, where: str = "", source: str = "params.yaml") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types by full path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{where or '<root>'}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key in fields and fields[key].metadata.get("cli_only"):
            raise ConfigError(f"{source}: '{path}' is not a config key but a command-line flag (--{key})")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            if key in getattr(cls, "UNKNOWN_KEY_HINTS", {}):
                hint = f": {cls.UNKNOWN_KEY_HINTS[key]}"
            raise ConfigError(f"{source}: unknown config key '{path}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            default = fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING else tp()
            kwargs[key] = merge_into(default, value, path, source)
        else:
            if isinstance(value, bool) and fields[key].metadata.get("on_off"):
                value = "on" if value else "off"
            if isinstance(value, str) and _accepts_float(tp):
                # YAML 1.1 reads "2e-3" (no dot) as a string; accept it as the number it means
                try:
                    value = float(value)
                except ValueError:
                    pass
            if not _type_matches(value, tp):
                raise ConfigError(f"{source}: key '{path}' expects {getattr(tp, '__name__', tp)}, got {value!r}")
            if tp is float and isinstance(value, int):
                value = float(value)
            if tp is tuple or typing.get_origin(tp) is tuple:
                value = tuple(value)
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except FieldError as exc:
        key = f"{where}.{exc.key}" if where else exc.key
        raise ConfigError(f"{source}: key '{key}' {exc.problem}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: '{where or '<root>'}': {exc}") from exc


def merge_into(base: Any, data: Any, where: str = "", source: str = "params.yaml") -> Any:
    """Overlay a mapping onto an existing dataclass instance (keeps non-default defaults of nested sections)."""
    if data is None:
        return base
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{where}' must be a mapping, got {type(data).__name__}")
    updated = from_dict(type(base), data, where, source)
    result = dataclasses.replace(base)
    for key in data:
        setattr(result, key, getattr(updated, key))
    return result


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
    node[parts[-1]] = value


def load_config(path: Union[str, Path] = "params.yaml", overrides: Optional[list[str]] = None,
                root: Union[str, Path, None] = None) -> DareConfig:
    """Read params.yaml (plus `key.sub=value` overrides) into a validated DareConfig, its output
    locations checked as a set (output_paths.py) against the project folder `root` (where the
    stages run, which relative paths start from; default: the current directory)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    raw = read_yaml_mapping(path, ConfigError, "a mapping of sections")
    parsed = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
        key, value = item.split("=", 1)
        parsed.append((key, _override_value(key, value)))
    # params.yaml < the recipe < overrides: the recipe is read before the overrides are applied
    recipe = next((value for key, value in reversed(parsed) if key == "recipe"), raw.get("recipe"))
    raw = apply_recipe(raw, recipe, path)
    _check_has_sections(raw, path)
    if next((value for key, value in reversed(parsed) if key == "lengths"), raw.get("lengths")) == "auto":
        raw = all_auto(raw)  # under the overrides, like a recipe: `-S sft.pad_to=8` still wins
    for key, value in parsed:
        _set_dotted(raw, key, value)
    cfg = from_dict(DareConfig, raw, "", str(path))
    check_finite(cfg, str(path))
    conflict = output_conflict(cfg.output_places(), cfg.input_places(), root, path)
    if conflict:
        raise ConfigError(f"{path}: {conflict}")
    return cfg


SECTIONS = ("run", "data", "model", "launch", "sft", "rl", "preference", "eval")


def _check_has_sections(raw: dict, path: Path) -> None:
    """An empty or commented-out params file would run a stage on the code's defaults (20000 SFT
    rows of arithmetic, a from-scratch model) and replace outputs made with the user's settings."""
    # (a key that is no section is from_dict's to name)
    if all(value is None or value == {} for value in raw.values()):
        raise ConfigError(f"{path}: no settings: the sections {', '.join(SECTIONS)} are all missing or empty (and no "
                          f"recipe is set); an empty or commented-out params file would run on built-in defaults. "
                          f"Restore it (from git) or give the sections your run needs")


def _override_value(key: str, text: str) -> Any:
    """The value of `-S key=text`, read as YAML (as params.yaml is): a malformed one is a ConfigError
    naming the key, not a YAML parser's traceback."""
    try:
        return load_yaml(text, prefix=key)
    except DuplicateKeyError as exc:
        raise ConfigError(f"override '{key}={text}': {exc}") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"override '{key}={text}': the value is not valid YAML ({problem}); quote it "
                          f"(-S '{key}=\"...\"') if it is meant as text") from None


def check_finite(node: Any, source: str = "params.yaml", where: str = "") -> None:
    """ConfigError naming the first NaN or infinite number anywhere in the config (every section's
    float fields, and the free-form mappings: task_args, algorithm_args, reward_args, model.init):
    such a value passes every range check (NaN compares false) and would surface only as a NaN loss
    or a crash after the stage had written its outputs."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        items: Any = ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
    elif isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(node))
    else:
        if isinstance(node, float) and not math.isfinite(node):
            raise ConfigError(f"{source}: key '{where}' must be a finite number, got {node}")
        return
    for key, value in items:
        check_finite(value, source, f"{where}{key}" if str(key).startswith("[") or not where else f"{where}.{key}")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
