"""Ulysses sequence parallelism (issue 34) on the CPU: two gloo ranks, each holding half of every
sequence, compute what one rank computes on the whole of it, forward and backward, for the tiny
LLaDA (bidirectional) and SDAR (block-causal, blocks straddling the ranks' halves) models, padded,
in SDAR's two-stream layout and packed. Started through torchrun like tests/lockstep_ranks.py."""
import json

import pytest

from dare_core.models.ulysses import SequenceShards
from pipeline_helpers import two_cpu_ranks

# Tolerances (float32). The logits: each head's attention runs over the same keys in the same order
# as on one rank, so they come out equal (within 1e-6 of the largest, in case a kernel blocks its
# sums by shape). The gradients: the ranks' shares are summed by the all-reduce in another order
# than one rank's backward sums them; observed 2e-7 of the largest gradient, allowed 2e-6.
LOGITS_RTOL = 1e-6
GRADS_RTOL = 2e-6
CASES = ("llada/padded", "llada/packed", "sdar/padded", "sdar/two_stream", "sdar/packed")


@pytest.mark.timeout(120)
def test_two_sequence_parallel_ranks_match_one_rank(tmp_path):
    two_cpu_ranks("sequence_parallel_ranks.py", tmp_path, 110)
    errors = json.loads((tmp_path / "errors.json").read_text())
    for case in CASES:
        e = errors[case]
        print(case, e)
        assert e["logits"] <= LOGITS_RTOL * e["logit_scale"], case
        assert e["grads"] <= GRADS_RTOL * e["grad_scale"], case
    assert "must divide the sequence length" in errors["odd_length_refused"]


@pytest.mark.parametrize("heads, kv_heads, seq_len, named", [
    (3, 3, 8, "the number of attention heads, 3"),
    (4, 1, 8, "the number of key/value heads, 1"),
    (4, 2, 7, "the sequence length (pad the batch to a multiple of it), 7"),
])
def test_uneven_shares_are_refused(heads, kv_heads, seq_len, named):
    with pytest.raises(ValueError, match="launch.sequence_parallel \\(2\\) must divide") as e:
        SequenceShards(None, 2, 0).check(heads, kv_heads, seq_len)
    assert named in str(e.value)
