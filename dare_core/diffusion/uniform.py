"""Uniform-noise training (DiffusionGemma): the corruption and the SFT loss the model is fine-tuned
with (docs/diffusion.md#uniform-noise-sft).

Per example: one time t ~ U[eps, 1 - eps]; every response token is kept with probability 1 - t and
otherwise replaced by a token drawn uniformly from the whole vocabulary (which may be the token
itself); one canvas of the response, drawn uniformly among those holding a real token, is denoised
given the prompt and the clean canvases before it. The loss is the cross-entropy of that canvas's
clean tokens at all its valid positions, corrupted or not, with no weight in t, averaged per
example, plus the encoder's next-token cross-entropy over the clean prompt and response.
Self-conditioning as trained: a first pass without it, its logits detached, fed to a second pass in
each example with probability `self_conditioning`; only the second pass is scored.

The canvas layout: a response is cut into canvases of `canvas_length`; the last one is filled with
EOS to its end and supervised (the model learns to stop), and canvases past it are padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from dare_core.models.transformer import default_position_ids

# the times of the uniform process are drawn from [eps, 1 - eps] (Google's SFT reference's 1e-4)
UNIFORM_EPS = 1e-4


@dataclass
class CanvasBatch:
    """Left-padded prompts, then responses cut into canvases (EOS-filled; padding canvases after)."""

    ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]: 0 on prompt padding and on padding canvases
    prompt_len: int  # P
    canvas_length: int  # C; R = n_canvases * C

    @property
    def n_canvases(self) -> int:
        return (self.ids.shape[1] - self.prompt_len) // self.canvas_length


def canvas_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], canvas_length: int, eos_id: int,
                 pad_id: int) -> CanvasBatch:
    """The batch of (prompt, response) token lists: each response followed by EOS up to the end of
    its last canvas (at least one EOS), then padding canvases to the longest."""
    n = max(len(r) // canvas_length + 1 for r in responses)
    p = max(len(x) for x in prompts)
    rows, masks = [], []
    for prompt, response in zip(prompts, responses):
        filled = len(response) // canvas_length * canvas_length + canvas_length
        resp = list(response) + [eos_id] * (filled - len(response)) + [pad_id] * (n * canvas_length - filled)
        rows.append([pad_id] * (p - len(prompt)) + list(prompt) + resp)
        masks.append([0] * (p - len(prompt)) + [1] * (len(prompt) + filled) + [0] * (n * canvas_length - filled))
    return CanvasBatch(torch.tensor(rows), torch.tensor(masks), p, canvas_length)


def uniform_corrupt(x0: torch.Tensor, t: torch.Tensor, vocab_size: int, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """x0 [B, N] with each token replaced, with probability t[b], by a uniformly random id."""
    out = x0.clone()
    for b, g in enumerate(generators):
        replace = torch.rand(x0.shape[1], generator=g) < float(t[b])
        random = torch.randint(0, vocab_size, (x0.shape[1],), generator=g)
        out[b] = torch.where(replace.to(x0.device), random.to(x0.device), x0[b])
    return out


@dataclass
class UniformDraws:
    """What one example's loss draws: its time, its canvas, its corrupted canvas, the self-conditioning coin."""

    t: torch.Tensor  # [B]
    canvas: torch.Tensor  # [B] index of the scored canvas
    noisy: torch.Tensor  # [B, C]
    use_previous: torch.Tensor  # [B] bool


def draw(batch: CanvasBatch, vocab_size: int, generators: Sequence[torch.Generator], self_conditioning: float,
         eps: float = UNIFORM_EPS) -> UniformDraws:
    """Each example's draws from its own generator, in a fixed order (time, canvas, corruption, coin)."""
    c, p = batch.canvas_length, batch.prompt_len
    real = batch.attention_mask[:, p:].view(len(generators), -1, c).any(-1)  # [B, n] canvases holding tokens
    t, chosen = [], []
    for b, g in enumerate(generators):
        t.append(eps + (1 - 2 * eps) * float(torch.rand((), generator=g)))
        options = real[b].nonzero().squeeze(-1)
        chosen.append(int(options[int(torch.randint(len(options), (), generator=g))]))
    device = batch.ids.device
    t = torch.tensor(t, device=device)
    chosen = torch.tensor(chosen, device=device)
    noisy = uniform_corrupt(batch.ids[:, p:].gather(1, canvas_columns(chosen, c)), t, vocab_size, generators)
    coins = torch.tensor([float(torch.rand((), generator=g)) < self_conditioning for g in generators], device=device)
    return UniformDraws(t, chosen, noisy, coins)


def canvas_columns(canvas: torch.Tensor, canvas_length: int) -> torch.Tensor:
    """[B, C] the response columns of canvas `canvas[b]` of each example."""
    return canvas[:, None] * canvas_length + torch.arange(canvas_length, device=canvas.device)


