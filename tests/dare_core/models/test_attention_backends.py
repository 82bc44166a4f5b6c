"""Attention backends: a packed batch equals the padded batch on every real token, for every family
(SDPA on CPU; FlexAttention and varlen on GPU), and the backends agree with each other."""
import pytest
import torch

from dare_core.diffusion.seeding import generator
from tiny_models import FAMILIES, tiny

LENS = [5, 11, 8]


def _padded_and_packed(device="cpu"):
    seqs = [torch.randint(0, 60, (n,), generator=generator(i, "seq")) for i, n in enumerate(LENS)]
    width = max(LENS)
    ids = torch.full((len(LENS), width), 7)
    attn = torch.zeros(len(LENS), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s  # left padding, as the sampler does
        attn[i, width - len(s):] = 1
    return ids.to(device), attn.to(device), torch.cat(seqs).to(device)


def _unpad(logits, attn):
    return torch.cat([logits[i][attn[i].bool()] for i in range(logits.shape[0])])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_equals_padded_on_cpu(model_type):
    model = tiny(model_type)
    ids, attn, packed = _padded_and_packed()
    padded_logits = _unpad(model(ids, attn), attn)
    packed_logits = model.forward_packed(packed, LENS, backend="sdpa")
    torch.testing.assert_close(packed_logits, padded_logits, atol=2e-5, rtol=1e-4)


def test_varlen_refuses_block_diffusion():
    model = tiny("sdar")
    with pytest.raises(ValueError, match="bidirectional only"):
        model.forward_packed(torch.arange(10), [4, 6], backend="varlen")


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", FAMILIES)
def test_backends_agree_on_gpu_bf16(model_type):
    model = tiny(model_type).to("cuda", torch.bfloat16)
    ids, attn, packed = _padded_and_packed("cuda")
    with torch.no_grad():
        reference = _unpad(model(ids, attn), attn).float()
        backends = ["sdpa", "flex"] + ([] if model.block_size else ["varlen"])
        for backend in backends:
            got = model.forward_packed(packed, LENS, backend=backend).float()
            torch.testing.assert_close(got, reference, atol=0.1, rtol=0.05, msg=f"{model_type} {backend}")


def _doc_block_rule(n: int):
    """Three documents, block-causal in blocks of 4 inside each (the packed block-diffusion rule)."""
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([n // 3, n // 3, n - 2 * (n // 3)]))
    blk = torch.arange(n) // 4
    return lambda q, k: (doc[q] == doc[k]) & (blk[k] <= blk[q])


@pytest.mark.parametrize("n", [300, 700])
def test_sparse_block_mask_equals_create_block_mask_chunk_by_chunk(n):
    """The chunked BlockMask is create_block_mask's (partial and full blocks, their order), and never
    evaluates more query rows at once than its chunk allows; FlexAttention gives the same output."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from dare_core.models.attention import FLEX_BLOCK, sparse_block_mask

    rule, widest = _doc_block_rule(n), []

    def counted(q, k):
        if q.dim() == 2:  # (FlexAttention's kernel calls it again per score, on scalars)
            widest.append(q.shape[0])
        return rule(q, k)

    width = -(-n // FLEX_BLOCK) * FLEX_BLOCK  # keys, padded to whole blocks
    ours = sparse_block_mask(counted, n, "cpu", chunk_elements=FLEX_BLOCK * width)
    theirs = create_block_mask(lambda b, h, q, k: rule(q, k), None, None, n, n, device="cpu")
    assert max(widest) == FLEX_BLOCK and len(widest) == -(-n // FLEX_BLOCK)  # one block row at a time
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), msg=name)
    q, k, v = torch.randn(3, 1, 2, n, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=ours), flex_attention(q, k, v, block_mask=theirs))
