"""d-TreeRPO (docs/algorithms.md#d-tree-rpo): tree rollouts, leave-one-out local advantages, and a one-step
surrogate of every parent -> child transition.

Rollout (`sampling/tree.py`): per prompt a tree whose leaves are complete responses; the root's
`num_tree_samples` children and every later node's `branch_factor` children continue the
low-confidence sampler from their parent's state between the branch points {T - floor(kT/s)}.
Values: a leaf's is its reward, an internal node's the mean of its children's. Local advantage:
A(n) = V(n) - mean of V over n's siblings (0 for an only child).

Training rows are the transitions (parent state -> child state): the input is [prompt ; parent
state], the active tokens are MASK in the parent and not MASK in the child (from token states,
never from log-probabilities), their targets the child's tokens, the row's advantage A(child).
One forward on the parent state scores them:

  L = mean over transitions of -sum_active min(r A, clip(r) A) / |active|
      + kl_beta * the same aggregation of the KL estimator (k3 by default)
      + lambda * mean over (parent, j) of KL(q_parent,j || p_theta(. | parent, j))   (self-distillation)

with r = exp(s - s_old), s = log p_theta(child token | parent state) at `score_temperature`. The mean
over transitions counts the transitions of the whole mini-batch that have an active token (the
`denominator`), so the gradient does not depend on the micro-batch split.

Self-distillation, progress pi = step / rl.num_steps: lambda = lambda_max (e^{gamma pi} - 1)/(e^gamma - 1),
tau = max(tau_max (1 - pi)^beta_sd, 1e-6). For a parent and a position j active in at least one of its
children with A > 0, q(v) is proportional to the sum of softmax_k(A_k / tau) (over those positive
children k) of the children that put v at j. The (parent, j) terms are carried by the parent's first
child's row (any child's forward is the parent's), and averaged over all (parent, j) of the mini-batch.

Group size: rl.group_size must equal the leaves per prompt, num_tree_samples * branch_factor^(depth-1)
(the rollouts that are rewarded); num_tree_samples left unset is derived from rl.group_size; the loop's batch rows per prompt are the transitions
(`rows_per_prompt`, e.g. 20 for 16 leaves). rl.adv_estimator is not used: advantages are tree-local.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput, token_policy_loss, wants_entropy
from dare_core.algorithms.registry import register_rl
from dare_core.algorithms.rollout import RolloutSpec
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import entropy_of_logprobs, token_logprobs
from dare_core.diffusion.masking import Corruption, valid_region
from dare_core.rewards.grading import grade
from dare_core.sampling.decode import response_texts
from dare_core.sampling.engines import engines_with
from dare_core.sampling.rollout_engine import TreeRollouts
from dare_core.sampling.tree import TreeOutput, TreeShape, tree_shape
from dare_core.timing import phase

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- tree values


def node_values(shape: TreeShape, leaf_rewards: torch.Tensor) -> torch.Tensor:
    """V [B, N]: leaves get their reward ([B, n_leaves] in `shape.leaves` order), an internal node
    the mean of its children's values."""
    B = leaf_rewards.shape[0]
    values = torch.zeros(B, shape.num_nodes, dtype=torch.float32)
    values[:, shape.leaves] = leaf_rewards.float()
    children = _children(shape)
    for n in reversed(range(shape.num_nodes)):  # breadth-first numbering: children come after parents
        if children[n]:
            values[:, n] = values[:, children[n]].mean(-1)
    return values


def local_advantages(shape: TreeShape, values: torch.Tensor) -> torch.Tensor:
    """A [B, N]: A(n) = V(n) - mean over n's siblings m != n of V(m) (root and only children: 0)."""
    adv = torch.zeros_like(values)
    children = _children(shape)
    for n in shape.transitions:
        siblings = [m for m in children[shape.parent[n]] if m != n]
        if siblings:
            adv[:, n] = values[:, n] - values[:, siblings].mean(-1)
    return adv


def _children(shape: TreeShape) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(shape.num_nodes)]
    for n, p in enumerate(shape.parent):
        if p >= 0:
            out[p].append(n)
    return out


