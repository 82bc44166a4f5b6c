"""One rank of tests/dare_core/training/test_sequence_parallel_losses.py (started by torchrun, gloo on
the CPU).

Both ranks form one sequence-parallel group. For each case (a family, a packing mode, an objective)
a rank computes the loss and gradients of one micro-batch as one rank does (no shards), then with
`model.sequence_shards` set, where each rank runs half of every stream and the scores are summed
over the group, and sums its parameter gradients over the group (what the engine's all-reduce
does); rank 0 writes the largest differences to <out>/errors.json. The objectives: SFT, d1 (token
ratios, old and reference scores, entropy), CJ-GRPO (trajectory replay: tempered scores with MASK
excluded, rows one chunk at a time), ESPO (Monte-Carlo ELBO rows through the proxy-gradient
replay) and VRPO preference optimisation with a LoRA adapter (the reference: the adapter disabled); and the scores alone of the shifted Dream, whose scored positions read the hidden state
before them, across the ranks' slices.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from algo_helpers import make_algo, run_update
from dare_core.algorithms.preference import build_preference
from dare_core.algorithms.registry import build_options, get_sft_objective
from dare_core.config import PreferenceConfig, RLConfig
from dare_core.data.batching import pair_batch, sft_batch
from dare_core.diffusion.block import through_stop_block
from dare_core.diffusion.likelihood import token_logprobs
from dare_core.diffusion.seeding import generator, sample_generators
from dare_core.models.lora import LoraSettings, apply_lora
from dare_core.models.ulysses import SequenceShards
from dare_core.training.reference import reference_model
from pipeline_helpers import end_gloo_rank
from rollout_helpers import rollout_batch, sampler_for
from tiny_models import EOS, VOCAB, tiny

# key/value heads a multiple of the 2 ranks (the tiny LLaDA and Dream have 1)
HEADS = {"llada": {"n_kv_heads": 2}, "sdar": {}, "Dream": {"num_key_value_heads": 2}}


def model_of(family: str, packing: str, chunk: int = 0, lora: bool = False):
    model = tiny(family)
    if HEADS[family]:  # rebuilt with the wider key/value heads
        from dare_core.models.family import get_family
        from dare_core.models.lm import build_model
        from tiny_models import MASK, SMALL

        model = build_model(get_family(family).tiny_config(VOCAB, MASK, EOS, **{**SMALL[family], **HEADS[family]}))
        model.net.init_weights(generator(0, family), std=0.3)
    model.packing, model.logits_chunk = packing, chunk
    if lora:  # an adapter that has moved: the policy differs from the adapter-disabled reference
        apply_lora(model, LoraSettings(r=4, alpha=8))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=generator(9, n)))
    return model.train()


def sft_case(model):
    """An SFT micro-batch of 3 rows, prompts of different lengths (left padding), responses short
    and long (EOS or padding fill the canvas): its loss under a per-answer-length norm."""
    g = generator(5, "sft rows")
    prompts = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (5, 3, 4)]
    responses = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (6, 2, 9)]
    uids = ["a", "b", "c"]
    batch = sft_batch(prompts, responses, uids, 10, EOS, model.pad_token_id, eos_padding=model.block_size is None)
    cls = get_sft_objective("sft")
    algo = cls(build_options(cls, {"loss_norm": "answer_length", "mask_law": "bernoulli"}, "sft"), model.mask_token_id)
    denom = algo.global_denominator([batch.response_mask])

    def loss():
        return algo.loss(model, batch, sample_generators((0, "sft", 0), batch.uids), denom).loss

    return loss


def rl_case(model, name: str, stops: tuple = (), editing: bool = False, **opts):
    """One update of RL algorithm `name` on 4 real rollouts, with old and reference scores where it
    reads them (the reference: the policy's own scores, as at a sync). `stops`: each rollout made to
    stop there (None: as decoded), and the canvas after its stop's block left out, as the RL
    rollout does for an objective that scores only up to the stop. `editing`: rollouts with token
    editing (the replay scores tokens that later edits replaced)."""
    rl = RLConfig(kl_beta=0.05, entropy_coeff=0.01 if name == "d1" else 0.0, rows_per_forward=2)
    edits = {"unmasking": "threshold", "threshold": 0.5, "edit_threshold": 0.0, "post_edit_steps": 2} if editing else {}
    sampler = sampler_for(model, temperature=1.0, **edits)
    rl.sampler = sampler
    algo = make_algo(name, model, rl, **opts)
    algo.check_sampler(sampler)
    batch, _ = rollout_batch(model, sampler, n=4, prompt_len=5)
    assert editing == ("edit_steps" in batch.records)
    if stops:
        P, L = batch.prompt_len, batch.response_mask.shape[1]
        for i, s in enumerate(stops):
            if s is not None:
                batch.input_ids[i, P + s:] = model.eos_token_id
        lengths = torch.tensor([L if s is None else s + 1 for s in stops])
        batch.response_mask = torch.arange(L)[None] < lengths[:, None]
        trimmed = through_stop_block(batch.attention_mask, P, lengths, model.block_size)
        assert trimmed.sum() < batch.attention_mask.sum(), "nothing left out"
        batch.attention_mask = trimmed
    corruption = algo.corrupt(batch, (0, 0, 0))

    def loss():
        with torch.no_grad():
            old = algo.score(model, batch, corruption)
        return run_update(algo, model, batch, corruption, old=old, ref=old.detach() * 0.9).loss

    return loss


def preference_case(model):
    """One VRPO update of 2 pairs, the reference the adapter-disabled policy (LoRA), its ELBOs over 4
    Monte-Carlo rows replayed 2 rows at a time (proxy-gradient replay)."""
    g = generator(6, "pairs")
    draw = lambda *lens: [torch.randint(0, 60, (n,), generator=g).tolist() for n in lens]  # noqa: E731
    batch = pair_batch(draw(4, 6), draw(5, 2), draw(3, 7), ["p", "q"], 10, EOS, model.pad_token_id,
                       eos_padding=model.block_size is None)
    objective = build_preference(PreferenceConfig(algorithm="vrpo", pad_to=10, mc_num=4, rows_per_forward=2), model)
    corruption = objective.corrupt(batch, (0, 0))

    def loss():
        with reference_model(model, None) as ref:
            ref_elbos = objective.reference_elbos(ref, batch, corruption)
        return objective.update(model, batch, corruption, ref_elbos, 2, lambda loss: loss.backward()).loss

    return loss


def loss_and_grads(model, loss_fn) -> tuple[float, dict]:
    model.zero_grad()
    out = loss_fn()
    if out.requires_grad:  # (a replaying update has run its backward already)
        out.backward()
    return float(out.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, make_loss, shards) -> dict:
    model.sequence_shards = None
    alone_loss, alone = loss_and_grads(model, make_loss(model))
    model.sequence_shards = shards
    sp_loss, grads = loss_and_grads(model, make_loss(model))
    model.sequence_shards = None
    for g in grads.values():
        dist.all_reduce(g, group=shards.group)
    losses = [torch.zeros(()) for _ in range(shards.size)]
    dist.all_gather(losses, torch.tensor(sp_loss))
    return {"loss": abs(sp_loss - alone_loss), "loss_scale": abs(alone_loss),
            "loss_spread": float(max(losses) - min(losses)),  # every rank logs the same loss
            "grads": max((grads[n] - alone[n]).abs().max().item() for n in alone),
            "grad_scale": max(g.abs().max().item() for g in alone.values()),
            "missing": sorted(set(alone) ^ set(grads))}


def shifted_scores(shards) -> dict:
    """Dream's scores (each target read from the hidden state before it) with the scored positions
    at both sides of the ranks' edge, padded and packed."""
    out = {}
    for packing in ("off", "on"):
        model = model_of("Dream", packing).eval()
        g = generator(7, "dream")
        ids = torch.randint(0, 60, (2, 11), generator=g)  # 11: padded to 12 for the two ranks
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        noisy = ids.clone()
        scored = torch.zeros_like(ids, dtype=torch.bool)
        scored[:, 3:9] = True  # rank 0 holds columns 0-5, rank 1 6-11
        noisy[scored] = model.mask_token_id
        from dare_core.diffusion.masking import Corruption

        c = Corruption(noisy, scored, torch.ones(2))
        with torch.no_grad():
            alone = token_logprobs(model, c, ids, mask)
            model.sequence_shards = shards
            split = token_logprobs(model, c, ids, mask)
        out[f"Dream/{packing}"] = {"scores": (split - alone).abs().max().item(), "scale": alone.abs().max().item()}
    return out


CASES = {
    "llada/packed/sft": ("llada", "on", 0, sft_case),
    "llada/padded/sft": ("llada", "off", 0, sft_case),
    "sdar/packed/sft": ("sdar", "on", 0, sft_case),
    "sdar/padded/sft": ("sdar", "off", 0, sft_case),
    "llada/packed/d1": ("llada", "on", 0, lambda m: rl_case(m, "d1")),
    "llada/chunked/d1": ("llada", "on", 5, lambda m: rl_case(m, "d1")),
    # LoRA leaves the head frozen: the chunks' gradients are formed in the forward (head_scores)
    "sdar/chunked/d1+lora": ("sdar", "on", 5, lambda m: rl_case(m, "d1"), True),
    "sdar/packed/d1": ("sdar", "on", 0, lambda m: rl_case(m, "d1")),
    "sdar/packed/d1+after_stop": ("sdar", "on", 0, lambda m: rl_case(m, "d1", stops=(0, None, 2, 5))),
    "llada/packed/cj_grpo": ("llada", "on", 0, lambda m: rl_case(m, "cj_grpo")),
    "sdar/packed/cj_grpo": ("sdar", "on", 0, lambda m: rl_case(m, "cj_grpo")),
    "sdar/packed/cj_grpo+edits": ("sdar", "on", 0, lambda m: rl_case(m, "cj_grpo", editing=True)),
    "llada/packed/espo": ("llada", "on", 0, lambda m: rl_case(m, "espo", mc_num=2)),
    "sdar/packed/espo": ("sdar", "on", 0, lambda m: rl_case(m, "espo", mc_num=2)),
    "llada/packed/vrpo+lora": ("llada", "on", 0, preference_case, True),
    "sdar/packed/vrpo+lora": ("sdar", "on", 0, preference_case, True),
}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    shards = SequenceShards.of()
    errors = {}
    for case, (family, packing, chunk, make_loss, *lora) in CASES.items():
        errors[case] = compare(model_of(family, packing, chunk, *lora), make_loss, shards)
    errors.update(shifted_scores(shards))
    if dist.get_rank() == 0:
        (out_dir / "errors.json").write_text(json.dumps(errors, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_gloo_rank()
