"""Decoding under ZeRO-3 on two ranks (gloo on the CPU): ranks whose rows stop at different points
still make the same forward calls (each gathers the partitioned weights from both ranks), so the job
completes, and every row decodes as the one-rank run decodes it; on the whole weights (how RL
decodes by default) each rank stops on its own, with the same rows."""
import json

import pytest
import torch

from dare_core.sampling.lockstep import RankLockstep
from pipeline_helpers import two_cpu_ranks


def test_no_lockstep_without_several_ranks(tiny_llada):
    assert not torch.distributed.is_initialized()
    assert RankLockstep.for_model(tiny_llada) is None


@pytest.mark.timeout(300)
def test_two_zero3_ranks_stopping_apart_decode_as_one_rank(tmp_path):
    two_cpu_ranks("lockstep_ranks.py", tmp_path, 280, DARE_DIST_TIMEOUT_S="60")
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for family in ("llada", "sdar"):
        parts = [rank[family] for rank in ranks]
        assert all(p["partitioned"] for p in parts)
        alone = parts[0]["alone"]
        assert parts[1]["alone"] == alone
        steps = [sum(row["steps"] for row in p["mine"].values()) for p in parts]
        # the ranks' own rows stop apart (the point of the test), yet both made every forward call
        print(family, "steps of each rank's rows:", steps, "forward calls:", [p["forwards"] for p in parts])
        assert steps[0] < steps[1], (family, steps)
        assert parts[0]["forwards"] == parts[1]["forwards"], family
        for p in parts:
            for uid, row in p["mine"].items():
                assert row == alone[uid], (family, uid)
        # on the whole weights each rank stops with its own rows (fewer forwards on rank 0) and
        # decodes what it decodes alone; afterwards the weights are partitioned again and still decode so
        print(family, "forward calls on the whole weights:", [p["whole_forwards"] for p in parts])
        assert not any(p["whole_partitioned"] for p in parts) and all(p["partitioned_again"] for p in parts)
        assert parts[0]["whole_forwards"] < parts[1]["whole_forwards"], family
        for p in parts:
            assert p["whole"] == p["mine"] and p["again"] == p["mine"], family
