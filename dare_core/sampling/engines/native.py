"""The `native` rollout engine: our own denoising loop (`sampling/decode.py`) on the training model itself."""
from __future__ import annotations

from typing import Sequence

from dare_core.sampling.decode import GenerationOutput, generate
from dare_core.sampling.engines import ENGINES
from dare_core.sampling.params import SamplingParams
from dare_core.sampling.tree import TreeOutput, TreeShape, tree_rollout


@ENGINES.register("native")
class NativeEngine:
    """Decodes with the training model itself, so its weights are always current."""

    name = "native"
    tree_rollouts = True  # the loop resumes from any parent's state (`decode.denoise_range`)
    decodes_policy = True

    def __init__(self, model, **_: object):
        self.model = model

    def generate(self, prompts, params, generators=None, record="none") -> GenerationOutput:
        return generate(self.model, prompts, params, generators=generators, record=record)

    def generate_tree(self, prompts: Sequence[Sequence[int]], params: SamplingParams, shape: TreeShape, seed_base: tuple,
                      uids: Sequence[str], batch_size: int) -> TreeOutput:
        """Tree rollouts (`sampling/tree.py`): the model decodes in eval mode and is left in the
        train/eval mode it came in."""
        was_training = self.model.training
        self.model.eval()
        try:
            return tree_rollout(self.model, prompts, params, shape, seed_base, uids, batch_size)
        finally:
            self.model.train(was_training)

    def update_weights(self, model) -> None:
        self.model = model

    def close(self) -> None:
        pass
