"""One rank of tests/dare_core/models/test_sequence_parallel.py (started by torchrun, gloo on the CPU).

Both ranks form one sequence-parallel group. For each case (a family and an attention layout) a rank
runs the one-rank forward and backward of the whole batch, then the sequence-parallel one over its
half of every sequence, gathers the logits of the whole sequence and sums the parameter gradients
over the group; rank 0 writes the largest differences to <out>/errors.json.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dare_core.diffusion.block import two_stream_mask
from dare_core.diffusion.seeding import generator
from dare_core.models.attention import packed_context
from dare_core.models.family import get_family
from dare_core.models.lm import build_model
from dare_core.models.sequence_parallel import shard_hidden_states
from dare_core.models.transformer import default_position_ids
from dare_core.models.ulysses import SequenceShards, gather_sequence
from pipeline_helpers import end_gloo_rank
from tiny_models import EOS, MASK, SMALL, VOCAB

SEQ = 12  # 6 tokens a rank: SDAR's blocks of 4 straddle the ranks' halves
# key/value heads a multiple of the 2 ranks (the tiny LLaDA has 1)
HEADS = {"llada": {"n_kv_heads": 2}, "sdar": {}}


def model_of(family: str):
    cfg = get_family(family).tiny_config(VOCAB, MASK, EOS, **{**SMALL[family], **HEADS[family]})
    model = build_model(cfg)
    model.net.init_weights(generator(0, family), std=0.3)
    return model.train()


def batch():
    """Two rows of SEQ tokens, the second left-padded by 3."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator(1, "ids"))
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, :3] = 0
    return ids, attention_mask


def layouts(model, ids, attention_mask):
    """name -> (input_ids, keyword arguments of shard_hidden_states) of every layout the family has."""
    cases = {"padded": (ids, {"attention_mask": attention_mask})}
    if model.block_size is not None:
        pos = default_position_ids(ids, attention_mask)
        clean = torch.randint(0, VOCAB, ids.shape, generator=generator(2, "clean"))
        cases["two_stream"] = (torch.cat([ids, clean], dim=1),
                               {"position_ids": pos.repeat(1, 2), "attn_mask": two_stream_mask(pos, model.block_size, attention_mask)})
    lens = [7, 5, 4]  # three documents packed in one row of 16
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cases["packed"] = (ids.reshape(-1)[None, :sum(lens)],
                       {"position_ids": pos, "attn_mask": packed_context(lens, "sdpa", "cpu", model.block_size, pos[0])})
    return cases


def grads_after(model, logits, weights):
    model.zero_grad()
    (logits * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def compare(model, ids, kwargs, shards) -> dict:
    alone = model.net.lm_head(model.hidden_states(ids, **kwargs))
    weights = torch.randn(alone.shape, generator=generator(3, "weights"))
    alone_grads = grads_after(model, alone, weights)
    local = model.net.lm_head(shard_hidden_states(model, ids, shards, **kwargs))
    assert local.shape[1] == ids.shape[1] // shards.size
    logits = gather_sequence(local, shards)
    grads = grads_after(model, logits, weights)
    for g in grads.values():
        dist.all_reduce(g, group=shards.group)
    return {"logits": (logits - alone).abs().max().item(), "logit_scale": alone.abs().max().item(),
            "grads": max((grads[n] - alone_grads[n]).abs().max().item() for n in grads),
            "grad_scale": max(g.abs().max().item() for g in alone_grads.values())}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    shards = SequenceShards.of()
    ids, attention_mask = batch()
    errors = {}
    for family in HEADS:
        model = model_of(family)
        for name, (case_ids, kwargs) in layouts(model, ids, attention_mask).items():
            errors[f"{family}/{name}"] = compare(model, case_ids, kwargs, shards)
    try:  # the refusal of a sequence the ranks cannot split evenly
        shard_hidden_states(model_of("llada"), ids[:, :SEQ - 1], shards)
        errors["odd_length_refused"] = ""
    except ValueError as e:
        errors["odd_length_refused"] = str(e)
    if dist.get_rank() == 0:
        (out_dir / "errors.json").write_text(json.dumps(errors, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_gloo_rank()
