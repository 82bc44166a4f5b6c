"""Likelihood estimators shared by every algorithm (docs/diffusion.md#likelihood-estimators).

Algorithms never call the model for likelihoods themselves: they hand a `Corruption` (or a
`CorruptionSet` of Monte-Carlo rows / trajectory steps) to these functions, so the same corrupted
inputs serve old, reference and current policy. Logits are computed only at scored rows and
log-softmax is taken there in float32; with `model.logits_chunk` > 0 they are computed a chunk of
rows at a time from the hidden states and never held whole (`head_scores`).

Memory stays flat in the number of rows: `separable_backward` runs forward + backward one chunk of
rows at a time for losses that are sums over rows, and `proxy_backward` does the exact
proxy-gradient replay (2.3) for losses that depend on the rows' statistics non-linearly.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from dare_core.diffusion.block import two_stream_logits, two_stream_scored_hidden, two_stream_scored_stream
from dare_core.diffusion.masking import Corruption, CorruptionSet
from dare_core.diffusion.uniform import UNIFORM_EPS, CanvasBatch, noisy_stream, uniform_nelbo_rate
from dare_core.metric_keys import add_chunk_metrics
from dare_core.models.family import noise_of
from dare_core.models.packing import packed_backend
from dare_core.models.sequence_parallel import pad_for_shards, shard_stream_hidden
from dare_core.models.ulysses import sum_over_group


# [N, V] temporaries of the entropy are made this many elements at a time (64 MiB in float32)
ENTROPY_CHUNK_ELEMENTS = 1 << 24


class _Entropy(torch.autograd.Function):
    """H = -sum_v p_v log p_v per row of log-probabilities `logp` [N, V]. Only `logp` is saved for
    the backward (log_softmax's own backward holds it anyway), p and p log p are recomputed one
    chunk of rows at a time, so the entropy adds no [N, V] tensor to the graph. Entries of -inf (an
    excluded token) have p = 0 and contribute nothing, to the value or the gradient."""

    @staticmethod
    def forward(ctx, logp: torch.Tensor) -> torch.Tensor:
        out = logp.new_empty(logp.shape[:-1])
        step = max(1, ENTROPY_CHUNK_ELEMENTS // max(logp.shape[-1], 1))
        for lo in range(0, logp.shape[0], step):
            lp = logp[lo:lo + step].clamp_min(torch.finfo(logp.dtype).min)
            out[lo:lo + step] = -(lp.exp() * lp).sum(-1)
        ctx.save_for_backward(logp)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (logp,) = ctx.saved_tensors
        out = torch.empty_like(logp)
        step = max(1, ENTROPY_CHUNK_ELEMENTS // max(logp.shape[-1], 1))
        for lo in range(0, logp.shape[0], step):  # dH/dlogp_v = -p_v (1 + log p_v)
            lp = logp[lo:lo + step].clamp_min(torch.finfo(logp.dtype).min)
            out[lo:lo + step] = -grad[lo:lo + step, None] * lp.exp() * (1 + lp)
        return out


def entropy_of_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """The entropy [N] of each row of normalised log-probabilities [N, V] (the distribution the
    scores come from: tempered, MASK excluded where it is), differentiable, memory-lean."""
    return _Entropy.apply(logp)


def logits_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, exclude: Sequence[int] = (),
                  entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(logits/temperature)[target] per row of `logits` [N, V] (`exclude`d ids at -inf),
    in float32: [N]; with `entropy` also that distribution's entropy [N], else None."""
    full = _tempered_log_softmax(logits, temperature, exclude)
    logp = full.gather(-1, targets[:, None]).squeeze(-1)
    return logp, entropy_of_logprobs(full) if entropy else None


def _tempered_log_softmax(logits: torch.Tensor, temperature: float, exclude: Sequence[int]) -> torch.Tensor:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if len(exclude):
        logits = logits.index_fill(-1, torch.tensor(list(exclude), device=logits.device), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class _FrozenHeadScores(torch.autograd.Function):
    """`logits_scores` of a frozen linear head over hidden states [N, d], `chunk` rows at a time,
    whose backward needs no logits at all. With the head's weight W fixed, each score's gradient
    with respect to its own hidden state is a [d] row known in the forward:
      d logp_i / d h_i = ((onehot(y_i) - p_i) / tau) W
      d H_i / d h_i    = (-p_i * (log p_i + H_i) / tau) W
    so each chunk forms those rows right after its log-softmax (one matmul, the one the backward
    would do) and keeps them ([N, d] each, the size of the hidden states the recomputing path keeps),
    and the backward only scales them by the incoming gradient: one head matmul per chunk fewer
    than recomputing the logits, so the same head FLOPs as the whole-logits path. (LoRA never
    adapts the head, docs/diffusion.md#logits-free-scoring.)"""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, temperature, exclude, entropy, pieces):
        logps, ents, jac_logp, jac_ent = [], [], [], []
        for h, t in zip(_chunks(hidden, chunk, pieces), _chunks(targets, chunk, pieces)):
            full = _tempered_log_softmax(torch.nn.functional.linear(h, weight, bias), temperature, exclude)
            logps.append(full.gather(-1, t[:, None]).squeeze(-1))
            p = full.exp()
            if entropy:
                lp = full.clamp_min_(torch.finfo(full.dtype).min)  # (an excluded id: p = 0, no nan)
                ent = -(p * lp).sum(-1)
                ents.append(ent)
                jac_ent.append(lp.add_(ent[:, None]).mul_(p).neg_().div_(temperature).to(weight.dtype) @ weight)
            del full
            dlogp = p.neg_()
            dlogp[torch.arange(t.shape[0], device=t.device), t] += 1
            jac_logp.append(dlogp.div_(temperature).to(weight.dtype) @ weight)
            del p, dlogp
        ctx.entropy = entropy
        ctx.save_for_backward(torch.cat(jac_logp), *([torch.cat(jac_ent)] if entropy else []))
        logp = torch.cat(logps)
        return logp, torch.cat(ents) if entropy else logp.new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        jac = ctx.saved_tensors
        grad = grad_logp[:, None] * jac[0]
        if ctx.entropy:
            grad = grad + grad_ent[:, None] * jac[1]
        return grad.to(jac[0].dtype), None, None, None, None, None, None, None, None


def _chunks(x: torch.Tensor, chunk: int, pieces: Optional[int]) -> tuple[torch.Tensor, ...]:
    """`x`'s rows `chunk` at a time, or in exactly `pieces` parts. A split, not a slice per chunk:
    its backward concatenates the chunks' gradients in one [N, d]."""
    return x.tensor_split(pieces) if pieces is not None else x.split(chunk)


def _frozen_linear(head: torch.nn.Module) -> bool:
    """A plain linear head whose weights take no gradient and are whole on this rank (ZeRO-3
    partitions parameters to empty placeholders, gathered by hooks the module call runs)."""
    return (type(head) is torch.nn.Linear and not head.weight.requires_grad
            and (head.bias is None or not head.bias.requires_grad) and getattr(head.weight, "ds_id", None) is None)


def head_scores(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, temperature: float = 1.0,
                exclude: Sequence[int] = (), entropy: bool = False,
                pieces: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`logits_scores` of head(hidden) for hidden states [N, d], `chunk` rows at a time, so that no
    more than [chunk, V] logits exist at once, in the forward and in the backward. `pieces`: in
    exactly that many chunks instead (some perhaps empty; none over `chunk` rows where the caller
    sized it so), where ranks must call the head equally often.

    Each chunk runs under non-reentrant activation checkpointing: its forward keeps only its
    hidden-state slice and the backward recomputes its logits. Checkpointing rather than a custom
    autograd.Function with hand-written matmul gradients, because it re-runs the head *module*:
    a LoRA-wrapped head, ZeRO-3's parameter gathering hooks and a tied embedding keep working, and
    the gradient is autograd's own for the same ops as the whole-logits path (equal up to the
    order of the per-chunk weight-gradient sums). The extra cost is the one head matmul per chunk
    that any recomputing scheme pays; a frozen plain head (LoRA, which never adapts it) pays none
    (`_FrozenHeadScores`)."""
    if torch.is_grad_enabled() and hidden.requires_grad and _frozen_linear(head):
        logp, ent = _FrozenHeadScores.apply(hidden, head.weight, head.bias, targets, chunk, temperature, tuple(exclude),
                                            entropy, pieces)
        return logp, ent if entropy else None

    def one_chunk(h: torch.Tensor, t: torch.Tensor):
        return logits_scores(head(h), t, temperature, exclude, entropy)

    # without a graph (old / reference scores) there is nothing to keep or recompute: plain chunks
    run = ((lambda h, t: checkpoint(one_chunk, h, t, use_reentrant=False, preserve_rng_state=False))  # noqa: E731
           if torch.is_grad_enabled() else one_chunk)  # (the head draws nothing random)
    parts = [run(h, t) for h, t in zip(_chunks(hidden, chunk, pieces), _chunks(targets, chunk, pieces))]
    logp = torch.cat([p[0] for p in parts])
    return logp, torch.cat([p[1] for p in parts]) if entropy else None


def token_logprobs(model, corruption: Corruption, targets: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, exclude: Sequence[int] = (), entropy: bool = False):
    """log softmax(f(noisy)/temperature)[target_i] at every scored position, 0 elsewhere; float32 [B, S].

    `entropy`: also the entropy of that whole distribution softmax(f(noisy)/temperature) at every
    scored position (0 elsewhere), from the same forward: returns (log-probs, entropies), both
    [B, S]. Off by default, so the scores cost nothing beyond the target's log-probability.

    `exclude`: token ids whose logits are -inf before the softmax. Trajectory scores pass the MASK
    id, because the sampler never draws MASK (its logit is -inf there), so that a replayed score is
    the log-probability the rollout actually sampled with.

    Block-diffusion models score all blocks in one pass of the two-stream layout [x_t ; x_0],
    each noisy block seeing only the clean blocks before it. Under `model.packing` the forward
    runs over the real tokens only; with `model.logits_chunk` > 0 the scores come from the hidden
    states a chunk of tokens at a time (`head_scores`), never from the whole [N, V] logits."""
    if corruption.targets is not None:
        targets = corruption.targets
    # what a scored position's log-probability reads: the clean token, or what an edited rollout's step wrote
    read = corruption.scored_ids if corruption.scored_ids is not None else targets
    if noise_of(model) == "uniform":
        if corruption.scored_ids is not None:
            raise ValueError("a uniform-noise model scores no edited trajectory (scored_ids)")
        return canvas_token_logprobs(model, corruption, targets, attention_mask, temperature, exclude, entropy)
    if getattr(model, "sequence_shards", None) is not None:
        return _sharded_token_logprobs(model, corruption.noisy_ids, targets, attention_mask, corruption.scored, temperature,
                                       exclude, entropy, read)
    rows = corruption.scored
    block = model.block_size is not None
    if model.logits_chunk > 0:
        hidden = (two_stream_scored_hidden(model, corruption.noisy_ids, targets, attention_mask, rows) if block
                  else model.scored_hidden(corruption.noisy_ids, attention_mask, rows))
        logp, ent = head_scores(model.net.lm_head, hidden, read[rows], model.logits_chunk, temperature, exclude, entropy)
    else:
        logits = (two_stream_logits(model, corruption.noisy_ids, targets, attention_mask, rows) if block
                  else model.scored_logits(corruption.noisy_ids, attention_mask, rows))
        logp, ent = logits_scores(logits, read[rows], temperature, exclude, entropy)
    zeros = torch.zeros(rows.shape, dtype=torch.float32, device=logp.device)
    if not entropy:
        return zeros.masked_scatter(rows, logp)
    return zeros.masked_scatter(rows, logp), zeros.masked_scatter(rows, ent)


def canvas_token_logprobs(model, corruption: Corruption, targets: torch.Tensor, attention_mask: torch.Tensor,
                          temperature: float = 1.0, exclude: Sequence[int] = (), entropy: bool = False):
    """`token_logprobs` of a uniform-noise model: log softmax(f(z)/temperature)[target] at each
    scored response position (float32 [B, S], 0 elsewhere), `entropy`: also each one's entropy."""
    rows = corruption.scored
    logp, ent = logits_scores(canvas_scored_logits(model, corruption, targets, attention_mask), targets[rows], temperature,
                              exclude, entropy)
    zeros = torch.zeros(rows.shape, dtype=torch.float32, device=logp.device)
    if not entropy:
        return zeros.masked_scatter(rows, logp)
    return zeros.masked_scatter(rows, logp), zeros.masked_scatter(rows, ent)


def canvas_scored_logits(model, corruption: Corruption, targets: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] of a uniform-noise model at the corruption's scored response positions (row
    major): every canvas of the response denoised from the corruption's tokens given the prompt (as
    the corruption has it) and the clean canvases before it, in one forward, self-conditioning off."""
    if getattr(model, "sequence_shards", None) is not None or model.logits_chunk > 0 or model.packing == "on":
        raise ValueError("a uniform-noise model scores on one rank, with whole logits and padded batches "
                         "(launch.sequence_parallel 1, model.logits_chunk 0, model.packing auto or off)")
    p = corruption.prompt_len
    if p is None:
        raise ValueError("a uniform-noise corruption must carry its batch's prompt width (Corruption.prompt_len)")
    s = targets.shape[1]
    clean = torch.cat([corruption.noisy_ids[:, :p], targets[:, p:]], dim=1)  # (the prompt as noised, the response clean)
    columns = torch.arange(s - p, device=clean.device).expand(clean.shape[0], -1)
    stream_clean, pos, block_start, attn = noisy_stream(CanvasBatch(clean, attention_mask, p, model.block_size), columns)
    ids = torch.cat([clean, corruption.noisy_ids[:, p:]], dim=1)
    hidden = model.net(ids, stream_clean, pos, block_start, attention_mask=attn)[:, s:]
    return model.net.logits(hidden[corruption.scored[:, p:]])


def uniform_elbo_row(model, corruption: Corruption, targets: torch.Tensor, attention_mask: torch.Tensor,
                     eps: float = UNIFORM_EPS) -> torch.Tensor:
    """[B] one sample of each sequence's uniform-noise ELBO over its scored positions, from one
    corrupted copy at the row's time t (`corruption.p`): -(1 - 2 eps) times the summed integrand
    (docs/diffusion.md#uniform-noise-elbo); rows at stratified times average to the estimate."""
    rows = corruption.scored
    logits = canvas_scored_logits(model, corruption, targets, attention_mask)
    t = corruption.p.to(logits.device)[rows.nonzero()[:, 0]]
    rate = uniform_nelbo_rate(logits, corruption.noisy_ids[rows], targets[rows], t)
    per_row = torch.zeros(rows.shape, dtype=rate.dtype, device=rate.device).masked_scatter(rows, rate).sum(-1)
    return (-(1 - 2 * eps) * per_row).float()


def _sharded_token_logprobs(model, noisy_ids: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor,
                            rows: torch.Tensor, temperature: float, exclude: Sequence[int], entropy: bool,
                            read: torch.Tensor):
    """`token_logprobs` under sequence parallelism (`model.sequence_shards`): this rank runs its slice
    of the scoring stream, scores the positions whose hidden state it holds, and the group's sum of
    the [B, S] scores (each position scored by one rank) gives every rank the whole batch's scores,
    so every estimator built on them runs unchanged (docs/diffusion.md#sequence-parallelism)."""
    shards = model.sequence_shards
    block = model.block_size is not None
    packed = packed_backend(model.packing, noisy_ids.device, block) is not None
    ids, clean, mask, scored = pad_for_shards(noisy_ids, targets, attention_mask, rows, shards.size, packed)
    stream = (two_stream_scored_stream(model, ids, clean, mask, scored) if block else model.scored_stream(ids, mask, scored))
    hidden, kept = shard_stream_hidden(model, stream, shards)
    if read is not targets:  # (an edited step's tokens: laid out as the clean ones are)
        clean = pad_for_shards(noisy_ids, read, attention_mask, rows, shards.size, packed)[1]
    mine = clean[scored][kept]
    if model.logits_chunk > 0:
        # as many head calls on every rank (ZeRO-3 gathers the head's weights at each: a collective)
        most = torch.tensor(float(hidden.shape[0]), device=hidden.device)
        torch.distributed.all_reduce(most, torch.distributed.ReduceOp.MAX, group=shards.group)
        pieces = max(1, -(-int(most) // model.logits_chunk))
        logp, ent = head_scores(model.net.lm_head, hidden, mine, model.logits_chunk, temperature, exclude, entropy, pieces)
    else:
        logp, ent = logits_scores(model.net.lm_head(hidden), mine, temperature, exclude, entropy)
    b, s = rows.shape

    def whole(values: torch.Tensor) -> torch.Tensor:
        per_scored = torch.zeros(kept.shape, dtype=torch.float32, device=values.device).masked_scatter(kept, values)
        grid = torch.zeros(scored.shape, dtype=torch.float32, device=values.device).masked_scatter(scored, per_scored)
        return sum_over_group(grid, shards)[:b, :s]

    return (whole(logp), whole(ent)) if entropy else whole(logp)


def rows_logprobs(model, rows: Sequence[Corruption], targets: torch.Tensor, attention_mask: torch.Tensor,
                  temperature: float = 1.0, exclude: Sequence[int] = (), entropy: bool = False):
    """token_logprobs of several corruptions of the same batch in one forward: [R, B, S] (and, with
    `entropy`, the entropies [R, B, S] as a second result)."""
    if len(rows) == 1:
        out = token_logprobs(model, rows[0], targets, attention_mask, temperature, exclude, entropy)
        return (out[0][None], out[1][None]) if entropy else out[None]
    tg = [r.targets if r.targets is not None else targets for r in rows]
    read = None
    if any(r.scored_ids is not None for r in rows):
        read = torch.cat([r.scored_ids if r.scored_ids is not None else t for r, t in zip(rows, tg)])
    stacked = Corruption(torch.cat([r.noisy_ids for r in rows]), torch.cat([r.scored for r in rows]),
                         torch.cat([r.p for r in rows]), None, torch.cat(tg), scored_ids=read)
    out = token_logprobs(model, stacked, targets.repeat(len(rows), 1), attention_mask.repeat(len(rows), 1), temperature, exclude,
                         entropy)
    if entropy:
        return out[0].view(len(rows), *targets.shape), out[1].view(len(rows), *targets.shape)
    return out.view(len(rows), *targets.shape)


def elbo_rows(model, rows: Sequence[Corruption], targets: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row ELBO samples E_r = sum_i w_ri log p(y_i | z_r) (w = 1/p of the row's law): [B, R].
    Under uniform noise each row's sample is its time's integrand instead (`uniform_elbo_row`)."""
    if noise_of(model) == "uniform":
        return torch.stack([uniform_elbo_row(model, r, targets, attention_mask) for r in rows], dim=1)
    logp = rows_logprobs(model, rows, targets, attention_mask)
    weight = torch.stack([r.elbo_weight() for r in rows]).to(logp.device)
    return (logp * weight).sum(-1).transpose(0, 1)


def weighted_masked_nll(model, corruption: Corruption, targets: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample sum over masked positions of CE_i / p  ([B]): an unbiased negative-ELBO estimate."""
    return -elbo_rows(model, [corruption], targets, attention_mask)[:, 0]


# --------------------------------------------------------------------------- constant-memory backward


def chunks(n: int, size: int) -> list[list[int]]:
    size = max(1, size)
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def separable_backward(corruptions: CorruptionSet, rows_per_forward: int,
                       chunk_loss: Callable[[list], tuple[torch.Tensor, dict]],
                       backward: Callable[[torch.Tensor], None]) -> tuple[float, dict]:
    """For a loss that is a sum of per-row terms: forward and backward one chunk of rows at a time,
    so activation memory is that of one chunk whatever the number of rows. Returns the summed loss
    value and the metrics of every chunk, summed (`*_max` keys by max: metric_keys.py)."""
    total, metrics = 0.0, {}
    for idx in chunks(len(corruptions), rows_per_forward):
        loss, m = chunk_loss(idx)
        backward(loss)
        total += float(loss.detach())
        add_chunk_metrics(metrics, m)
    return total, metrics


def proxy_backward(corruptions: CorruptionSet, rows_per_forward: int,
                   chunk_stats: Callable[[list], torch.Tensor],
                   loss_of_stats: Callable[[torch.Tensor], tuple[torch.Tensor, dict]],
                   backward: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, dict]:
    """Exact constant-memory gradient of loss(T) where T = [B, R, ...] stacks per-row statistics
    (docs/diffusion.md#mc-elbo): T is computed without a graph, g = dloss/dT on a detached leaf, then each
    chunk of rows is recomputed with a graph and backpropagated as <g_rows, T_rows>. Exact because
    the loss reaches the parameters only through T. With all rows in one chunk it is one pass."""
    groups = chunks(len(corruptions), rows_per_forward)
    if len(groups) == 1:
        loss, metrics = loss_of_stats(chunk_stats(groups[0]))
        backward(loss)
        return loss.detach(), metrics
    with torch.no_grad():
        stats = torch.cat([chunk_stats(idx) for idx in groups], dim=1)
    leaf = stats.detach().requires_grad_(True)
    with torch.enable_grad():
        loss, metrics = loss_of_stats(leaf)
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    if grad is None:
        return loss.detach(), metrics
    for idx in groups:
        part = chunk_stats(idx)
        backward((grad[:, idx[0]:idx[-1] + 1] * part).sum())
    return loss.detach(), metrics