def noisy_stream(batch: CanvasBatch, columns: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(clean, positions, block starts, attention mask) of one forward over the clean batch followed
    by noisy copies of its response columns `columns` [B, N]: each noisy token at its clean
    counterpart's position, denoised within the canvas holding that column, so that it sees the
    prompt and the clean canvases before it (`DiffusionGemmaNet.forward`)."""
    p, c = batch.prompt_len, batch.canvas_length
    b, s = batch.ids.shape
    clean_pos = default_position_ids(batch.ids, batch.attention_mask)
    first = batch.attention_mask[:, :p].sum(-1, keepdim=True)  # each prompt's real tokens: the response's first position
    clean = torch.cat([torch.ones(b, s, dtype=torch.bool, device=columns.device),
                       torch.zeros(columns.shape, dtype=torch.bool, device=columns.device)], dim=1)
    pos = torch.cat([clean_pos, first + columns], dim=1)
    block_start = torch.cat([torch.zeros_like(clean_pos), first + columns // c * c], dim=1)
    attn = torch.cat([batch.attention_mask, batch.attention_mask[:, p:].gather(1, columns)], dim=1)
    return clean, pos, block_start, attn


def canvas_sft_loss(net, batch: CanvasBatch, draws: UniformDraws) -> tuple[torch.Tensor, dict]:
    """mean over examples of (decoder CE over the scored canvas + encoder next-token CE); metrics."""
    p, s = batch.prompt_len, batch.ids.shape[1]
    columns = canvas_columns(draws.canvas, batch.canvas_length)
    ids = torch.cat([batch.ids, draws.noisy], dim=1)
    clean, pos, block_start, attn = noisy_stream(batch, columns)
    with torch.no_grad():  # the first pass: no self-conditioning; its logits only feed the second
        first = net.logits(net(ids, clean, pos, block_start, attention_mask=attn)[:, s:])
    hidden = net(ids, clean, pos, block_start, previous_logits=first, attention_mask=attn, use_previous=draws.use_previous)
    x0 = batch.ids[:, p:].gather(1, columns)
    valid = batch.attention_mask[:, p:].gather(1, columns).bool()
    dec = F.cross_entropy(net.logits(hidden[:, s:]).transpose(1, 2), x0, reduction="none")
    dec = (dec * valid).sum(-1) / valid.sum(-1)
    # the encoder: each clean token predicts the next one, over the real prompt and response
    targets = batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    enc = F.cross_entropy(net.logits(hidden[:, :s - 1]).transpose(1, 2), batch.ids[:, 1:], reduction="none")
    enc = (enc * targets).sum(-1) / targets.sum(-1).clamp_min(1)
    loss = (dec + enc).mean()
    replaced = (draws.noisy != x0) & valid
    return loss, {"loss/decoder": float(dec.detach().mean()), "loss/encoder": float(enc.detach().mean()),
                  "noise/replaced": float(replaced.sum() / valid.sum())}


def uniform_nelbo_rate(logits: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The continuous-time negative-ELBO integrand of uniform-state diffusion at time t, per token
    (docs/diffusion.md#uniform-noise-elbo): logits [N, K] of the clean token given the noisy
    sequence, the noisy and clean ids [N], t [N], under the schedule alpha(t) = 1 - t. It is the
    limit of KL(q(z_s | z_t, x) || q(z_s | z_t, p_theta)) / (t - s) as s -> t: zero when the model
    puts all its mass on the clean token, positive otherwise."""
    k = logits.shape[-1]
    alpha = (1 - t.double())[:, None]
    p = logits.double().softmax(-1)
    model_bar = k * alpha * p + (1 - alpha)  # K * (alpha p + (1 - alpha) / K)
    true_bar = (1 - alpha).expand_as(p).clone()
    true_bar.scatter_add_(1, clean[:, None], k * alpha)
    i = noisy[:, None]
    ti, mi = true_bar.gather(1, i), model_bar.gather(1, i)
    # sum over j of (x_j / x_i) * log((m_i x_j) / (m_j x_i)); the j = i term is zero
    ratio_terms = (true_bar / ti) * (mi.log() - model_bar.log() + true_bar.log() - ti.log())
    bracket = k / ti - k / mi - ratio_terms.sum(-1, keepdim=True)
    return (-1 / (k * alpha) * bracket).squeeze(-1)  # alpha'(t) = -1


def uniform_nelbo(predict, clean: torch.Tensor, valid: torch.Tensor, vocab_size: int, generators: Sequence[torch.Generator],
                  samples: int, eps: float = UNIFORM_EPS) -> torch.Tensor:
    """[B] unbiased Monte-Carlo estimate of each sequence's negative ELBO over its valid tokens:
    the integral over t in [eps, 1 - eps] of E_{z_t ~ q(. | x)} of the summed `uniform_nelbo_rate`,
    from `samples` stratified times per sequence (one uniform offset each), each with its own
    corrupted copy. `predict(noisy [B, N]) -> logits [B, N, K]`: the model's clean-token prediction."""
    b, n = clean.shape
    offsets = torch.stack([torch.rand((), generator=g) for g in generators])
    total = torch.zeros(b, dtype=torch.float64, device=clean.device)
    for m in range(samples):
        t = eps + (1 - 2 * eps) * (m + offsets) / samples
        noisy = uniform_corrupt(clean, t, vocab_size, generators)
        rate = uniform_nelbo_rate(predict(noisy).reshape(b * n, -1), noisy.reshape(-1), clean.reshape(-1),
                                  t.repeat_interleave(n).to(clean.device)).view(b, n)
        total = total + (rate * valid).sum(-1)
    return total * (1 - 2 * eps) / samples


def canvas_predictor(net, batch: CanvasBatch):
    """`predict` for `uniform_nelbo` over a batch's whole response: every canvas noisy at once, each
    given the prompt and the clean canvases before it (the encoder's cache), self-conditioning off."""
    b, s = batch.ids.shape
    clean, pos, block_start, attn = noisy_stream(batch, torch.arange(s - batch.prompt_len, device=batch.ids.device).expand(b, -1))

    def predict(noisy: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([batch.ids, noisy], dim=1)
        return net.logits(net(ids, clean, pos, block_start, attention_mask=attn)[:, s:])

    return predict

