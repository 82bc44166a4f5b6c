"""The forward (masking) process, always drawn from explicit per-sample generators.

Layout everywhere: `input_ids` [B, P+L] = left-padded prompt (P) then the response canvas (L).
Only response positions inside `maskable` are ever masked and scored; the prompt is masked only by
the explicit prompt-noise regulariser of d1/SPG, and those positions are never scored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

EPS = 1e-3


@dataclass
class Corruption:
    """A corrupted copy of a batch that old, reference and current policy all score.

    noisy_ids: [B, S] input with MASK at corrupted positions.
    scored:    [B, S] bool, positions whose clean token is scored.
    p:         [B] masking probability of the response (1.0 for full-response masks).
    weight:    [B, S] optional per-position ELBO weight (1/p of the position's own law, e.g. a
               per-block p or coupled-GRPO's 1/t and 1/(1-t)); None means 1/p of the row.
    targets:   [B, S] optional clean tokens to score instead of the batch's (trajectory replay of
               tokens that the batch's layout overwrote, e.g. block diffusion's post-EOS latents).
    prompt_len: the batch's prompt width, where the family's scoring needs it (uniform noise: its
               canvases start at the response, not at multiples of the block size).
    scored_ids: [B, S] optional tokens whose log-probability a scored position reads, where they are
               not the clean tokens the model sees as context (a replayed step of an edited
               rollout wrote a token that a later edit replaced); None: the clean tokens.
    """

    noisy_ids: torch.Tensor
    scored: torch.Tensor
    p: torch.Tensor
    weight: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None
    prompt_len: Optional[int] = None
    scored_ids: Optional[torch.Tensor] = None

    def select(self, idx: torch.Tensor) -> "Corruption":
        pick = lambda t: None if t is None else t[idx.to(t.device)]  # noqa: E731
        return Corruption(pick(self.noisy_ids), pick(self.scored), pick(self.p), pick(self.weight), pick(self.targets),
                          self.prompt_len, pick(self.scored_ids))

    def elbo_weight(self) -> torch.Tensor:
        """[B, S] weight of each scored position in an ELBO sum (0 where not scored)."""
        w = self.weight if self.weight is not None else (1.0 / self.p.clamp_min(1e-12)).to(self.noisy_ids.device)[:, None].expand_as(self.scored)
        return torch.where(self.scored, w.float(), torch.zeros((), device=self.scored.device))


@dataclass
class CorruptionSet:
    """Several corrupted copies of one batch (Monte-Carlo rows, trajectory steps, AR positions),
    each a `Corruption` over the same B samples, plus per-sample tensors an estimator needs
    (`info`, batch dim first). Old, reference and current policy all see the same set."""

    rows: list
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, idx: torch.Tensor) -> "CorruptionSet":
        return CorruptionSet([r.select(idx) for r in self.rows], {k: v[idx.to(v.device)] for k, v in self.info.items()})

    @property
    def scored(self) -> torch.Tensor:
        """[B, S] positions scored by any row."""
        out = self.rows[0].scored.clone()
        for r in self.rows[1:]:
            out |= r.scored
        return out


def valid_region(response: torch.Tensor, eos_id: int, canvas: torch.Tensor | None = None) -> torch.Tensor:
    """V: response positions up to and including the first EOS (all of the canvas if none)."""
    is_eos = response == eos_id
    before_first = torch.cumsum(is_eos.long(), dim=1) - is_eos.long() == 0
    valid = before_first
    if canvas is not None:
        valid = valid & canvas.bool()
    return valid


def sample_mask_prob(generators: Sequence[torch.Generator], eps: float = EPS) -> torch.Tensor:
    """p = (1 - eps) t + eps with t ~ U(0, 1), one per sample (the LLaDA form of t ~ U(eps, 1))."""
    t = torch.stack([torch.rand((), generator=g) for g in generators])
    return (1 - eps) * t + eps


def bernoulli_mask(maskable: torch.Tensor, p: torch.Tensor, generators: Sequence[torch.Generator], at_least_one: bool = False) -> torch.Tensor:
    """Mask each maskable position independently with its row's probability p.

    at_least_one (block-diffusion SFT): a row that drew no mask gets one uniformly chosen position,
    so no packed sample contributes an empty loss."""
    u = torch.stack([torch.rand(maskable.shape[1], generator=g) for g in generators]).to(maskable.device)
    mask = (u < p.to(u.device)[:, None]) & maskable.bool()
    if at_least_one:
        for row, g in enumerate(generators):
            idx = maskable[row].nonzero().squeeze(-1)
            if idx.numel() and not mask[row].any():
                mask[row, idx[torch.randint(idx.numel(), (), generator=g)]] = True
    return mask


def prompt_noise_mask(real: torch.Tensor, p: float, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """The prompt-noise regulariser (d1, SPG): each real prompt token MASK with probability p. One
    draw per real token, in order, so the pattern does not depend on how much left padding the
    batch gave the prompt (docs/diffusion.md#seeding)."""
    out = torch.zeros_like(real, dtype=torch.bool)
    for row, g in enumerate(generators):
        idx = real[row].nonzero().squeeze(-1)
        out[row, idx] = (torch.rand(idx.numel(), generator=g) < p).to(out.device)
    return out


def count_mask(maskable: torch.Tensor, generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Law (b) of docs/diffusion.md#corruption-laws: l ~ U{1..n}, then a uniform random l-subset of the n maskable
    positions; returns the mask and p = l/n. Same ELBO as the Bernoulli law, but the weight 1/p is
    at most n instead of 1/eps: far less variance on short responses."""
    rows, probs = [], []
    for row, g in zip(maskable.bool(), generators):
        idx = row.nonzero().squeeze(-1)
        n = idx.numel()
        m = torch.zeros_like(row)
        if n == 0:
            rows.append(m)
            probs.append(torch.tensor(1.0))
            continue
        count = int(torch.randint(1, n + 1, (), generator=g))
        chosen = idx[torch.randperm(n, generator=g)[:count]]
        m[chosen] = True
        rows.append(m)
        probs.append(torch.tensor(count / n))
    return torch.stack(rows), torch.stack(probs).float()


def masked_corruption(input_ids: torch.Tensor, prompt_len: int, masked_resp: torch.Tensor, mask_id: int, p: torch.Tensor,
                      weight: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None) -> Corruption:
    """MASK the chosen response positions; they are the scored ones. `hidden` [B, L]: response
    positions also MASK but never scored (the EOS tail under tail_policy = mask, docs/diffusion.md#regions).
    `weight` [B, L]: per-position ELBO weight."""
    scored = torch.zeros_like(input_ids, dtype=torch.bool)
    scored[:, prompt_len:] = masked_resp
    masked = scored.clone()
    if hidden is not None:
        masked[:, prompt_len:] |= hidden.bool()
    noisy = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    full_weight = None
    if weight is not None:
        full_weight = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        full_weight[:, prompt_len:] = weight.float()
    return Corruption(noisy, scored, p, full_weight)


def response_corruption(
    input_ids: torch.Tensor,
    prompt_len: int,
    response_mask: torch.Tensor,
    mask_id: int,
    p: torch.Tensor,
    generators: Sequence[torch.Generator],
    at_least_one: bool = False,
) -> Corruption:
    """Random completion-only corruption (law (a) of docs/diffusion.md#corruption-laws): response positions in
    `response_mask` [B, L] are masked with probability p[b] and scored where masked."""
    return masked_corruption(input_ids, prompt_len, bernoulli_mask(response_mask, p, generators, at_least_one), mask_id, p)


def full_response_corruption(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    response_valid: torch.Tensor,
    mask_id: Optional[int],
    p_mask_prompt: float,
    generators: Sequence[torch.Generator],
    vocab_size: Optional[int] = None,
) -> Corruption:
    """d1's corruption: every response position MASK, each real prompt token MASK with p_mask_prompt.
    Under uniform noise (`mask_id` None) the noise is a token drawn uniformly from the `vocab_size`
    ids instead of MASK: the response is t = 1 of that process (`noise_tokens`).

    Only valid response positions are scored; noised prompt tokens never are."""
    prompt_real = attention_mask[:, :prompt_len].bool()
    if p_mask_prompt > 0:
        prompt_noise = prompt_noise_mask(prompt_real, p_mask_prompt, generators)
    else:
        prompt_noise = torch.zeros_like(prompt_real)
    noised = torch.cat([prompt_noise, torch.ones_like(input_ids[:, prompt_len:], dtype=torch.bool)], dim=1)
    noisy = noise_tokens(input_ids, noised, mask_id, vocab_size, generators)
    scored = torch.zeros_like(input_ids, dtype=torch.bool)
    scored[:, prompt_len:] = response_valid.bool()
    return Corruption(noisy, scored, torch.ones(input_ids.shape[0]), prompt_len=prompt_len)


def noise_tokens(input_ids: torch.Tensor, noised: torch.Tensor, mask_id: Optional[int], vocab_size: Optional[int],
                 generators: Sequence[torch.Generator]) -> torch.Tensor:
    """`input_ids` with the positions `noised` [B, S] replaced by MASK, or, without a mask token
    (uniform noise: `mask_id` None), by ids drawn uniformly from `vocab_size`, each row's from its
    generator, one draw per noised position in order."""
    if mask_id is not None:
        return torch.where(noised, torch.full_like(input_ids, mask_id), input_ids)
    if vocab_size is None:
        raise ValueError("uniform noise needs the vocabulary size")
    out = input_ids.clone()
    for row, g in enumerate(generators):
        idx = noised[row].nonzero().squeeze(-1)
        out[row, idx] = torch.randint(0, vocab_size, (idx.numel(),), generator=g).to(out.device)
    return out


def with_edit_noise(corruption: Corruption, prompt_len: int, response_mask: torch.Tensor, q: float, vocab_size: int,
                    mask_id: int, generators: Sequence[torch.Generator]) -> Corruption:
    """LLaDA2.1's token-to-token stream over a masked corruption (docs/diffusion.md#edit-noise): each
    response position of `response_mask` left unmasked is replaced, with probability `q`, by a token
    drawn uniformly from the vocabulary other than MASK, and scored with weight 1 (the model must
    give its clean token); the masked positions keep their ELBO weights. Each row's draws from its
    generator, over its response positions in order."""
    b, s = corruption.noisy_ids.shape
    weight = corruption.elbo_weight()
    noisy, scored = corruption.noisy_ids.clone(), corruption.scored.clone()
    visible = response_mask.bool() & (corruption.noisy_ids[:, prompt_len:] != mask_id)
    for row, g in enumerate(generators):
        n = response_mask.shape[1]
        hit = (torch.rand(n, generator=g) < q).to(visible.device) & visible[row]
        draw = torch.randint(0, vocab_size - 1, (n,), generator=g).to(noisy.device)
        draw = draw + (draw >= mask_id).long()  # (every id but MASK)
        cols = hit.nonzero().squeeze(-1) + prompt_len
        noisy[row, cols] = draw[hit]
        scored[row, cols] = True
        weight[row, cols] = 1.0
    return Corruption(noisy, scored, corruption.p, weight, corruption.targets, corruption.prompt_len, corruption.scored_ids)