def active_set(parent_state: torch.Tensor, child_state: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The tokens a transition decided: MASK in the parent, not MASK in the child."""
    return (parent_state == mask_id) & (child_state != mask_id)


# --------------------------------------------------------------------------- self-distillation schedule


def sd_lambda(progress: float, lambda_max: float, gamma: float) -> float:
    """lambda = lambda_max (e^{gamma pi} - 1) / (e^gamma - 1); 0 at pi = 0, lambda_max at pi = 1."""
    pi = min(max(progress, 0.0), 1.0)
    if abs(gamma) < 1e-12:
        return lambda_max * pi
    return lambda_max * math.expm1(gamma * pi) / math.expm1(gamma)


def sd_tau(progress: float, tau_max: float, beta: float) -> float:
    """tau = max(tau_max (1 - pi)^beta, 1e-6)."""
    pi = min(max(progress, 0.0), 1.0)
    return max(tau_max * (1.0 - pi) ** beta, 1e-6)


def distill_targets(shape: TreeShape, states: torch.Tensor, adv: torch.Tensor, tau: float, mask_id: int
                    ) -> list[tuple[int, int, int, dict]]:
    """(prompt b, carrier child node, position j, q as {token: prob}) for every parent and position
    j active in at least one of its positive-advantage children; the carrier is the parent's first
    child (its transition row holds the parent's forward)."""
    out = []
    children = _children(shape)
    for b in range(states.shape[0]):
        for p, kids in enumerate(children):
            positive = [k for k in kids if adv[b, k] > 0]
            if not positive:
                continue
            w = torch.softmax(torch.stack([adv[b, k] for k in positive]).double() / tau, 0)
            parent = states[b, p]
            for j in (parent == mask_id).nonzero().squeeze(-1).tolist():
                q: dict = {}
                for k, wk in zip(positive, w.tolist()):
                    tok = int(states[b, k, j])
                    if tok != mask_id:
                        q[tok] = q.get(tok, 0.0) + wk
                if q:
                    total = sum(q.values())
                    out.append((b, kids[0], j, {t: v / total for t, v in q.items()}))
    return out


# --------------------------------------------------------------------------- the algorithm


@register_rl("d_tree_rpo")
class DTreeRPO(RLAlgorithm):
    families = frozenset({"masked"})
    # the distillation term reads whole log-softmax rows of `scored_logits`, not token_logprobs' scores
    sequence_parallel = False
    requires = frozenset({"tree"})
    refuses_editing = ("its tree resumes decoding from the states at its branch points, and a block's post-edit "
                       "count and editable positions are not part of such a state")

    @dataclass
    class Options:
        # children of the root; None: rl.group_size / branch_factor^(depth-1), so the leaves are the group
        num_tree_samples: Optional[int] = None
        branch_factor: int = 4  # children of every later internal node
        contraction: int = 2  # s: branch points {T - floor(kT/s)}
        # time-scheduled self-distillation toward the positive-advantage children
        self_distill: bool = True
        sd_lambda_max: float = 3e-3
        sd_gamma: float = 2.0
        sd_tau_max: float = 2.0
        sd_beta: float = 0.7
        # the policy's distribution that the ratio, the KL and the distillation use: softmax(logits / T)
        score_temperature: float = 1.0
        # the paper's loss is the plain PPO clip; true applies rl.dual_clip for A < 0 as well
        dual_clip: bool = False

    def check_sampler(self, sampler) -> None:
        o = self.options
        if o.branch_factor < 1 or o.contraction < 1:
            raise ValueError("d_tree_rpo needs branch_factor >= 1 and contraction >= 1")
        if o.num_tree_samples is None:
            per_root = len(tree_shape(sampler.steps, o.contraction, 1, o.branch_factor).leaves)
            if self.rl.group_size % per_root:
                raise ValueError(f"d_tree_rpo: rl.group_size {self.rl.group_size} is not a whole number of root subtrees of "
                                 f"{per_root} leaves (branch_factor {o.branch_factor}, {sampler.steps} steps, contraction "
                                 f"{o.contraction}); set rl.group_size to a multiple of {per_root} or num_tree_samples")
            if self.rl.group_size < 2 * per_root:
                raise ValueError(f"d_tree_rpo needs >= 2 root subtrees (sibling baselines) of {per_root} leaves: set "
                                 f"rl.group_size to {2 * per_root} or more (got {self.rl.group_size})")
            o = self.options = dataclasses.replace(o, num_tree_samples=self.rl.group_size // per_root)
        if o.num_tree_samples < 2:
            raise ValueError("d_tree_rpo needs num_tree_samples >= 2 (sibling baselines)")
        if o.score_temperature <= 0:
            raise ValueError("d_tree_rpo: score_temperature must be > 0")
        problems = []
        tree_engines = engines_with("tree_rollouts")
        if sampler.engine not in tree_engines:
            problems.append(f"engine: {' or '.join(tree_engines)} (an engine with tree rollouts: the tree resumes the "
                            "denoising loop from its parents' states)")
        if sampler.cache != "none":
            problems.append("cache: none")
        if sampler.unmasking not in ("topk", "sequential"):
            problems.append("unmasking: topk (a count schedule whose steps can be split between branch points)")
        if problems:
            raise ValueError("rl.algorithm d_tree_rpo needs rl.sampler " + "; ".join(problems))
        self.shape = tree_shape(sampler.steps, o.contraction, o.num_tree_samples, o.branch_factor)
        leaves = len(self.shape.leaves)
        if self.rl.group_size != leaves:
            raise ValueError(
                f"rl.group_size must equal the leaves per prompt of the d_tree_rpo tree: {leaves} "
                f"(num_tree_samples {o.num_tree_samples} x branch_factor {o.branch_factor}^{self.shape.depth - 1}, "
                f"branch points {list(self.shape.branch_points)} of {sampler.steps} steps); set rl.group_size: {leaves}")
        self.loss_rl = self.rl if o.dual_clip else dataclasses.replace(self.rl, dual_clip=0.0)

    @property
    def rows_per_prompt(self) -> int:
        return len(self.shape.transitions)

    # ------------------------------------------------------------------ rollout

    def rollout(self, engine: TreeRollouts, tokenizer, rows: list, spec: RolloutSpec) -> tuple[Batch, dict]:
        model = engine.model
        prompts = [tokenizer.encode(r["prompt_text"]) for r in rows]
        uids = [str(r["uid"]) for r in rows]
        t0 = time.time()
        tree = engine.generate_tree(prompts, spec.params, self.shape, (spec.seed, "tree_rollout", spec.step), uids,
                                    spec.params.batch_size)
        rollout_s = time.time() - t0
        n_leaves = len(self.shape.leaves)
        leaves = tree.responses.reshape(-1, tree.responses.shape[-1])
        texts = response_texts(tokenizer, leaves)
        with phase("reward"):  # time/reward_s, as for the default rollout (not charged to the rollout)
            graded = grade([r for r in rows for _ in range(n_leaves)], texts, spec.reward, spec.reward_args, spec.errors_allowed)
        rewards = graded.rewards.view(len(rows), n_leaves)
        batch, info = self.transition_batch(tree, prompts, uids, rewards, spec.step / max(self.rl.num_steps, 1),
                                            model.pad_token_id, next(model.parameters()).device)
        valid = valid_region(leaves, model.eos_token_id)
        metrics = {
            "rollout_steps": tree.steps.float().mean().item(),
            "rollout_tokens_per_s": float(tree.responses.numel()) / max(rollout_s, 1e-9),
            **graded.metrics,
            "response_tokens": valid.sum(-1).float().mean().item(),
            "rollout_nfe": tree.nfe,
            "zero_std_ratio": (rewards.std(-1) == 0).float().mean().item(),
            "reward_std": rewards.std(-1).mean().item(),
            **info,
        }
        return batch, metrics

    def transition_batch(self, tree: TreeOutput, prompts: list, uids: list, leaf_rewards: torch.Tensor, progress: float,
                         pad_id: int, device="cpu") -> tuple[Batch, dict]:
        """The training batch of a tree rollout: one row per (prompt, transition), prompt by prompt
        (token tensors on `device`, records on the CPU)."""
        shape, states, mask_id = tree.shape, tree.states, self.mask_id
        values = node_values(shape, leaf_rewards)
        adv = local_advantages(shape, values)
        B, N, L = states.shape
        width = max(len(p) for p in prompts)
        kids = shape.transitions
        R = B * len(kids)
        prompt_ids = torch.full((B, width), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((B, width), dtype=torch.long)
        for b, p in enumerate(prompts):
            prompt_ids[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            prompt_mask[b, width - len(p):] = 1
        rows_b = torch.arange(B).repeat_interleave(len(kids))
        child = torch.tensor(kids).repeat(B)
        parent = torch.tensor([shape.parent[n] for n in kids]).repeat(B)
        child_state, parent_state = states[rows_b, child], states[rows_b, parent]
        input_ids = torch.cat([prompt_ids[rows_b], child_state], 1)
        attention_mask = torch.cat([prompt_mask[rows_b], torch.ones_like(child_state)], 1)
        active = active_set(parent_state, child_state, mask_id)

        # self-distillation targets, carried by each parent's first child's row
        lam = sd_lambda(progress, self.options.sd_lambda_max, self.options.sd_gamma) if self.options.self_distill else 0.0
        width_q = max(self.options.num_tree_samples, self.options.branch_factor)
        sd_tokens = torch.zeros((R, L, width_q), dtype=torch.long)
        sd_probs = torch.zeros((R, L, width_q), dtype=torch.float32)
        if lam > 0:
            tau = sd_tau(progress, self.options.sd_tau_max, self.options.sd_beta)
            row_of = {n: i for i, n in enumerate(kids)}
            for b, carrier, j, q in distill_targets(shape, states, adv, tau, mask_id):
                r = b * len(kids) + row_of[carrier]
                for c, (tok, prob) in enumerate(sorted(q.items())):
                    sd_tokens[r, j, c], sd_probs[r, j, c] = tok, prob
        records = {
            "parent_state": parent_state, "node": child, "parent": parent,
            "sd_tokens": sd_tokens, "sd_probs": sd_probs, "sd_lambda": torch.full((R,), lam),
        }
        batch = Batch(input_ids.to(device), attention_mask.to(device), width, active.to(device),
                      [f"{uids[b]}/n{n}" for b, n in zip(rows_b.tolist(), child.tolist())], adv[rows_b, child], records)
        info = {
            "tree_transitions": float(len(kids)),
            "tree_leaves": float(len(shape.leaves)),
            "active_tokens": active.sum(-1).float().mean().item(),
            "adv_abs": adv[:, kids].abs().mean().item(),
            "sd_lambda": lam,
            "sd_pairs": float((sd_probs.sum(-1) > 0).sum()),
        }
        return batch, info

    # ------------------------------------------------------------------ estimator

    def corrupt(self, batch: Batch, seed_base: tuple) -> Corruption:
        """The transitions' own states (nothing random): input [prompt ; parent state], scoring the
        active tokens against the child's."""
        P = batch.prompt_len
        parent = batch.records["parent_state"].to(batch.input_ids.device)
        noisy = torch.cat([batch.input_ids[:, :P], parent], 1)
        scored = torch.zeros_like(batch.input_ids, dtype=torch.bool)
        scored[:, P:] = active_set(parent, batch.input_ids[:, P:], self.mask_id)
        return Corruption(noisy, scored, torch.ones(len(batch)))

    def score(self, model, batch: Batch, corruption: Corruption) -> torch.Tensor:
        return token_logprobs(model, corruption, batch.input_ids, batch.attention_mask, self.options.score_temperature)

    def denominator(self, batch: Batch, corruption: Corruption) -> torch.Tensor:
        """[transitions with an active token, (parent, j) distillation pairs] of this part."""
        transitions = float(corruption.scored.any(-1).sum())
        pairs = float((batch.records["sd_probs"].sum(-1) > 0).sum())
        return torch.tensor([transitions, pairs], dtype=torch.float64)

    def update(self, model, batch: Batch, corruption: Corruption, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        P = batch.prompt_len
        active = corruption.scored
        dev = active.device
        sd_probs = batch.records["sd_probs"].to(dev)
        sd_resp = sd_probs.sum(-1) > 0
        sd_pos = torch.zeros_like(active)
        sd_pos[:, P:] = sd_resp
        need = active | sd_pos
        # one forward on the parent states; log-softmax only at the positions used
        logits = model.scored_logits(corruption.noisy_ids, batch.attention_mask, need).float() / self.options.score_temperature
        logp = torch.log_softmax(logits, -1)
        index = torch.full(need.shape, -1, dtype=torch.long, device=dev)
        index[need] = torch.arange(int(need.sum()), device=dev)
        s = torch.zeros(active.shape, dtype=torch.float32, device=dev)
        s = s.masked_scatter(active, logp[index[active]].gather(-1, batch.input_ids[active][:, None]).squeeze(-1))

        entropy = None
        if wants_entropy(self.rl):  # of the tempered distribution the ratio uses, at the active tokens
            entropy = torch.zeros(active.shape, dtype=torch.float32, device=dev).masked_scatter(
                active, entropy_of_logprobs(logp)[index[active]])

        weight = active.float() / active.sum(-1, keepdim=True).clamp_min(1)
        adv = batch.advantages.float().to(dev)[:, None]
        loss, metrics = token_policy_loss(s, old, ref, adv, weight, float(denom[0]), self.loss_rl, entropy)

        if bool(sd_resp.any()):
            tokens = batch.records["sd_tokens"].to(dev)[sd_resp]  # [n, C]
            q = sd_probs[sd_resp]
            lp = logp[index[sd_pos]].gather(-1, tokens)
            kl = torch.where(q > 0, q * (torch.log(q.clamp_min(1e-30)) - lp), torch.zeros_like(lp)).sum(-1)  # KL(q || p) per pair
            lam = batch.records["sd_lambda"].to(dev).float()[:, None].expand_as(sd_resp)[sd_resp]
            loss = loss + (lam * kl).sum() / max(float(denom[1]), 1.0)
            metrics["sd_kl"] = float(kl.detach().mean())
        backward(loss)
        return LossOutput(loss.detach(), metrics)
