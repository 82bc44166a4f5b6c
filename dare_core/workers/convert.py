"""Worker of the `convert` stage: the RL stage's chosen checkpoint (`rl.export`: the best validated,
or the last; training/export_choice.py) -> a Hugging Face folder."""
import sys

import torch

from dare_core.config import DareConfig
from dare_core.data.lengths import resolve as resolve_lengths
from dare_core.models.hf_folder import EXPORT_FILES
from dare_core.models.lm import build_model
from dare_core.ownership import check_replaceable
from dare_core.storage import check_free_space, check_writable
from dare_core.training.checkpoint import convert_checkpoint, latest_checkpoint
from dare_core.training.export_choice import export_choice
from dare_core.training.preflight import model_bytes
from dare_core.inputs import tokenizer_folder
from dare_core.process.threads import log_threads
from dare_core.workers.common import run_worker


def check_convert(cfg: DareConfig) -> None:
    """Before models/<name> is touched: a complete checkpoint to convert, its tokenizer, a writable
    destination with room for the weights."""
    _, meta = latest_checkpoint(cfg.stage_dir("rl") / "checkpoints")
    tokenizer = tokenizer_folder(cfg)
    if not (tokenizer / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{tokenizer / 'tokenizer_config.json'}: missing (run the prepare stage first)")
    check_writable(cfg.final_model_dir)
    check_replaceable(cfg.final_model_dir, EXPORT_FILES)  # never a folder of the user's
    spec = build_model(meta["hf_config"], device="meta")
    # the checkpoint holds fp32 or bf16 weights; fp32 is the larger, so the estimate is safe
    check_free_space([(cfg.final_model_dir, model_bytes(spec, torch.float32))], "the exported model")


def run_convert(cfg: DareConfig) -> None:
    cfg = resolve_lengths(cfg)  # the exported sampler settings hold the derived lengths
    check_convert(cfg)
    log_threads()
    rl_dir = cfg.stage_dir("rl")
    choice = export_choice(rl_dir / "checkpoints", rl_dir / "validation.jsonl", cfg.rl.export, cfg.rl.export_metric)
    print(f"exporting {choice.why}", flush=True)
    out = convert_checkpoint(rl_dir / "checkpoints", cfg.final_model_dir, tokenizer_folder(cfg), tag=choice.tag,
                             sampler=cfg.eval.sampler.decoding_settings())
    print(f"wrote {out}")


def main(argv=None) -> int:
    return run_worker(run_convert, argv, "DARE convert stage")


if __name__ == "__main__":
    sys.exit(main())
