"""Worker of the `convert` stage: the RL stage's last checkpoint -> a Hugging Face folder."""
import sys

from dare_core.config import DareConfig
from dare_core.training.checkpoint import convert_checkpoint
from dare_core.training.setup import sampler_dict, tokenizer_folder
from dare_core.workers.common import run_worker


def run_convert(cfg: DareConfig) -> None:
    out = convert_checkpoint(cfg.stage_dir("rl") / "checkpoints", cfg.final_model_dir, tokenizer_folder(cfg), sampler=sampler_dict(cfg))
    print(f"wrote {out}")


def main(argv=None) -> int:
    return run_worker(run_convert, argv, "DARE convert stage")


if __name__ == "__main__":
    sys.exit(main())
