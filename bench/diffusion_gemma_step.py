"""One LoRA SFT step of DiffusionGemma at the released model's shape (random bf16 weights), on a GPU.

    python3 bench/diffusion_gemma_step.py --out bench/results/diffusion_gemma_step.md
    python3 bench/diffusion_gemma_step.py --tiny --out tmp/dg_step.md      # the CPU check of the script

The network is DARE's (`dare_core/models/diffusion_gemma.py`), built empty on the device in bf16
and drawn there (`init_weights`), with LoRA on every attention and dense-MLP projection and every
routed expert (`targets: all-linear`). A step is the SFT stage's: the uniform-noise loss
(`algorithms/uniform_sft.py`: a first pass for self-conditioning, the scored pass, the encoder's
next-token loss), backward, AdamW over the adapters. The rows are random tokens: a prompt and a
response of whole canvases. Reported: seconds a step (the mean after warm-up steps), tokens a second
(prompt + response tokens of the batch), the peak GPU memory, the parameters.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dare_core.algorithms.uniform_sft import UniformNoiseSFT  # noqa: E402
from dare_core.data.batching import sft_batch  # noqa: E402
from dare_core.diffusion.seeding import generator, sample_generators  # noqa: E402
from dare_core.models.diffusion_gemma import tiny_config  # noqa: E402
from dare_core.models.lm import empty_model  # noqa: E402
from dare_core.models.lora import LoraSettings, apply_lora  # noqa: E402
from stamp import git_commit, hardware, library_versions, markdown_table, utc_now, write_atomic  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "DiffusionGemma-26B-A4B-it.json"


def build(config: dict, device: torch.device, lora_r: int):
    model = empty_model(config, device=device, dtype=torch.bfloat16)
    model.net.init_weights(generator(0, "diffusion-gemma-step", device=device), std=0.02)
    apply_lora(model, LoraSettings(r=lora_r, alpha=lora_r), generator(0, "lora", device=device))
    model.set_gradient_checkpointing(True)  # (model.gradient_checkpointing: one layer's activations at a time)
    return model


def run(model, rows: int, prompt: int, response: int, steps: int, warmup: int) -> dict:
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    # a response of whole canvases less the one EOS the SFT layout appends
    responses = [torch.randint(3, vocab, (response - 1,), generator=g).tolist() for _ in range(rows)]
    batch = sft_batch(prompts, responses, [f"r{i}" for i in range(rows)], response, model.eos_token_id, model.pad_token_id,
                      eos_padding=False)
    batch.input_ids, batch.attention_mask, batch.response_mask = (t.to(device) for t in (batch.input_ids, batch.attention_mask,
                                                                                       batch.response_mask))
    algo = UniformNoiseSFT(UniformNoiseSFT.Options())
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    times, losses = [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = algo.loss(model, batch, sample_generators((0, "step", step), batch.uids), float(rows))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(out.loss))
        print(f"step {step}: {time.perf_counter() - t0:.2f} s, loss {losses[-1]:.3f}", flush=True)
    step_s = sum(times) / len(times)
    return {"rows": rows, "prompt": prompt, "response": response, "step_s": step_s,
            "tokens_per_s": rows * (prompt + response) / step_s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "loss": losses[-1], "params": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in trainable)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--tiny", action="store_true", help="a small config of the same layout (the CPU check of the script)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--canvases", type=int, default=2, help="response canvases of canvas_length each")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    commit = git_commit()
    config = tiny_config(256, eos_token_id=1) if args.tiny else json.loads(Path(args.config).read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = build(config, device, args.lora_r)
    build_s = time.perf_counter() - t0
    canvas = model.block_size
    result = run(model, args.rows, args.prompt, args.canvases * canvas, args.steps, args.warmup)
    command = "python3 bench/diffusion_gemma_step.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text = "\n".join([
        "# DiffusionGemma: a LoRA SFT step at the released model's shape", "", f"Git commit: {commit}  ",
        f"Command: `{command}`  ", f"Hardware: {hardware()}  ", f"Libraries: {library_versions()}  ", f"Date: {utc_now()}", "",
        f"Config: {'the tiny test config' if args.tiny else 'bench/configs/' + Path(args.config).name + ' (its `_source` says where it comes from)'}, random bf16 weights "
        f"drawn on the device ({build_s:.0f} s to build), LoRA r = {args.lora_r} on every attention, dense-MLP and expert "
        f"projection, gradient checkpointing; rows of {args.prompt} prompt tokens and {args.canvases} canvases of {canvas}; the SFT stage's uniform-noise "
        f"loss (two passes, self-conditioning on half the rows), AdamW over the adapters; the mean of {args.steps} steps after "
        f"{args.warmup} warm-up.", "",
        *markdown_table(["rows", "tokens a row", "s a step", "tokens/s", "peak GPU memory (GiB)", "parameters", "trainable"],
                        [[result["rows"], result["prompt"] + result["response"], f"{result['step_s']:.2f}",
                          f"{result['tokens_per_s']:.0f}", f"{result['peak_gib']:.1f}" if result["peak_gib"] else "",
                          f"{result['params'] / 1e9:.2f} B", f"{result['trainable'] / 1e6:.1f} M"]]), ""])
    write_atomic(Path(args.out), text)
    write_atomic(Path(args.out).with_suffix(".json"), json.dumps({"commit": commit, "command": command, **result}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
