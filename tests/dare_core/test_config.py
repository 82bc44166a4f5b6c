"""The config schema: unknown keys and bad values are named by their full path."""
import pytest

from dare_core.config import ConfigError, load_config


def _write(tmp_path, text):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    p = _write(tmp_path, "sft:\n  optim:\n    weight_decy: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'sft\.optim\.weight_decy' \(did you mean 'weight_decay'\?\)"):
        load_config(p)


def test_wrong_type_and_invalid_sampler_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"key 'rl\.num_steps' expects int"):
        load_config(_write(tmp_path, "rl:\n  num_steps: many\n"))
    with pytest.raises(ConfigError, match=r"'eval\.sampler'.*divisible by block_length"):
        load_config(_write(tmp_path, "eval:\n  sampler: {gen_length: 10, block_length: 4, steps: 10}\n"))


def test_overrides_and_yaml_float_spelling(tmp_path):
    p = _write(tmp_path, "sft:\n  optim: {lr: 2e-3}\n")
    cfg = load_config(p, ["rl.sampler.temperature=0.5", "sft.max_steps=7"])
    assert cfg.sft.optim.lr == 0.002 and cfg.rl.sampler.temperature == 0.5 and cfg.sft.max_steps == 7
    # a nested override keeps the section's other non-default defaults
    assert cfg.rl.optim.lr == 1e-5
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        load_config(p, ["sft.max_steps"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_zero_offload_needs_the_zero_stage_that_partitions_it(tmp_path):
    p = _write(tmp_path, "run: {seed: 0}\n")
    cfg = load_config(p, ["launch.zero_stage=3", "launch.offload_optimizer=cpu", "launch.offload_params=cpu"])
    assert (cfg.launch.offload_optimizer, cfg.launch.offload_params) == ("cpu", "cpu")
    assert load_config(p, ["launch.zero_stage=1", "launch.offload_optimizer=cpu"]).launch.offload_params == "none"
    with pytest.raises(ConfigError, match=r"key 'launch\.offload_optimizer' needs launch\.zero_stage 1, 2 or 3 .*got zero_stage 0"):
        load_config(p, ["launch.offload_optimizer=cpu"])
    with pytest.raises(ConfigError, match=r"key 'launch\.offload_params' needs launch\.zero_stage 3 .*got zero_stage 2"):
        load_config(p, ["launch.zero_stage=2", "launch.offload_params=cpu"])
    with pytest.raises(ConfigError, match=r"key 'launch\.offload_optimizer' must be one of \['none', 'cpu'\], got 'nvme'"):
        load_config(p, ["launch.zero_stage=3", "launch.offload_optimizer=nvme"])


def test_values_out_of_range_name_their_full_key(tmp_path):
    p = _write(tmp_path, "sft:\n  save_every: 0\n")
    with pytest.raises(ConfigError, match=r"key 'sft\.save_every' must be >= 1, got 0"):
        load_config(p)
    for override, key in (("rl.num_steps=-1", "rl.num_steps"), ("preference.keep_last=0", "preference.keep_last"),
                          ("rl.sampler.batch_size=0", "rl.sampler.batch_size"), ("sft.optim.schedule=cos", "sft.optim.schedule"),
                          ("rl.dual_clip=0.5", "rl.dual_clip"), ("launch.nproc=0", "launch.nproc")):
        with pytest.raises(ConfigError, match=rf"key '{key}'"):
            load_config(_write(tmp_path, "run: {seed: 0}\n"), [override])
    # 0 where it means "off" stays allowed
    assert load_config(_write(tmp_path, "run: {seed: 0}\n"), ["rl.validate_every=0", "rl.dual_clip=0"]).rl.validate_every == 0


def test_lengths_auto_is_one_key_for_every_length(tmp_path):
    """`lengths: auto` leaves every canvas, sampler length and step count, and a from-scratch model's
    length, to the data, over the sections' numbers; an override still wins; empty keeps them."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "params.yaml"
    fixed = load_config(shipped, root=tmp_path)
    assert fixed.lengths is None and fixed.sft.pad_to == 6 and fixed.model.init["max_sequence_length"] == 32
    cfg = load_config(shipped, ["lengths=auto", "preference.pad_to=7"], root=tmp_path)
    assert (cfg.sft.pad_to, cfg.preference.pad_to) == ("auto", 7)
    for sampler in (cfg.rl.sampler, cfg.eval.sampler):
        assert (sampler.gen_length, sampler.block_length, sampler.steps) == ("auto", "auto", "auto")
    assert cfg.model.init["max_sequence_length"] == "auto"
    with pytest.raises(ConfigError, match="key 'lengths' must be auto or empty, got 'fixed'"):
        load_config(shipped, ["lengths=fixed"], root=tmp_path)


def test_sequence_parallel_must_divide_the_ranks(tmp_path):
    p = _write(tmp_path, "run: {seed: 0}\n")
    assert load_config(p).launch.sequence_parallel == 1
    with pytest.raises(ConfigError, match=r"launch\.sequence_parallel.*must be >= 1"):
        load_config(p, ["launch.sequence_parallel=0"])
    with pytest.raises(ConfigError, match=r"launch\.sequence_parallel.*\(2\) must divide launch\.nproc \(3\)"):
        load_config(p, ["launch.launcher=torchrun", "launch.nproc=3", "launch.sequence_parallel=2"])
    assert load_config(p, ["launch.launcher=torchrun", "launch.nproc=4", "launch.sequence_parallel=2"]).launch.sequence_parallel == 2
    with pytest.raises(ConfigError, match=r"launch\.sequence_parallel.*\(2\) must divide launch\.nproc \(1\)"):
        load_config(p, ["launch.sequence_parallel=2"])  # one local process: no group to form
