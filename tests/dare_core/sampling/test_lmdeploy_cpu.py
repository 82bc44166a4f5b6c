"""The lmdeploy engine against lmdeploy's own code, on CPU (docs/sampling.md#engines): the folder view
through lmdeploy's config builder and model construction (every released SDAR config and DARE's own
small ones), DARE's weights through lmdeploy's loader, the names the engine's process calls, and that
process's start, errors and death. lmdeploy runs from its CPU copy (`make lmdeploy-cpu`), in
subprocesses only (lmdeploy_checks.py)."""
import json
import sys
from pathlib import Path

import pytest

from dare_core.models.hf_folder import save_model
from dare_core.sampling.engines.lmdeploy import EngineProcess

sys.path.insert(0, "tests")
from lmdeploy_cpu import lmdeploy_cpu, run_in_lmdeploy  # noqa: E402,F401  (lmdeploy_cpu: the fixture)
from reference_metadata import CHECKPOINTS, NAMES  # noqa: E402
from tiny_models import MASK, tiny  # noqa: E402

CHECKS = Path(__file__).with_name("lmdeploy_checks.py")
# the released configs kept in the repository (a clone without ../shared has them too)
SDAR_FOLDERS = [CHECKPOINTS / name for name in NAMES if name.startswith("SDAR-")]


def check(overlay: Path, name: str, *args) -> object:
    code = ("import runpy, sys; sys.argv = [sys.argv[0], *sys.argv[1:]]; "
            f"runpy.run_path({str(CHECKS)!r}, run_name='__main__')")
    out = run_in_lmdeploy(overlay, code, name, json.dumps(list(args)), timeout=300)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lmdeploy-cpu")
    folders = {}
    for model_type in ("sdar", "sdar_moe"):
        save_model(tiny(model_type), root / model_type)
        folders[model_type] = root / model_type
    return folders


def test_lmdeploy_builds_every_sdar_config_dare_serves(lmdeploy_cpu, tiny_folders):
    """The released SDAR configs (their mask id, their rope theta 1e6) and DARE's own small ones
    (the char tokenizer's mask id, keys left out): lmdeploy's config builder and model agree with
    DARE's model on the mask id, the padding id, the rope base, the depth and the parameter count."""
    assert {p.name for p in SDAR_FOLDERS} >= {"SDAR-1dot7B-Chat", "SDAR-4B-Chat", "SDAR-8B-Chat", "SDAR-30B-A3B-Chat"}
    rows = check(lmdeploy_cpu, "config_and_model", [str(p) for p in SDAR_FOLDERS] + [str(p) for p in tiny_folders.values()])
    for row in rows:
        assert row["paradigm"] == "dllm" and row["mask"] == row["our_mask"], row
        assert row["pad"] == row["our_pad"] and row["rope_base"] == row["our_rope"], row
        assert row["layers"] == row["our_layers"] and row["params"] == row["our_params"], row
    by_name = {r["folder"]: r for r in rows}
    assert by_name["SDAR-8B-Chat"]["rope_base"] == 1e6 and by_name["SDAR-8B-Chat"]["mask"] == 151669
    assert by_name["SDAR-30B-A3B-Chat"]["mask"] == 151669  # its config.json has no mask_token_id: DARE's default
    assert by_name["sdar"]["mask"] == by_name["sdar_moe"]["mask"] == MASK  # not lmdeploy's hard-coded one
    assert by_name["SDAR-8B-Chat"]["dtype"] == "torch.bfloat16"


def test_lmdeploy_loads_dares_weights_exactly(lmdeploy_cpu, tiny_folders):
    """The parameter mapping, dense and MoE: what the engine's process loads is DARE's weights."""
    out = check(lmdeploy_cpu, "weights", [str(p) for p in tiny_folders.values()])
    assert len(out) == 2
    for folder, result in out.items():
        assert result["params"] > 0 and result["unwritten"] == [] and result["wrong"] == [], (folder, result)


def test_the_lmdeploy_calls_of_the_engine_process_exist(lmdeploy_cpu):
    s = check(lmdeploy_cpu, "signatures")
    assert [e["dllm_unmasking_strategy"] for e in s["engine_sets"]] == ["low_confidence_static", "low_confidence_dynamic",
                                                                        "sequential"]
    assert s["request_seeds"] == [7, 7, 7]
    assert s["from_pretrained"][:4] == ["cls", "pretrained_model_name_or_path", "engine_config", "speculative_config"] or \
        {"engine_config", "trust_remote_code"} <= set(s["from_pretrained"])
    assert s["create_instance"] and s["close"] and s["all_context"] and s["patched_model"]
    assert s["stream"][:4] == ["self", "session_id", "input_ids", "gen_config"] and s["end"][:2] == ["self", "session_id"]
    assert {"SUCCESS", "FINISH"} <= set(s["response_types"])
    assert {"input_ids", "history_lengths", "seq_length", "is_decoding", "is_dummy"} <= set(s["model_inputs"])
    assert s["forward"][:2] == ["self", "inputs"] and s["rename"] == ["iterator", "model"] and s["after_loading"] == ["model"]
    assert s["builder"][:3] == ["hf_config", "model_path", "kwargs"]


def test_engine_process_errors_come_back_with_the_childs_traceback(lmdeploy_cpu, tiny_folders, monkeypatch):
    """The real child program in lmdeploy's python: a failure there (here: no CUDA for its engine)
    is raised here with lmdeploy's own traceback; a child that dies is reported with its log."""
    repo = Path(__file__).resolve().parents[3]
    monkeypatch.setenv("PYTHONPATH", f"{lmdeploy_cpu}:{repo}")
    process = EngineProcess(sys.executable)
    try:
        with pytest.raises(RuntimeError, match="failed in 'start'") as err:
            process.call("start", model_path=str(tiny_folders["sdar"]), engine_config={"tp": 1})
        assert "Traceback" in str(err.value) and "lmdeploy" in str(err.value)
        assert process.call("take_records") == []  # the probe is off: nothing recorded, and the child still answers
        process.proc.kill()
        with pytest.raises(RuntimeError, match="exited with code -9") as err:
            process.call("take_records")
        assert "dare lmdeploy child" in str(err.value)  # the tail of its log
    finally:
        process.close()
    assert process.proc.poll() is not None


def test_engine_process_ends_when_closed(lmdeploy_cpu, monkeypatch):
    repo = Path(__file__).resolve().parents[3]
    monkeypatch.setenv("PYTHONPATH", f"{lmdeploy_cpu}:{repo}")
    process = EngineProcess(sys.executable)
    assert process.call("take_records") == []
    process.close()
    assert process.proc.returncode == 0
