"""One rank of tests/dare_core/sampling/test_lockstep.py (started by torchrun, gloo on the CPU).

For each family it decodes all prompts on one plain model (the one-rank result), then wraps the same
model in a ZeRO-3 engine, which partitions its MLP weights across the ranks, and decodes its share of
the prompts with threshold unmasking and stop ids, so the ranks' rows stop at different points: in
lockstep on the partitioned weights, then on the whole weights (`engine.rollout_weights`), then
partitioned again. It writes what it decoded, its rows' own step counts and how many forward passes
it made to <out>/rank<N>.json.
"""
import json
import sys
from pathlib import Path

import torch

from dare_core.config import LaunchConfig, OptimConfig
from dare_core.diffusion.seeding import sample_generators
from dare_core.models.family import get_family
from dare_core.models.lm import build_model
from dare_core.sampling.decode import SamplingParams, generate
from dare_core.sampling.lockstep import zero3_partitioned
from dare_core.training import engine as eng
from pipeline_helpers import end_gloo_rank
from tiny_models import EOS, MASK, SMALL, VOCAB

# MLPs above DeepSpeed's persistence threshold (1e5 elements), so ZeRO-3 partitions them and each
# forward gathers them from both ranks
WIDE_MLP = {"llada": {"mlp_hidden_size": 4096}, "sdar": {"intermediate_size": 4096}}
# of several lengths: SDAR's canvases then differ in their number of blocks from rank to rank
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16], [17, 18, 19], [20, 21, 22, 23, 24, 25]]
STOP_IDS = list(range(3, 33, 2))


def model_of(family: str):
    cfg = get_family(family).tiny_config(VOCAB, MASK, EOS, **{**SMALL[family], **WIDE_MLP[family]})
    torch.manual_seed(0)
    model = build_model(cfg)
    from dare_core.diffusion.seeding import generator

    model.net.init_weights(generator(0, family), std=0.3)
    return model.eval()


def decode(model, family: str, which: list[int]) -> dict:
    bs = model.block_size or 4
    params = SamplingParams(gen_length=16, steps=16, block_length=bs, temperature=0.7, unmasking="threshold",
                            threshold=0.05, stop_token_ids=STOP_IDS)
    out = generate(model, [PROMPTS[i] for i in which], params, generators=sample_generators((0, family), [str(i) for i in which]))
    return {str(i): {"response": out.response[k].tolist(), "steps": int(out.steps[k])} for k, i in enumerate(which)}


def main(out_dir: Path) -> None:
    eng.init_distributed()
    rank = eng.rank()
    result = {}
    for family in WIDE_MLP:
        model = model_of(family)
        alone = decode(model, family, list(range(len(PROMPTS))))
        # rank 0 takes the rows that finish in the fewest steps, rank 1 the rest: their stopping
        # points are as far apart as these prompts allow
        order = sorted(range(len(PROMPTS)), key=lambda i: alone[str(i)]["steps"])
        shares = (order[:len(order) // 2], order[len(order) // 2:])
        engine = eng.build_engine(model, OptimConfig(), 1, 1, launch=LaunchConfig(zero_stage=3))
        wrapped = engine.module
        forwards = [0]
        wrapped.net.layers[0].register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        partitioned = zero3_partitioned(wrapped) and any(p.ds_tensor.numel() < p.ds_numel for p in wrapped.parameters())
        mine = decode(wrapped, family, shares[rank])
        lockstep_forwards = forwards[0]
        # the RL loop's way: the whole weights gathered once, the per-layer gathers off, no lockstep
        with eng.rollout_weights(engine, LaunchConfig(zero_stage=3)):
            whole_partitioned = zero3_partitioned(wrapped)
            whole = decode(wrapped, family, shares[rank])
        whole_forwards = forwards[0] - lockstep_forwards
        # and after it the weights are partitioned again, their gathers back on (the lockstep's result)
        again = decode(wrapped, family, shares[rank])
        result[family] = {"alone": alone, "mine": mine, "forwards": lockstep_forwards, "partitioned": partitioned,
                          "whole": whole, "whole_forwards": whole_forwards, "whole_partitioned": whole_partitioned,
                          "again": again, "partitioned_again": zero3_partitioned(wrapped)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_gloo_rank()
