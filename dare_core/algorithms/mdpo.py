"""MDPO (docs/algorithms.md#mdpo): reward the completion the model predicted at every denoising step, turn
the per-step rewards into step advantages, and train on the steps whose advantages matter most.

For step t (1..K) of a cache-free rollout the record holds the state z_t, the predicted completion
x0_t (proposals at the positions masked in z_t, current tokens elsewhere) and the confidences c_t:
  sigma_t = (r_t - r_{t-1}) + 1 + mean_{t' > t} r_t'   (r_0 = 0; sigma_K = (r_K - r_{K-1}) + 1 + r_K),
  A_t = GRPO normalisation of sigma_t across the group, for each t separately;
the top `sample_train_steps` steps by sum over the batch of |A_t| are trained with
  l = lambda_t max(-A r, -A clip(r)) + kl_beta KL(s, s_ref),  lambda_t = L_max / |M_t|,
  L_t = sum l c_t 1[M_t] / sum 1[M_t]  (over the mini-batch),  L = mean over the selected steps,
where s = log p(x0_t,i | z_t, i) at the rollout temperature and M_t the positions masked in z_t
that the step proposed for, inside the final response's valid region V. Under token editing z_t holds
each position's token as of step t (earlier edits included); edits are not scored: the objective
rewards what each step predicted at its masked positions (docs/algorithms.md#edited-rollouts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput
from dare_core.batch import Batch
from dare_core.algorithms.common import (ADVANTAGES, kl_estimate, ppo_clip, ratio_max, replay_temperature,
                                        wants_entropy, weighted_mean_metrics)
from dare_core.algorithms.registry import register_rl
from dare_core.diffusion.likelihood import rows_logprobs, separable_backward
from dare_core.diffusion.masking import Corruption, CorruptionSet
from dare_core.diffusion.replay import WriteHistory
from dare_core.metric_keys import add_chunk_metrics


def step_scores(rewards: torch.Tensor) -> torch.Tensor:
    """sigma_t of 5.7 for per-step rewards [..., K]."""
    K = rewards.shape[-1]
    prev = torch.cat([torch.zeros_like(rewards[..., :1]), rewards[..., :-1]], -1)
    rev = rewards.flip(-1).cumsum(-1).flip(-1)  # sum_{t' >= t}
    later = torch.zeros_like(rewards)
    counts = torch.arange(K - 1, 0, -1, dtype=rewards.dtype, device=rewards.device)
    later[..., :-1] = (rev[..., 1:]) / counts
    later[..., -1] = rewards[..., -1]
    return (rewards - prev) + 1 + later


def step_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo") -> torch.Tensor:
    """A_t [N, K]: the group normalisation of sigma_t across each group's G rollouts, per step
    (a group whose sigma_t has no variance gets 0)."""
    sigma = step_scores(rewards)
    N, K = sigma.shape
    g = sigma.view(N // group_size, group_size, K).transpose(1, 2)  # [groups, K, G]
    adv = ADVANTAGES.lookup(estimator)(g)
    adv = torch.where(g.std(-1, keepdim=True) == 0, torch.zeros_like(adv), adv)
    return adv.transpose(1, 2).reshape(N, K)


def select_steps(adv: torch.Tensor, k: int) -> torch.Tensor:
    """The k steps with the largest sum over the batch of |A_t| (ascending step order)."""
    score = adv.abs().sum(0)
    k = min(k, score.numel())
    return score.topk(k).indices.sort().values


@register_rl("mdpo")
class MDPO(RLAlgorithm):
    families = frozenset({"masked"})
    requires = frozenset({"step_map", "decoded", "x0_hat", "confidence"})

    @dataclass
    class Options:
        sample_train_steps: int = 8  # the MDPO README's paper setting
        # null: the rollout's temperature (1 for greedy rollouts)
        score_temperature: Optional[float] = None

    def check_sampler(self, sampler) -> None:
        if sampler.cache != "none":
            raise ValueError("mdpo needs a cache-free rollout (rl.sampler.cache: none): it replays every step's state")
        self.temperature = replay_temperature(sampler, self.options.score_temperature)
        self.gen_length = sampler.gen_length

    def _states(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z_t and x0_t response tokens [B, K, L] and the scored positions M_t [B, K, L]."""
        history = WriteHistory.of_rollout_records(batch.records)
        x0 = batch.records["x0_hat"].long()
        K = x0.shape[1]
        # (under token editing the states hold each position's token as of that step)
        z = torch.stack([history.state_before(t, self.mask_id) for t in range(1, K + 1)], 1).to(x0)
        known = z != self.mask_id
        proposed = ~known & (x0 >= 0)
        x0_t = torch.where(proposed, x0, z)
        scored = proposed & batch.response_mask.bool().cpu()[:, None, :]
        return z, x0_t, scored

    def prepare(self, batch: Batch, context) -> dict:
        _, x0_t, _ = self._states(batch)
        B, K, L = x0_t.shape
        rewards = context.rewards([b for b in range(B) for _ in range(K)], x0_t.reshape(B * K, L)).view(B, K)
        # a row that finished in fewer steps than K keeps its final completion from then on
        num = WriteHistory.of_rollout_records(batch.records).last_step().clamp_min(1).long()
        last = rewards.gather(1, (num - 1)[:, None])
        rewards = torch.where(torch.arange(K)[None] < num[:, None], rewards, last)
        adv = step_advantages(rewards, self.rl.group_size, self.rl.adv_estimator)
        chosen = select_steps(adv, self.options.sample_train_steps)
        batch.records["step_adv"] = adv[:, chosen]
        batch.records["steps_chosen"] = chosen[None].expand(B, -1).clone()
        return {"step_reward_first": float(rewards[:, 0].mean()), "step_reward_last": float(rewards[:, -1].mean())}

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        z, x0_t, scored = self._states(batch)
        P = batch.prompt_len
        dev = batch.input_ids.device
        rows, conf = [], []
        confidence = torch.nan_to_num(batch.records["confidence"].float(), nan=0.0, neginf=0.0, posinf=0.0)
        for t in batch.records["steps_chosen"][0].tolist():
            noisy, target = batch.input_ids.clone(), batch.input_ids.clone()
            noisy[:, P:], target[:, P:] = z[:, t].to(dev), x0_t[:, t].to(dev)
            sc = torch.zeros_like(noisy, dtype=torch.bool)
            sc[:, P:] = scored[:, t].to(dev)
            rows.append(Corruption(noisy, sc, torch.ones(len(batch)), None, target))
            conf.append(confidence[:, t])
        return CorruptionSet(rows, {"confidence": torch.stack(conf, 1) if conf else torch.zeros(len(batch), 0, z.shape[-1])})

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        """[B, k, S] token scores of every selected step."""
        return rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask, self.temperature).transpose(0, 1)

    def denominator(self, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        return torch.tensor([float(r.scored.sum()) for r in corruption.rows], dtype=torch.float64)

    def update(self, model, batch: Batch, corruption: CorruptionSet, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        P = batch.prompt_len
        adv_all = batch.records["step_adv"].float()
        conf_all = corruption.info["confidence"].float()
        used = max(int((denom > 0).sum()), 1)
        with_entropy = wants_entropy(self.rl)

        def chunk_loss(idx):
            rows = [corruption.rows[i] for i in idx]
            s = rows_logprobs(model, rows, batch.input_ids, batch.attention_mask, self.temperature, entropy=with_entropy)
            s, h = s if with_entropy else (s, None)  # [r, B, S] each
            loss, metrics = s.new_zeros(()), {}
            for j, i in enumerate(idx):
                mask = rows[j].scored.float()
                if float(denom[i]) == 0:
                    continue
                cnt = mask.sum(-1, keepdim=True)
                lam = torch.where(cnt > 0, self.gen_length / cnt.clamp_min(1), torch.zeros_like(cnt))
                c = torch.zeros_like(mask)
                c[:, P:] = conf_all[:, i].to(c)
                st = s[j]
                o = old[:, i].to(st) if old is not None else st.detach()
                per_token, clip = ppo_clip(st - o, adv_all[:, i:i + 1].to(st), self.rl.clip_eps_low, self.rl.clip_eps_high, self.rl.dual_clip)
                term = lam * per_token
                if self.rl.kl_beta > 0 and ref is not None:
                    term = term + self.rl.kl_beta * kl_estimate(st, ref[:, i].to(st), self.rl.kl_estimator)
                if h is not None:  # the entropy bonus, aggregated like the KL term (c 1[M_t] / |M_t|)
                    term = term - self.rl.entropy_coeff * h[j]
                    h_mean = weighted_mean_metrics({"h": h[j].detach()}, mask)["h"]
                    metrics["entropy"] = metrics.get("entropy", 0.0) + h_mean / len(corruption)
                loss = loss + (term * c * mask).sum() / float(denom[i]) / used
                add_chunk_metrics(metrics, {k: v / len(corruption) for k, v in weighted_mean_metrics(clip, mask).items()})
                add_chunk_metrics(metrics, {"ratio_max": ratio_max(clip, mask)})
            return loss, metrics

        loss, metrics = separable_backward(corruption, self.rows_per_forward, chunk_loss, backward)
        return LossOutput(torch.tensor(loss), metrics)
