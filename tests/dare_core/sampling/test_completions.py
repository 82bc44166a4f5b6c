"""sampling/completions.generate's shares: ranks that decode one list of prompts together, each a
contiguous share, end with the outputs one rank decoding them all makes."""
import threading

import pytest
import torch

from conftest import make_tiny_llada
from dare_core.models.tokenizer import build_char_tokenizer
from dare_core.sampling.completions import DecodeShare, generate
from dare_core.sampling.engines import build_engine
from dare_core.sampling.params import SamplingParams


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shares_partition_the_prompts_in_order(size):
    for n in range(10):
        bounds = [DecodeShare(r, size, list).bounds(n) for r in range(size)]
        assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(n))
        assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


def _group_gather(size: int):
    """`size` threads' gather over one barrier: each thread's list in, all of them out, in rank order
    (what a process group's all_gather_object gives its ranks)."""
    slots: list = [None] * size
    barrier = threading.Barrier(size)

    def for_rank(rank: int):
        def gather(mine: list) -> list:
            slots[rank] = mine
            barrier.wait()
            return list(slots)
        return gather

    return for_rank


def test_ranks_decoding_shares_get_what_one_rank_decodes(tmp_path):
    tok = build_char_tokenizer(tmp_path / "tok")
    model = make_tiny_llada(tok.vocab_size, tok.mask_token_id, tok.eos_token_id, seed=3)
    prompts = [tok.encode(f"{i}+{i * 7}=") for i in range(5)]
    seeds = [(0, "rollout", i) for i in range(5)]
    params = SamplingParams(gen_length=8, steps=8, block_length=4, temperature=1.0)
    alone = generate(build_engine("native", model), tok, prompts, params, seeds, batch_size=2)
    gather, results = _group_gather(2), [None, None]

    def rank(r: int) -> None:
        results[r] = generate(build_engine("native", model), tok, prompts, params, seeds, 2, share=DecodeShare(r, 2, gather(r)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        assert got.texts == alone.texts
        assert [len(o.sequences) for o in got.outputs] == [2, 1, 2]  # rank 0: prompts 0-2 in batches of 2; rank 1: 3-4
        responses = [row[o.prompt_len:] for o in got.outputs for row in o.sequences]
        assert all(torch.equal(a, b) for a, b in zip(responses, (row[o.prompt_len:] for o in alone.outputs for row in o.sequences)))
