import json

import pyarrow.parquet as pq
import pytest

from dare_core.config import DareConfig
from dare_core.data.prepare import prepare
from dare_core.data.schema import DataError
from dare_core.rewards import compute_reward
from dare_core.rewards.instructions import BOXED_INSTRUCTION, add_instruction, check_rows


def make_cfg(root, **data) -> DareConfig:
    cfg = DareConfig()
    cfg.data.prepared_dir = str(root / "prepared")
    cfg.data.tokenizer_dir = str(root / "tokenizer")
    cfg.data.num_val = 0  # no in-loop validation split: these pools are sized for sft, rl and eval
    cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval = 8, 8, 4
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def read(cfg, split):
    return pq.read_table(f"{cfg.data.prepared_dir}/{split}.parquet").to_pylist()


def math_source(tmp_path, prompts):
    source = tmp_path / "raw.jsonl"
    rows = [{"prompt": p, "response": str(i), "ground_truth": str(i), "task": "math"} for i, p in enumerate(prompts)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return source


def test_raw_math_prompts_get_the_boxed_instruction(tmp_path):
    source = math_source(tmp_path, [f"What is {i}+0?" for i in range(12)])
    cfg = make_cfg(tmp_path, source=str(source), task="math")
    prepare(cfg)
    for split in ("sft", "rl", "eval"):
        for row in read(cfg, split):
            assert row["prompt"].endswith("\n" + BOXED_INSTRUCTION) and BOXED_INSTRUCTION in row["prompt_text"]


def test_preparation_fails_on_an_rl_math_row_without_the_instruction(tmp_path):
    prompts = [f"What is {i}+0? Put the answer in \\boxed{{}}." for i in range(12)]
    prompts[5] = "What is 5+0?"
    source = math_source(tmp_path, prompts)
    cfg = make_cfg(tmp_path, source=str(source), task="math", task_args={"append_instruction": False},
                   num_sft=4)
    # every row is in rl or eval: the sixth (line 6) is graded, and names the file and line
    with pytest.raises(DataError, match=r"raw.jsonl: line 6: the (rl|eval) prompt of task 'math' .*\\\\boxed"):
        prepare(cfg)
    assert not (tmp_path / "prepared").exists()


def test_instruction_helpers():
    assert add_instruction("math", "Solve x.") == "Solve x.\n" + BOXED_INSTRUCTION
    assert add_instruction("math", "Solve x, answer in \\boxed{}.") == "Solve x, answer in \\boxed{}."
    assert add_instruction("gsm8k", "Q? Answer in <answer></answer>.") == "Q? Answer in <answer></answer>."
    assert add_instruction("countdown", "1 2 3 -> 9") == "1 2 3 -> 9"  # synthetic tasks carry their own
    check_rows([{"task": "gsm8k", "prompt": "q " + BOXED_INSTRUCTION},
                {"task": "countdown", "prompt": "1 2 -> 3"}], "rl")
    with pytest.raises(ValueError, match="rl row 2"):
        check_rows([{"task": "math", "prompt": "\\boxed"}, {"task": "math", "prompt": "no"}], "rl")


@pytest.mark.parametrize("task, args", [
    ("countdown", {"answer_format": "plain", "instruction": False}),
    ("sudoku", {"answer_format": "plain", "instruction": False}),
    ("countdown", {}),
])
def test_synthetic_tasks_prepare_with_the_char_tokenizer(tmp_path, task, args):
    cfg = make_cfg(tmp_path, task=task, task_args=args, num_sft=40, num_rl=10, num_eval=10)
    cfg.sft.pad_to = 32
    for sampler in (cfg.rl.sampler, cfg.eval.sampler):  # canvases that hold these answers
        sampler.gen_length = sampler.steps = sampler.block_length = "auto"
    if hasattr(cfg.data, "num_preference"):
        # derived preference pairs assume ground truth == the answer text, which these tasks do not use
        cfg.data.num_preference = 0
    summary = prepare(cfg)
    assert summary["task"] == task and summary["counts"]["rl"] == 10
    for row in read(cfg, "sft"):
        assert compute_reward(task, row["response"], row["ground_truth"]).score == 1.0
