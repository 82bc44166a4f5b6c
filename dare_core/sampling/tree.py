"""Tree-structured rollouts (d-TreeRPO, docs/algorithms.md#d-tree-rpo and docs/sampling.md#rollout-records).

With `T` denoising steps and a contraction factor `s`, the branch points (in remaining steps) are
`{T - floor(k T / s) : k = 0..s}`, de-duplicated and descending, e.g. [128, 64, 0]. Level d of the
tree holds the states after the global steps [0, T - bp[d]); the root (level 0) is the all-MASK
canvas. The root has `num_tree_samples` children, every later internal node `branch_factor`, and a
child continues its parent's state through the steps between the two branch points with the one
denoising loop (`decode.denoise_range`) and a generator of its own, seeded
from (run seed, step, prompt uid, node index): children of one parent draw differently, and a path
from the root to a leaf commits what one uninterrupted run with those draws would.

Nodes are numbered breadth first (root 0); `parent[n]` is n's parent (-1 for the root). The record
of a rollout is every node's state at its branch point, the parent indices and the leaf list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dare_core.diffusion.seeding import generator
from dare_core.sampling.decode import denoise_range
from dare_core.sampling.params import SamplingParams


def branch_points(total_steps: int, contraction: int) -> list[int]:
    """Remaining-step counts at which the tree branches, descending, from T down to 0."""
    if total_steps < 1 or contraction < 1:
        raise ValueError("the tree needs total_steps >= 1 and contraction >= 1")
    return sorted({total_steps - (k * total_steps) // contraction for k in range(contraction + 1)}, reverse=True)


@dataclass(frozen=True)
class TreeShape:
    total_steps: int
    branch_points: tuple  # remaining steps, descending, T .. 0
    parent: tuple  # parent node of every node, -1 for the root (node 0)
    level: tuple  # depth of every node (root 0, leaves len(branch_points) - 1)

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def depth(self) -> int:
        return len(self.branch_points) - 1

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Global step range [j0, j1) that the children at level d = 1..depth run (index d - 1)."""
        T, bp = self.total_steps, self.branch_points
        return [(T - bp[d - 1], T - bp[d]) for d in range(1, len(bp))]

    def nodes_at(self, level: int) -> list[int]:
        return [n for n, lv in enumerate(self.level) if lv == level]

    @property
    def leaves(self) -> list[int]:
        return self.nodes_at(self.depth)

    @property
    def transitions(self) -> list[int]:
        """Child node of every (parent -> child) transition: every node but the root."""
        return list(range(1, self.num_nodes))

    def children(self, node: int) -> list[int]:
        return [n for n, p in enumerate(self.parent) if p == node]


def tree_shape(total_steps: int, contraction: int, num_tree_samples: int, branch_factor: int) -> TreeShape:
    """The tree of one prompt: no model needed (e.g. (128, 2, 4, 4): 16 leaves, 20 transitions)."""
    if num_tree_samples < 1 or branch_factor < 1:
        raise ValueError("num_tree_samples and branch_factor must be >= 1")
    bp = branch_points(total_steps, contraction)
    parent, level = [-1], [0]
    frontier = [0]
    for d in range(1, len(bp)):
        width = num_tree_samples if d == 1 else branch_factor
        nxt = []
        for p in frontier:
            for _ in range(width):
                parent.append(p)
                level.append(d)
                nxt.append(len(parent) - 1)
        frontier = nxt
    return TreeShape(total_steps, tuple(bp), tuple(parent), tuple(level))


@dataclass
class TreeOutput:
    """The tree rollouts of B prompts (6.5): node states, parent indices (`shape.parent`), leaves."""

    shape: TreeShape
    states: torch.Tensor  # [B, N, L] each node's response state at its branch point (MASK = undecoded; root all MASK)
    responses: torch.Tensor  # [B, n_leaves, L] the leaves' final responses (after the first stop: EOS), leaf order
    nfe: int
    steps: torch.Tensor  # [B, n_leaves] denoising steps taken on each root -> leaf path

    @property
    def leaves(self) -> list[int]:
        return self.shape.leaves


def tree_rollout(model, prompts: Sequence[Sequence[int]], params: SamplingParams, shape: TreeShape, seed_base: tuple,
                 uids: Sequence[str], batch_size: int, device: Optional[torch.device] = None) -> TreeOutput:
    """Grow `shape` for every prompt, level by level: the children of one level (all prompts) decode
    together in chunks of `batch_size`, each from its parent's state."""
    if shape.total_steps != params.steps:
        raise ValueError(f"the tree is built for {shape.total_steps} steps but the sampler takes {params.steps}")
    if device is None:
        device = next(model.parameters()).device
    B, N, L = len(prompts), shape.num_nodes, params.gen_length
    states = torch.full((B, N, L), model.mask_token_id, dtype=torch.long)
    leaf_pos = {n: i for i, n in enumerate(shape.leaves)}
    responses = torch.full((B, len(leaf_pos), L), model.eos_token_id, dtype=torch.long)
    node_steps = torch.zeros(B, N, dtype=torch.long)
    nfe = 0
    for d, (j0, j1) in enumerate(shape.segments, start=1):
        jobs = [(b, n) for b in range(B) for n in shape.nodes_at(d)]
        for o in range(0, len(jobs), max(1, batch_size)):
            chunk = jobs[o:o + max(1, batch_size)]
            init = torch.stack([states[b, shape.parent[n]] for b, n in chunk])
            gens = [generator(*seed_base, uids[b], f"node{n}", device=device) for b, n in chunk]
            out = denoise_range(model, [prompts[b] for b, _ in chunk], params, init, (j0, j1), generators=gens)
            nfe += out.nfe
            state = out.trajectory.response_tokens(L).cpu()
            for i, (b, n) in enumerate(chunk):
                states[b, n] = state[i]
                node_steps[b, n] = node_steps[b, shape.parent[n]] + int(out.steps[i])
                if n in leaf_pos:
                    responses[b, leaf_pos[n]] = out.response[i].cpu()
    return TreeOutput(shape, states, responses, nfe, node_steps[:, shape.leaves])
