"""Fast evaluation with our own sampler: accuracy on a held-out split.

Used by the `eval` stage (the OpenCompass path slots in beside it) and for in-loop validation.
Each prompt's sampling noise comes from a generator derived from its uid, so results do not
depend on batch size or order.
"""
from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from dare_core.diffusion.seeding import sample_generators
from dare_core.rewards import REWARDS, compute_reward
from dare_core.sampling.decode import SamplingParams, decode_responses, generate


def reward_name_for(row: dict, configured: str = "auto") -> str:
    """The reward of a row: the configured one, else its task's, else a reward named like the task."""
    if configured != "auto":
        return configured
    from dare_core.data.tasks import TASKS

    task = row.get("task", "")
    if task in TASKS:
        return TASKS[task].reward
    if task in REWARDS:
        return task
    raise ValueError(f"row {row.get('uid')}: no reward for task '{task}' (set rl.reward explicitly)")


def score_texts(rows: Sequence[dict], texts: Sequence[str], reward: str = "auto") -> list:
    return [compute_reward(reward_name_for(r, reward), t, r["ground_truth"], {"task": r.get("task")}) for r, t in zip(rows, texts)]


def evaluate(
    model,
    tokenizer,
    rows: Sequence[dict],
    params: SamplingParams,
    batch_size: int = 64,
    seed: int = 0,
    reward: str = "auto",
    desc: str = "eval",
    progress: bool = True,
) -> dict:
    """Generate for every row and score it; returns accuracy, mean reward and per-row predictions."""
    was_training = model.training
    model.eval()
    predictions, correct, total_reward, nfe = [], 0.0, 0.0, 0
    bar = tqdm(total=len(rows), desc=desc, disable=not progress, dynamic_ncols=True)
    for start in range(0, len(rows), batch_size):
        chunk = list(rows[start:start + batch_size])
        prompts = [tokenizer.encode(r["prompt_text"]) for r in chunk]
        gens = sample_generators((seed, "eval"), [r["uid"] for r in chunk], device=next(model.parameters()).device)
        out = generate(model, prompts, params, generators=gens)
        nfe += out.nfe
        texts = decode_responses(tokenizer, out)
        for row, text, res in zip(chunk, texts, score_texts(chunk, texts, reward)):
            correct += res.acc
            total_reward += res.score
            predictions.append({"uid": row["uid"], "prompt": row.get("prompt"), "prediction": text, "ground_truth": row["ground_truth"], "correct": res.acc})
        bar.update(len(chunk))
        bar.set_postfix(acc=f"{correct / len(predictions):.3f}")
    bar.close()
    model.train(was_training)
    n = max(len(predictions), 1)
    return {"accuracy": correct / n, "mean_reward": total_reward / n, "num_samples": len(predictions), "nfe": nfe, "predictions": predictions}
