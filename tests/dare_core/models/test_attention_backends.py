"""Attention backends: a packed batch equals the padded batch on every real token, for every family
(SDPA on CPU; FlexAttention and varlen on GPU), and the backends agree with each other."""
import pytest
import torch
import torch.nn.functional as F

from dare_core.models import attention
from dare_core.models.attention import AttentionContext, attend

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


@pytest.mark.parametrize("mask_rows", ["none", "broadcast", "per_query"])
def test_short_grouped_query_windows_fold_into_one_head_per_group(mask_rows):
    """A decoding window under grouped-query attention runs with the query heads of a group as extra
    queries of their key head: the same attention as the grouped kernel call, mask and all."""
    torch.manual_seed(0)
    q = torch.randn(3, 5, 8, 16).transpose(1, 2)  # as the layer lays it out: 8 query heads, 2 key heads
    k, v = torch.randn(3, 2, 23, 16), torch.randn(3, 2, 23, 16)
    mask = {"none": None, "broadcast": torch.rand(3, 1, 1, 23) > 0.3, "per_query": torch.rand(3, 1, 5, 23) > 0.3}[mask_rows]
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = attend(q, k, v, AttentionContext(mask=mask))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # past the fold's window length the grouped call itself runs
    long_q = torch.randn(3, 8, attention.FOLD_MAX_QUERIES + 1, 16)
    torch.testing.assert_close(attend(long_q, k, v, None), F.scaled_dot_product_attention(long_q, k, v, enable_gqa=True))


@pytest.mark.gpu
def test_folded_query_groups_match_the_grouped_kernel_on_gpu_bf16():
    """At SDAR-8B's decoding shape (32 query heads on 8 key heads, a block of 4 against a 448-column
    cache, bf16) the folded call agrees with the grouped one to bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    q = torch.randn(16, 4, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(16, 8, 448, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.arange(448, device="cuda")[None, None, None, :] >= torch.randint(0, 200, (16, 1, 1, 1), device="cuda")
    mask = mask.expand(16, 1, 4, 448)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, AttentionContext(mask=mask)), expected, rtol=1.6e-2, atol=1e-2)
