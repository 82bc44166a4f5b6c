"""One denoising loop for every family (docs/sampling.md#sampling).

Masked diffusion (LLaDA, Dream) decodes the response in semi-autoregressive blocks counted from the
end of the prompt; block diffusion (SDAR, LLaDA2) decodes blocks aligned to absolute positions, the
first of which holds the prompt's tail. Both are the same loop over blocks and steps; what varies
plugs in:

  unmasking  how many / which masked positions of the block a step commits (`unmasking.py`); for a
             uniform-noise family (DiffusionGemma) the rule instead redraws the whole block each
             step and commits its argmax when it is stable (`uniform_noise.py`)
  cache      which columns a step re-encodes (`cache.py`); keys/values live in one `KVCache`
  proposal   temperature, top-k / top-p, float64 Gumbel, classifier-free guidance

Prompts are left-padded; padding is a key that no query ever sees, in every cache mode, and
positions restart at 0 at each prompt's first token, so a batch decodes exactly as its prompts would
one at a time. A sequence whose finished blocks hold EOS (or a stop id) leaves the batch. Returns
token ids, never text. Under ZeRO-3 the ranks decode in lockstep (`lockstep.py`): every rank makes
the same forward calls, however early its own rows finish.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from dare_core.models.lora import adapters_merged
from dare_core.models.transformer import KVCache
from dare_core.sampling.cache import CachePolicy, Window, build_cache_policy
from dare_core.sampling.encoder_forward import EncoderForward
from dare_core.sampling.lockstep import RankLockstep, zero3_partitioned
from dare_core.sampling.params import UNIFORM_NOISE_RULES, SamplingParams
from dare_core.sampling.trajectory import Trajectory, TrajectoryRecorder
from dare_core.sampling.uniform_noise import UniformNoiseBlock, UniformNoiseRule
from dare_core.sampling.unmasking import StepContext, build_unmasker, score_block

RECORD = ("none", "steps", "full")


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P+L]: left-padded prompt, then the response (EOS after the first stop)
    attention_mask: torch.Tensor  # [B, P+L]
    prompt_len: int
    nfe: int  # model forwards (a classifier-free-guidance forward counts twice)
    lengths: torch.Tensor  # [B] response tokens up to and including the first stop token (gen_length if none)
    stop_reason: list  # per row: "eos" | "length"
    steps: torch.Tensor  # [B] denoising steps each row took
    sampler: dict = field(default_factory=dict)  # the sampler config (6.5); the engine name is "native"
    trajectory: Optional[Trajectory] = None
    # token editing: [B] tokens each row's steps replaced (its whole canvas, after a stop too); None without editing
    edits: Optional[torch.Tensor] = None
    # what the forwards encoded, summed over them (native engine; empty for an external one):
    # `encoded_tokens` rows x window columns, `key_pairs` rows x window columns x key columns attended,
    # `logit_tokens` rows x columns whose logits were taken. The FLOPs of a rollout follow from them.
    work: dict = field(default_factory=dict)

    @property
    def response(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len:]

    @property
    def step_map(self) -> Optional[torch.Tensor]:
        """[B, gen_length] 1-based step that committed each response position (0: never decoded)."""
        if self.trajectory is None:
            return None
        return self.trajectory.response_step_map(self.response.shape[1])


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
            mask[i, width - len(p):] = 1
    return ids, mask


@dataclass
class Canvas:
    """The decoding canvas. Masked: [pad | prompt | L masks], blocks from the prompt's end.
    Block diffusion: whole pad blocks, the prompt's full blocks, then blocks that start with each
    prompt's tail, so that every row's blocks sit on the same columns and on its own multiples of B_s."""

    x: torch.Tensor
    attn: torch.Tensor
    pos: torch.Tensor
    is_prompt: torch.Tensor
    resp_start: torch.Tensor  # [B]
    origin: int  # first column of the first decoding block
    blocks: list

    @classmethod
    def build(cls, prompts, params: SamplingParams, mask_id: int, pad_id: int, block_diffusion: bool, device,
              bucket: int = 1, min_blocks: int = 0) -> "Canvas":
        lens = [len(p) for p in prompts]
        if min(lens) == 0:
            raise ValueError("every prompt needs at least one token")
        bs, L = params.block_length, params.gen_length
        if block_diffusion:
            fulls = [n - n % bs for n in lens]
            unit = math.lcm(bucket, bs)
            origin = math.ceil(max(fulls) / unit) * unit
            # (at least min_blocks: ranks in lockstep walk as many blocks as the longest canvas has)
            n_blocks = max(math.ceil((max(n % bs for n in lens) + L) / bs), min_blocks)
            pads = [origin - f for f in fulls]
        else:
            origin, n_blocks = math.ceil(max(lens) / bucket) * bucket, L // bs
            pads = [origin - n for n in lens]
        S = origin + n_blocks * bs
        x = torch.full((len(prompts), S), mask_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), S), dtype=torch.long)
        is_prompt = torch.zeros((len(prompts), S), dtype=torch.bool)
        for i, (p, pad) in enumerate(zip(prompts, pads)):
            x[i, :pad] = pad_id
            x[i, pad:pad + len(p)] = torch.tensor(list(p), dtype=torch.long)
            attn[i, pad:] = 1
            is_prompt[i, pad:pad + len(p)] = True
        resp_start = torch.tensor([pad + n for pad, n in zip(pads, lens)])
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        blocks = [(origin + b * bs, origin + (b + 1) * bs) for b in range(n_blocks)]
        return cls(x.to(device), attn.to(device), pos.to(device), is_prompt.to(device), resp_start.to(device), origin, blocks)

    def select(self, keep: torch.Tensor) -> None:
        for name in ("x", "attn", "pos", "is_prompt", "resp_start"):
            setattr(self, name, getattr(self, name).index_select(0, keep))


class Forward:
    """Runs the model on a window of the canvas, with the KV cache, classifier-free guidance (the
    unconditional rows ride in the same batch, prompt masked) and, on GPUs, a CUDA graph of the
    fixed-width one-block window."""

    def __init__(self, model, canvas: Canvas, policy: CachePolicy, params: SamplingParams, graphs: bool):
        self.model, self.canvas, self.policy, self.params = model, canvas, policy, params
        self.cfg = params.cfg_scale > 0
        self.cache: Optional[KVCache] = None
        if policy.uses_kv and not graphs:  # CUDA graphs bring their own (static) cache
            p = next(model.parameters())
            self.cache = KVCache(model.config, canvas.x.shape[0] * (2 if self.cfg else 1), canvas.x.shape[1], p.dtype, p.device)
        self.nfe = 0
        self.work = {"encoded_tokens": 0, "key_pairs": 0, "logit_tokens": 0}
        self.graphs = None
        self.static = None
        if graphs:
            from dare_core.sampling.graphs import graph_store

            self.static = graph_store(model, canvas.x.shape[0], canvas.x.shape[1], params.compile_forward)
            self.static.attn.copy_(canvas.attn)
            self.static.pos.copy_(canvas.pos)
            self.cache, self.graphs = self.static.cache, self.static.graphed

    def _inputs(self):
        c = self.canvas
        if self.static is not None:  # graphs read the static copies (rows never leave the batch then)
            return c.x, self.static.attn, self.static.pos
        if not self.cfg:
            return c.x, c.attn, c.pos
        uncond = c.x.masked_fill(c.is_prompt, self.model.mask_token_id)
        return torch.cat([c.x, uncond]), torch.cat([c.attn, c.attn]), torch.cat([c.pos, c.pos])

    def __call__(self, w: Window, lo: Optional[int] = None, hi: Optional[int] = None) -> Optional[torch.Tensor]:
        """Encode window `w` (writing its keys/values when cached); logits [B, hi-lo, V] in float32
        for columns [lo, hi), or None when none are asked for (prefill, commit)."""
        self.nfe += 2 if self.cfg else 1
        x, attn, pos = self._inputs()
        width = w.end - w.start
        S = x.shape[1]
        # graphs serve the fixed widths (a block, the whole canvas); key_end is then always the
        # whole canvas, which the mask makes equivalent
        rows = x.shape[0]
        self.work["encoded_tokens"] += rows * width
        if self.graphs is not None and (width == S or width == self.params.block_length + self.policy.shift):
            hidden = self.graphs(x[:, w.start:w.end], w.start, attn, pos, self.cache)
            self.work["key_pairs"] += rows * width * S
        else:
            cols = torch.arange(w.start, w.end, device=x.device)
            hidden = self.model.window_hidden(x[:, w.start:w.end], cols, attn, pos, w.key_end, self.cache)
            self.work["key_pairs"] += rows * width * w.key_end
        if lo is None:
            return None
        self.work["logit_tokens"] += rows * (hi - lo)
        logits = self.model.column_logits(hidden, w.start, lo, hi).float()
        if self.cfg:
            cond, uncond = logits.chunk(2)
            logits = uncond + (self.params.cfg_scale + 1) * (cond - uncond)
        return logits

    def select(self, keep: torch.Tensor) -> None:
        if self.cache is not None:
            half = self.cache.k[0].shape[0] // 2  # the unconditional rows follow the conditional ones
            self.cache.select(torch.cat([keep, keep + half]) if self.cfg else keep)
        if self.graphs is not None:
            self.graphs.reset()


def _graphs_wanted(model, params: SamplingParams) -> bool:
    if params.cuda_graphs is False or params.cache not in ("dual", "block_kv"):
        return False
    # (a captured graph would replay ZeRO-3's weight gathers from one moment as if they were static)
    ok = next(model.parameters()).is_cuda and model.config.moe is None and params.cfg_scale == 0 and not zero3_partitioned(model)
    if params.cuda_graphs and not ok:
        raise ValueError("cuda_graphs needs a CUDA model without MoE layers, not partitioned by ZeRO-3, and cfg_scale = 0")
    return ok


def _stop_ids(model, params: SamplingParams) -> torch.Tensor:
    return torch.tensor(sorted({model.eos_token_id, *params.stop_token_ids}))


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generators: Optional[Sequence[torch.Generator]] = None,
    record: str = "none",
    max_blocks: Optional[int] = None,
    lockstep: Optional[RankLockstep] = None,
) -> GenerationOutput:
    """Decode `params.gen_length` tokens after each prompt. `record`: "steps" keeps the step map
    (CJ-GRPO, d-TreeRPO), "full" also every step's proposals and confidences (MDPO). `max_blocks`
    decodes only the first blocks (benchmarks, previews); the rest of the response is EOS.

    `lockstep`: how the ranks agree to go on; by default one exactly when ZeRO-3 partitions `model`
    over several ranks (`RankLockstep.for_model`), else each rank stops on its own."""
    return _denoise(model, prompts, params, generators, record, max_blocks, None, None, lockstep)


@torch.no_grad()
def denoise_range(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    init_response: Optional[torch.Tensor],
    step_range: tuple[int, int],
    generators: Optional[Sequence[torch.Generator]] = None,
    lockstep: Optional[RankLockstep] = None,
) -> GenerationOutput:
    """Resume the denoising loop (tree rollouts, `tree.py`; masked diffusion with a count schedule and
    no cache): `init_response` [B, gen_length] is the state to start from (MASK where undecoded; None:
    all MASK) and `step_range = (j0, j1)` runs only the steps j0 <= j < j1 of the whole schedule (steps
    are numbered over all blocks, `steps_per_block` per block). Per-block counts are those of decoding
    from the start, so running [0, j) and then [j, steps) from the first run's state commits what one
    uninterrupted run does with the same random draws. The state the run ends in is
    `trajectory.tokens` (recorded at "steps"; MASK where still undecoded); `response` fills those with EOS."""
    return _denoise(model, prompts, params, generators, "steps", None, init_response, step_range, lockstep)


def _denoise(model, prompts: Sequence[Sequence[int]], params: SamplingParams, generators: Optional[Sequence[torch.Generator]],
             record: str, max_blocks: Optional[int], init_response: Optional[torch.Tensor],
             step_range: Optional[tuple[int, int]], lockstep: Optional[RankLockstep]) -> GenerationOutput:
    """The one denoising loop behind `generate` and `denoise_range`, with LoRA adapters folded into
    the weights while it runs where `params.lora_merged` asks for it."""
    args = (model, prompts, params, generators, record, max_blocks, init_response, step_range, lockstep)
    if not params.lora_merged:
        return _denoise_loop(*args)
    if zero3_partitioned(model):
        raise ValueError("lora_merged needs whole weights on each rank (LoRA trains with ZeRO stage 0-2, not 3)")
    with adapters_merged(model):
        return _denoise_loop(*args)


def _denoise_loop(model, prompts: Sequence[Sequence[int]], params: SamplingParams, generators: Optional[Sequence[torch.Generator]],
                  record: str, max_blocks: Optional[int], init_response: Optional[torch.Tensor],
                  step_range: Optional[tuple[int, int]], lockstep: Optional[RankLockstep]) -> GenerationOutput:
    if record not in RECORD:
        raise ValueError(f"record must be one of {RECORD}, got '{record}'")
    if params.edit_threshold is not None and (init_response is not None or step_range is not None):
        # a block's post-edit count and the positions it may still edit are not part of a resumable state
        raise ValueError("token editing (edit_threshold) cannot resume a range of steps")
    device = next(model.parameters()).device
    mask_id, eos_id = model.mask_token_id, model.eos_token_id
    block_diffusion = model.block_size is not None
    uniform = _check_noise_rule(model, params, record)
    resuming = init_response is not None or step_range is not None
    if resuming:
        if block_diffusion or params.cache != "none" or params.unmasking not in ("topk", "sequential"):
            raise ValueError("resuming (init_response / step_range) needs a masked-diffusion model, cache: none and a count "
                             "schedule (unmasking: topk or sequential)")
        j_from, j_to = step_range if step_range is not None else (0, params.steps)
        if not 0 <= j_from <= j_to <= params.steps:
            raise ValueError(f"step_range {step_range} must lie within [0, {params.steps}]")
    if block_diffusion and params.block_length != model.block_size:
        raise ValueError(f"this model was trained with blocks of {model.block_size}; set block_length: {model.block_size}")
    if params.stochastic and (generators is None or len(generators) != len(prompts)):
        raise ValueError("stochastic sampling needs one torch.Generator per prompt")
    generators = list(generators) if generators is not None else None

    graphs = not uniform and _graphs_wanted(model, params)
    # with CUDA graphs, canvases come in lengths rounded up to 64 columns of left padding (never
    # attended), so that rollouts with different prompt lengths replay the same captured graphs
    bucket = 64 if graphs else 1
    # (a uniform-noise block is filled with random tokens when it starts; padding until then)
    fill = model.pad_token_id if uniform else mask_id
    aligned = block_diffusion and not model.family.blocks_at_prompt_end
    canvas = Canvas.build(prompts, params, fill, model.pad_token_id, aligned, device, bucket)
    sync = lockstep if lockstep is not None else RankLockstep.for_model(model)
    if sync is not None and (n_blocks := sync.max(len(canvas.blocks))) > len(canvas.blocks):
        canvas = Canvas.build(prompts, params, fill, model.pad_token_id, aligned, device, bucket, n_blocks)

    def agree(going_on: bool) -> bool:
        """Whether decoding goes on: on this rank's word, or in lockstep on any rank's."""
        return sync.any(going_on) if sync is not None else going_on
    B, S, L = canvas.x.shape[0], canvas.x.shape[1], params.gen_length
    # what a block's count schedule starts from: its masked positions before any decoding (original rows)
    undecoded = canvas.x == mask_id if not uniform else None
    if init_response is not None:
        if tuple(init_response.shape) != (B, L):
            raise ValueError(f"init_response must be [{B}, {L}], got {list(init_response.shape)}")
        canvas.x[:, canvas.origin:canvas.origin + L] = init_response.to(device)
    span = int((S - (canvas.attn == 0).sum(-1)).max())
    if span > model.max_sequence_length:
        raise ValueError(f"prompt + gen_length needs {span} positions, more than the model's maximum length {model.max_sequence_length}")
    policy = build_cache_policy(params, 1 if model.family.shift_logits else 0, block_diffusion)
    noise = UniformNoiseBlock(UniformNoiseRule.of(params), model.config.vocab_size, next(model.parameters()).dtype) if uniform else None
    forward = EncoderForward(model, canvas, policy, params, noise) if uniform else Forward(model, canvas, policy, params, graphs)
    unmasker = build_unmasker(params) if not uniform else None
    stop_ids = _stop_ids(model, params).to(device)
    recorder = TrajectoryRecorder(B, S - canvas.origin, canvas.origin, record == "full", device) if record != "none" else None

    final = canvas.x.clone()
    resp_start_all = canvas.resp_start.clone()
    active = torch.arange(B, device=device)
    steps = torch.zeros(B, dtype=torch.long, device=device)
    # token editing (LLaDA2.1): committed positions of the block may change, and a block without
    # masks may take up to post_edit_steps more steps
    editing = params.edit_threshold is not None
    limit = max(params.steps_per_block, params.block_length) + 1 + (params.post_edit_steps if editing else 0)
    edits = torch.zeros(B, dtype=torch.long, device=device) if editing else None

    frozen = torch.zeros(B, dtype=torch.bool, device=device)

    def retire(done: torch.Tensor) -> bool:
        """Move finished rows out of the batch; False when none of this rank's is left. Under CUDA
        graphs, whose shapes are fixed, they stay in it, frozen (no position of theirs is masked any
        more); so do a lockstep rank's last rows, which its idle forward calls still run on."""
        nonlocal active, generators, frozen
        if not done.any():
            return not bool(frozen.all())
        if forward.static is not None or (sync is not None and bool((done | frozen).all())):
            newly = done & ~frozen
            final[active[newly]] = canvas.x[newly]
            frozen = frozen | done
            return not bool(frozen.all())
        final[active[done]] = canvas.x[done]
        keep = (~done).nonzero().squeeze(-1)
        active, frozen = active[keep], frozen[keep]
        if keep.numel() == 0:
            return False
        canvas.select(keep)
        forward.select(keep)
        if generators is not None:
            generators = [generators[i] for i in keep.tolist()]
        if noise is not None and noise.stopped is not None:
            noise.select(keep)
        return not bool(frozen.all())

    for w in policy.prefill(canvas.origin, canvas.x.shape[0]):
        forward(w)
    spb = params.steps_per_block
    alive = True
    if resuming and j_from // spb < len(canvas.blocks):
        # rows that stopped in a block finished before the range left an uninterrupted run there
        alive = agree(retire(_finished(canvas, canvas.blocks[j_from // spb][0], L, stop_ids, params.stop_at_eos)))
    for bi, (lo, hi) in enumerate(canvas.blocks[:max_blocks] if alive else []):
        j = 0
        if resuming:
            if bi * spb >= j_to:
                break
            if (bi + 1) * spb <= j_from:
                continue
            j = max(j_from - bi * spb, 0)
        if noise is not None:
            canvas.x[:, lo:hi] = noise.start(canvas.x.shape[0], hi - lo, generators, device)
        else:
            masked_at_start = (undecoded[active, lo:hi] & ~frozen[:, None]).sum(-1)
        post = torch.zeros(canvas.x.shape[0], dtype=torch.long, device=device)  # (editing: steps on a block without masks)
        settled = torch.zeros(canvas.x.shape[0], dtype=torch.bool, device=device)
        range_end = False
        while True:
            if noise is not None:
                busy_rows = noise.busy(j) & ~frozen
            else:
                is_masked = (canvas.x[:, lo:hi] == mask_id) & ~frozen[:, None]
                busy_rows = is_masked.any(-1)
                if editing:  # a full block goes on while its steps edit, post_edit_steps at most
                    post += (~busy_rows & ~settled & ~frozen).long()
                    settled |= post > params.post_edit_steps
                    busy_rows = busy_rows | (~settled & ~frozen)
            busy = bool(busy_rows.any())
            if not agree(busy):
                break
            if resuming and bi * spb + j >= j_to:
                range_end = True
                break
            if busy and j >= limit:
                raise RuntimeError(f"unmasking '{params.unmasking}' left block {bi} unfinished after {j} steps")
            logits = forward(policy.step(j, lo, hi, S), lo, hi)
            if not busy:  # in lockstep: another rank's rows still decode this block
                j += 1
                continue
            if noise is not None:
                rows = busy_rows.nonzero().squeeze(-1)
                canvas.x[:, lo:hi] = noise.step(canvas.x[:, lo:hi], logits[rows], j, rows, [generators[i] for i in rows.tolist()])
                steps[active[rows]] += 1
                j += 1
                continue
            logits[..., mask_id] = float("-inf")  # committing MASK would leave the position masked
            if params.logits_eos_inf:
                logits[..., eos_id] = float("-inf")
            # rows whose block is already complete draw nothing: a row's random stream must not
            # depend on how long its batch neighbours take
            # (deterministic decoding needs no such care, and skipping the row selection saves a
            # host-device sync per step)
            part = busy_rows
            if params.stochastic:
                rows = part.nonzero().squeeze(-1)
                sub_gens = [generators[i] for i in rows.tolist()]
                if rows.numel() < logits.shape[0]:  # (a copy of the whole [B, n, V] otherwise)
                    logits = logits[rows]
            else:
                rows, sub_gens = torch.arange(part.shape[0], device=device), None
            scores = score_block(logits, params, sub_gens, want_entropy=unmasker.needs_entropy)
            if params.confidence_eos_eot_inf:
                special = torch.isin(scores.proposal, stop_ids)
                scores.confidence = scores.confidence.masked_fill(special, float("-inf"))
            ctx = StepContext(params, j, masked_at_start[rows], sub_gens)
            sub_masked = is_masked[rows]
            commit = unmasker.select(scores, sub_masked, ctx) & sub_masked
            block = canvas.x[rows, lo:hi]
            if editing:
                # committed, non-prompt positions whose proposal differs and is confident enough (as of
                # the step's start: a position committed now is editable from the next step on)
                edit = (~sub_masked & ~canvas.is_prompt[rows, lo:hi] & (scores.proposal != block)
                        & (scores.confidence > params.edit_threshold) & part[rows][:, None])
                settled[rows[~sub_masked.any(-1) & ~edit.any(-1)]] = True  # full and unedited: the block is done
                commit = commit | edit
                edits[active[rows]] += edit.sum(-1)
            canvas.x[rows, lo:hi] = torch.where(commit, scores.proposal, block)
            steps[active[rows]] += part[rows].long()
            if recorder is not None:
                took = part[rows].nonzero().squeeze(-1)  # a row whose block was complete took no step
                recorder.record(active[rows[took]], steps[active[rows[took]]], lo, commit[took], scores.proposal[took], scores.confidence[took],
                                block[took] if editing else None)
            j += 1
            # rows that are finished leave mid-block too, once enough of them to be worth the re-slicing
            # (and, with CUDA graphs, a re-capture)
            complete = ~(canvas.x[:, lo:hi] == mask_id).any(-1) & ~frozen
            # (under editing a full block may still change: its rows leave at the block's end)
            if not editing and complete.numel() > 1 and complete.any() and not (complete | frozen).all():
                done = complete & _finished(canvas, hi, L, stop_ids, params.stop_at_eos)
                if int(done.sum()) >= (1 if forward.static is not None else max(1, done.numel() // 4)):
                    if forward.static is None:
                        masked_at_start = masked_at_start[(~done).nonzero().squeeze(-1)]
                    retire(done)
        if range_end:
            break
        if noise is not None:  # the block's tokens: its last argmax canvas
            canvas.x[:, lo:hi] = torch.where(frozen[:, None], canvas.x[:, lo:hi], noise.argmax)
        if bi + 1 < len(canvas.blocks) and (w := policy.commit(lo, hi)) is not None:
            forward(w)
        if not agree(retire(_finished(canvas, hi, L, stop_ids, params.stop_at_eos))):
            break
    if active.numel():
        final[active] = canvas.x
    return _assemble(model, prompts, params, final, resp_start_all, canvas.origin, forward, steps, recorder, stop_ids, edits)


def _check_noise_rule(model, params: SamplingParams, record: str) -> bool:
    """Whether `model` decodes under uniform noise; a ValueError where the sampler's rule does not
    fit the family's noise."""
    uniform = model.family.noise == "uniform"
    if uniform != (params.unmasking in UNIFORM_NOISE_RULES):
        fits = f"'{UNIFORM_NOISE_RULES[0]}'" if uniform else "a masked-diffusion rule"
        raise ValueError(f"unmasking '{params.unmasking}' does not apply to a {model.family.noise}-noise model "
                         f"({model.family.model_type}); use {fits}")
    if uniform and (record != "none" or params.cuda_graphs):
        raise ValueError("a uniform-noise model decodes without trajectory records and CUDA graphs")
    return uniform


def _finished(canvas: Canvas, hi: int, gen_length: int, stop_ids: torch.Tensor, stop_at_eos: bool) -> torch.Tensor:
    """Rows that need no further block: they have all gen_length tokens, or (stop_at_eos) a stop token."""
    cols = torch.arange(canvas.x.shape[1], device=canvas.x.device)
    in_resp = (cols >= canvas.resp_start[:, None]) & (cols < hi) & (cols < canvas.resp_start[:, None] + gen_length)
    done = canvas.resp_start + gen_length <= hi
    if stop_at_eos:
        done |= (torch.isin(canvas.x, stop_ids) & in_resp).any(-1)
    return done


def _assemble(model, prompts, params, final, resp_start, origin, forward: Forward, steps, recorder, stop_ids,
              edits: Optional[torch.Tensor] = None) -> GenerationOutput:
    """Each row's gen_length response columns of the canvas, in the standard layout; the trajectory
    keeps what was decoded after a stop."""
    mask_id, L = model.mask_token_id, params.gen_length
    idx = resp_start[:, None] + torch.arange(L, device=final.device)
    response = final.gather(1, idx.clamp(max=final.shape[1] - 1))
    undecoded = idx >= final.shape[1]
    if mask_id is not None:
        undecoded |= response == mask_id
    response = response.masked_fill(undecoded, model.eos_token_id)
    trajectory = None
    if recorder is not None:
        trajectory = recorder.finish(final[:, origin:], resp_start - origin, steps, params.block_length, mask_id)
    return response_output(prompts, response, model.pad_token_id, model.eos_token_id, stop_ids, nfe=forward.nfe, steps=steps,
                           sampler={"engine": "native", **asdict(params)}, trajectory=trajectory, work=dict(forward.work),
                           edits=edits)


def response_output(prompts: Sequence[Sequence[int]], response: torch.Tensor, pad_id: int, eos_id: int,
                    stop_ids: torch.Tensor, **fields) -> GenerationOutput:
    """The layout every engine returns: [left-padded prompt | response], everything after the first
    stop token set to EOS, with the valid lengths and stop reasons (docs/sampling.md#rollout-records)."""
    L = response.shape[1]
    is_stop = torch.isin(response, stop_ids.to(response.device))
    after = (is_stop.long().cumsum(-1) - is_stop.long()) > 0
    response = response.masked_fill(after, eos_id)
    has_stop = is_stop.any(-1)
    lengths = torch.where(has_stop, is_stop.long().argmax(-1) + 1, torch.full_like(has_stop, L, dtype=torch.long))
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, response.device)
    return GenerationOutput(
        sequences=torch.cat([prompt_ids, response], dim=1), attention_mask=torch.cat([prompt_mask, torch.ones_like(response)], dim=1),
        prompt_len=prompt_ids.shape[1], lengths=lengths, stop_reason=["eos" if s else "length" for s in has_stop.tolist()], **fields,
    )


def response_texts(tokenizer, responses: torch.Tensor) -> list[str]:
    """Text of each response row [N, L] of token ids, cut at the first EOS, special tokens skipped:
    what every reward grades."""
    eos = tokenizer.eos_token_id
    texts = []
    for row in responses.tolist():
        if eos in row:
            row = row[: row.index(eos)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def decode_responses(tokenizer, output: GenerationOutput) -> list[str]:
    """`response_texts` of an engine's output."""
    return response_texts(tokenizer, output.response)
