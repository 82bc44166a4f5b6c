"""`rl.ref_sync_steps` (docs/algorithms.md#reference-policy): every that many RL steps the frozen reference becomes
the current policy. The copy itself (parameters and buffers, the policy untouched), when it is due,
the configuration errors (no KL, LoRA), and a short real RL run whose reference equals the policy
exactly at the steps right after a sync, and never again without sync."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import make_tiny_llada
from dare_core.config import ConfigError, DareConfig, FieldError, ModelConfig, RLConfig, load_config
from dare_core.training.reference import sync_reference
from dare_core.training.rl.checks import check_rl_config
from dare_core.training.rl.verbs import ref_sync_due
from pipeline_helpers import tiny_params, worker_env, write_params


def _params_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_sync_reference_copies_parameters_and_buffers():
    policy, ref = make_tiny_llada(seed=0), make_tiny_llada(seed=1).requires_grad_(False)
    assert not _params_equal(policy, ref)
    before = [p.detach().clone() for p in policy.parameters()]
    for b in ref.buffers():  # a buffer (e.g. rotary tables) that drifted is synced too
        if b.is_floating_point():
            b.add_(1.0)
    sync_reference(ref, policy)
    assert _params_equal(policy, ref)
    assert all(torch.equal(x, y) for x, y in zip(policy.buffers(), ref.buffers()))
    assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), before))  # the policy is untouched
    assert not any(p.requires_grad for p in ref.parameters())  # still frozen
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(policy.parameters(), ref.parameters()))  # a copy, not an alias
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    assert not _params_equal(policy, ref)


def test_sync_is_due_every_n_steps():
    assert [s for s in range(8) if ref_sync_due(s, 3)] == [2, 5]  # after the 3rd and 6th step
    assert [s for s in range(4) if ref_sync_due(s, 1)] == [0, 1, 2, 3]
    assert not any(ref_sync_due(s, 0) for s in range(10))


def test_ref_sync_without_kl_is_a_configuration_error():
    with pytest.raises(FieldError, match="needs rl.kl_beta > 0"):
        RLConfig(ref_sync_steps=4)
    with pytest.raises(FieldError, match="ref_sync_steps must be >= 0"):
        RLConfig(ref_sync_steps=-1, kl_beta=0.1)
    RLConfig(ref_sync_steps=4, kl_beta=0.01)


def test_ref_sync_without_kl_names_the_key_in_params_yaml(tmp_path):
    path = write_params(tmp_path / "params.yaml", tiny_params(tmp_path, rl__ref_sync_steps=2))
    with pytest.raises(ConfigError, match=r"key 'rl.ref_sync_steps' needs rl.kl_beta > 0.*only the KL term reads the reference"):
        load_config(path)


def test_ref_sync_with_lora_is_a_configuration_error():
    cfg = DareConfig(model=ModelConfig(lora={"r": 4}), rl=RLConfig(kl_beta=0.01, ref_sync_steps=2, group_size=4, prompts_per_step=2))
    with pytest.raises(ValueError, match="ref_sync_steps = 2 needs full fine-tuning.*adapter-disabled base model"):
        check_rl_config(cfg)
    cfg.rl.ref_sync_steps = 0
    check_rl_config(cfg)  # LoRA with a fixed reference: fine


_RUN = r"""
import json, shutil, sys
import torch
from dare_core.config import load_config
from dare_core.data.prepare import prepare
from dare_core.training.rl import loop as rl_loop, verbs as rl_verbs
from dare_core.training.sft_loop import run_sft

torch.set_num_threads(1)
cfg = load_config(sys.argv[1])
prepare(cfg)
run_sft(cfg, progress=False, save_checkpoints=False)
seen = []
original = rl_verbs.reference_scores


def spy(algo, policy, ref, batch, corruptions, rows):
    # the reference the step's KL uses, against the policy that rolled out (pi_old)
    seen[-1].append(all(torch.equal(a, b) for a, b in zip(ref.parameters(), policy.parameters())))
    return original(algo, policy, ref, batch, corruptions, rows)


rl_verbs.reference_scores = spy
for name, every in (("sync", 2), ("nosync", 0)):
    shutil.copytree(cfg.stage_dir("sft"), cfg.run_dir.parent / name / "sft")
    cfg.run.name, cfg.rl.ref_sync_steps = name, every
    seen.append([])
    rl_loop.run_rl(cfg, progress=False, save_checkpoints=False)
# the ZeRO-3 branch (deepspeed.zero.GatheredParameters; a no-op gather on parameters ZeRO does not
# partition, as here: it checks the call, not a real partition)
from dare_core.models.llada import tiny_config
from dare_core.models.lm import build_model

a = build_model(tiny_config(40, 39, 38, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden_size=64))
b = build_model(tiny_config(40, 39, 38, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden_size=64))
with torch.no_grad():
    for p in b.parameters():
        p.add_(1.0)
rl_loop.sync_reference(b, a, zero3=True)
zero3_ok = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
print("SEEN " + json.dumps(seen + [zero3_ok]))
"""


def test_rl_run_syncs_the_reference_every_n_steps(tmp_path):
    """4 RL steps with KL (and an entropy bonus, so every step moves the weights): with
    ref_sync_steps 2 the reference equals the policy when steps 0 and 2 score it (the start, and
    right after the sync after step 1), and differs at steps 1 and 3; with 0, only at step 0."""
    params = tiny_params(tmp_path, sft__max_steps=2, rl__num_steps=4, rl__kl_beta=0.05, rl__entropy_coeff=0.01,
                         rl__validate_every=0, rl__log_every=1)
    path = write_params(tmp_path / "params.yaml", params)
    r = subprocess.run([sys.executable, "-c", _RUN, str(path)], env=worker_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    seen = json.loads(r.stdout.split("SEEN ")[-1])
    assert seen == [[True, False, True, False], [True, False, False, False], True]
    for name in ("sync", "nosync"):
        rows = [json.loads(line) for line in (tmp_path / "runs" / name / "rl" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in rows] == [1, 2, 3, 4]
        assert all(m["entropy"] > 0 and m["kl"] >= 0 for m in rows)
