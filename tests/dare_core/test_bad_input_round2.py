"""Bad input, second round: every set of checkpoints set aside is kept and a revert resumes it;
values are checked before the first write (model shapes, NaN anywhere, token ids); the traceback
cases end in one line with exit code 2; a user's reward that never returns is stopped; files follow
the umask; a stage whose parent dies ends.

Most checks call the validating functions in this process; the few `dare` runs reuse the tiny
project of tests/bad_input.py (`project`) and assert its watched folders are untouched.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from bad_input import assert_clean_failure, run, snapshot
from pipeline_helpers import worker_env

# --------------------------------------------------------------------------- superseded sets


class _Engine:
    """What CheckpointManager.begin asks of a DeepSpeed engine when it resumes."""

    global_rank = 0

    def __init__(self) -> None:
        self.loaded: list[tuple[str, str]] = []

    def load_checkpoint(self, directory: str, tag: str) -> tuple[None, dict]:
        self.loaded.append((directory, tag))
        return None, {"step": int(tag[4:])}


def _manager(stage_dir: Path, lr: float, restart: str = "never"):
    from dare_core.training.checkpoint import CheckpointManager, SavePolicy
    from dare_core.training.fingerprint import Fingerprint

    fingerprint = Fingerprint.of({"sft": {"optim": {"lr": lr}}}, {})
    return CheckpointManager(stage_dir / "checkpoints", 2, fingerprint, "sft", restart=restart,
                             policy=SavePolicy(save_every=10, last_step=40, exports=True))


def _write_checkpoint(manager, step: int) -> None:
    """A complete checkpoint of `manager`'s settings, as CheckpointManager.save lays it out."""
    tag = f"step{step:08d}"
    folder = manager.dir / tag
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"weights of " + tag.encode())
    fp = manager.fingerprint
    (folder / "dare_checkpoint.json").write_text(json.dumps({"fingerprint": fp.digest, "settings": fp.settings,
                                                             "inputs": fp.inputs, "step": step, "hf_config": {}}))
    (manager.dir / "latest").write_text(tag)


def _write_logs(stage: Path, lr: float) -> None:
    """What a run logs beside its checkpoints: metrics, a plot's CSV, TensorBoard events (and its model)."""
    (stage / "metrics.jsonl").write_text(json.dumps({"step": 1, "lr": lr}) + "\n")
    (stage / "loss.csv").write_text(f"step,loss\n1,{lr}\n")
    (stage / "tensorboard").mkdir(exist_ok=True)
    (stage / "tensorboard" / "events").write_text(str(lr))
    (stage / "model").mkdir(exist_ok=True)
    (stage / "model" / "weights").write_text(str(lr))


def _logged(folder: Path) -> float:
    lr = json.loads((folder / "metrics.jsonl").read_text())["lr"]
    assert (folder / "loss.csv").read_text().endswith(f"1,{lr}\n") and (folder / "tensorboard/events").read_text() == str(lr)
    return lr


def _settings_of(folder: Path) -> float:
    return json.loads((folder / "set_aside.json").read_text())["settings"]["sft.optim.lr"]


def test_superseded_keeps_every_set_and_a_revert_resumes(tmp_path: Path) -> None:
    stage = tmp_path / "sft"
    first = _manager(stage, 0.1)
    _write_checkpoint(first, 10)
    _write_logs(stage, 0.1)
    # two settings changes in the pipeline's mode: each sets the previous checkpoints aside
    for lr in (0.2, 0.3):
        run_ = _manager(stage, lr, restart="if_changed")
        assert run_.check() is None
        assert run_.begin(_Engine(), "SFT") == 0
        _write_checkpoint(run_, 20)
        _write_logs(stage, lr)
    kept = sorted(p.name for p in (stage / "superseded").iterdir())
    assert kept == ["0001", "0002"]
    assert [_settings_of(stage / "superseded" / k) for k in kept] == [0.1, 0.2]  # newest last, with settings
    # what each run logged is kept with its checkpoints (a fresh run rewrites the stage's logs)
    assert [_logged(stage / "superseded" / k / "logs") for k in kept] == [0.1, 0.2]
    assert not (stage / "superseded/0001/logs/model").exists()
    # by hand, without --restart: the first settings again find their checkpoints and resume them
    revert = _manager(stage, 0.1)
    assert revert.check() == "step00000010"
    engine = _Engine()
    assert revert.begin(engine, "SFT") == 10
    assert engine.loaded == [(str(stage / "checkpoints"), "step00000010")]
    assert (stage / "checkpoints/step00000010/mp_rank_00_model_states.pt").read_bytes() == b"weights of step00000010"
    assert not (stage / "checkpoints/set_aside.json").exists() and not (stage / "checkpoints/logs").exists()
    kept = sorted(p.name for p in (stage / "superseded").iterdir())
    assert kept == ["0002", "0003"] and [_settings_of(stage / "superseded" / k) for k in kept] == [0.2, 0.3]
    assert _logged(stage) == 0.1 and _logged(stage / "superseded/0003/logs") == 0.3  # the resumed run's logs are back
    # --restart never looks there
    fresh = _manager(stage, 0.2, restart="always")
    assert fresh.check() is None and fresh.begin(_Engine(), "SFT") == 0
    assert not any((stage / "checkpoints").iterdir())


def test_a_legacy_superseded_set_is_kept_when_another_is_added(tmp_path: Path) -> None:
    """An older DARE kept one set directly in superseded/: it becomes the oldest numbered set."""
    stage = tmp_path / "sft"
    old = _manager(stage, 0.1)
    _write_checkpoint(old, 10)
    os.replace(stage / "checkpoints", stage / "superseded")
    current = _manager(stage, 0.2)
    _write_checkpoint(current, 20)
    revert = _manager(stage, 0.1)
    assert revert.check() == "step00000010" and revert.begin(_Engine(), "SFT") == 10
    assert sorted(p.name for p in (stage / "superseded").iterdir()) == ["0002"]
    assert _settings_of(stage / "superseded/0002") == 0.2
    assert (stage / "checkpoints/latest").read_text() == "step00000010"


# --------------------------------------------------------------------------- checked before writing


def test_model_init_shapes_and_nan_are_refused_before_any_write(project: Path) -> None:
    before = snapshot(project)
    # (--restart: the checkpoints made with n_kv_heads 2 would be refused first, and are set aside
    # only once every check has passed)
    result = run(project, "stage", "sft", "--restart", "-S", "model.init.n_kv_heads=3")
    line = assert_clean_failure(result, ("model.init", "n_kv_heads (3) must divide n_heads (2)"), before, project)
    assert result.returncode == 2, line
    result = run(project, "stage", "preference", "-S", "preference.beta=.nan")
    line = assert_clean_failure(result, ("preference.beta", "finite"), before, project)
    assert result.returncode == 2, line


def test_invalid_yaml_in_an_override_and_nan_on_the_command_line(project: Path) -> None:
    before = snapshot(project)
    result = run(project, "stage", "rl", "-S", "rl.reward_args={case: [}")
    assert_clean_failure(result, ("rl.reward_args", "not valid YAML"), before, project)
    assert result.returncode == 2
    result = run(project, "generate", "--model", "models/t", "--prompt", "1+2=", "--temperature", "nan")
    assert_clean_failure(result, ("--temperature", "finite"), before, project)
    assert result.returncode == 2


def test_nan_anywhere_in_the_config_names_its_key(tmp_path: Path) -> None:
    from dare_core.config import ConfigError, load_config

    params = tmp_path / "params.yaml"
    params.write_text("run: {seed: 0}\n")
    for override, key in (("sft.optim.lr=.inf", "sft.optim.lr"), ("rl.sampler.temperature=nan", "temperature"),
                          ("data.task_args={demo_error_rate: .nan}", "data.task_args.demo_error_rate"),
                          ("rl.algorithm_args={d1: {p_mask_prompt: -.inf}}", "rl.algorithm_args.d1.p_mask_prompt")):
        with pytest.raises(ConfigError, match="finite") as caught:
            load_config(params, [override])
        assert key in str(caught.value), caught.value


def test_task_args_typos_and_wrong_types() -> None:
    from dare_core.data.synthetic import get_task
    from dare_core.data.synthetic.registry import check_task_args

    task = get_task("arithmetic")
    check_task_args(task, {"min_digits": 1, "max_digits": 2, "demo_error_rate": 0, "zero_pad": True})
    with pytest.raises(ValueError, match=r"unknown setting data.task_args.max_digit; did you mean "
                                         r"data.task_args.max_digits\?"):
        check_task_args(task, {"max_digit": 2})
    with pytest.raises(ValueError, match=r"data.task_args.max_digits must be a whole number .*'3'"):
        check_task_args(task, {"max_digits": "3"})
    with pytest.raises(ValueError, match=r"data.task_args.demo_error_rate must be a finite number"):
        check_task_args(task, {"demo_error_rate": "half"})


def _folder_with(project: Path, tmp_path: Path, **changes) -> Path:
    folder = Path(shutil.copytree(project / "models" / "t", tmp_path / f"model-{uuid.uuid4().hex[:6]}"))
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, culprit", [
    ({"d_model": "32"}, "d_model (the width) must be a positive whole number, got '32'"),
    ({"n_heads": 0}, "n_heads (the number of attention heads) must be a positive whole number, got 0"),
    ({"n_kv_heads": 3}, "n_kv_heads (3) must divide n_heads"),
    ({"mask_token_id": 100000}, "mask_token_id 100000 is not a token id of the vocabulary"),
    ({"eos_token_id": -1}, "eos_token_id -1 is not a token id"),
])
def test_model_folder_config_is_refused_naming_the_file(project: Path, tmp_path: Path, changes: dict,
                                                        culprit: str) -> None:
    from dare_core.errors import ModelLoadError
    from dare_core.models.hf_folder import inspect_model

    folder = _folder_with(project, tmp_path, **changes)
    with pytest.raises(ModelLoadError) as caught:
        inspect_model(folder)
    assert str(folder / "config.json") in str(caught.value) and culprit in str(caught.value), caught.value


# --------------------------------------------------------------------------- user code under a time limit

HANGING = '''
import time


def score(completion, ground_truth, row):
    if completion == "hang":
        while True:
            time.sleep(0.05)
    return 1.0


def _validate(ground_truth):
    if ground_truth == "7":
        while True:
            pass


score.validate = _validate
'''


@pytest.fixture
def hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"hanging_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(HANGING)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DARE_USER_CODE_TIMEOUT_S", "1.5")
    yield f"{name}:score"
    sys.modules.pop(name, None)


def test_a_validate_that_never_returns_is_refused_naming_the_function(hanging: str) -> None:
    from dare_core.data.schema import check_ground_truths
    from dare_core.config import ConfigError

    rows = [{"prompt": "a", "ground_truth": gt, "task": "x", "uid": f"u{gt}"} for gt in ("5", "6", "7", "8")]
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        check_ground_truths(rows, hanging, "raw.jsonl")
    took = time.monotonic() - t0
    message = str(caught.value)
    assert f"reward '{hanging}': its validate did not return within 1.5 s on ground truth '7'" in message, message
    assert "raw.jsonl: row 3" in message  # rows in memory: counted from 1 and "\n" not in message
    assert took < 1.5 + 15, f"refused after {took:.1f} s"


def test_a_reward_that_never_returns_scores_zero_within_the_share_and_a_storm_stops_at_once(hanging: str) -> None:
    from dare_core.rewards.base import RewardFailed
    from dare_core.rewards.scoring import failure_metrics, score_texts

    rows = [{"prompt": "a", "ground_truth": "1", "task": "x", "uid": f"u{i}"} for i in range(3)]
    results = score_texts(rows, ["ok", "hang", "ok"], reward=hanging, errors_allowed=0.5)
    assert [r.score for r in results] == [1.0, 0.0, 1.0]  # the host restarts after the one it stopped
    assert results[1].extra["failure"] == "timeout" and hanging in results[1].extra["error"]
    assert failure_metrics(results)["reward_failed/timeout"] == pytest.approx(1 / 3)
    # a reward that hangs on every response: the batch ends at the first time-out, not after all of them
    t0 = time.monotonic()
    with pytest.raises(RewardFailed, match=rf"reward '{hanging}' did not return within 1.5 s on row u0"):
        score_texts(rows * 20, ["hang"] * 60, reward=hanging)
    assert time.monotonic() - t0 < 1.5 + 15


# --------------------------------------------------------------------------- files and processes


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_atomic_writes_follow_the_umask(tmp_path: Path, mask: int) -> None:
    from dare_core.storage import atomic_write_text

    old = os.umask(mask)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == (tmp_path / "plain.txt").stat().st_mode & 0o777


_PARENT = r"""
import subprocess, sys, time
from dare_core.process.lifeline import dies_with_parent
preexec = dies_with_parent() if sys.argv[2] == "prctl" else None
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], preexec_fn=preexec)
print(child.pid, flush=True)
time.sleep(120)
"""
# (SIGHUP to its default: a test run under nohup would otherwise ask the stage to outlive its parent)
_WATCHING_CHILD = ("import signal, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                   "from dare_core.process.lifeline import watch_parent; assert watch_parent(0.2); time.sleep(120)")
_PLAIN_CHILD = "import time; time.sleep(120)"


@pytest.mark.parametrize("how", ["watch", "prctl"])
def test_a_worker_whose_parent_is_killed_exits(how: str) -> None:
    child_code = _WATCHING_CHILD if how == "watch" else _PLAIN_CHILD
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, child_code, how], stdout=subprocess.PIPE, text=True,
                              env=worker_env())
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the child is up (and watching)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), f"the {how} child outlived its parent"
    finally:
        parent.kill()


def test_a_stage_under_nohup_may_outlive_its_parent() -> None:
    from dare_core.process.lifeline import watch_parent

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert watch_parent() is False
    finally:
        signal.signal(signal.SIGHUP, before)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, reaped by init or a subreaper, has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_the_stage_command_watches_its_parent(tmp_path: Path) -> None:
    """`dare stage` itself ends when its parent dies (here while its user reward hangs in prepare)."""
    reward = tmp_path / "slow_reward_e41.py"
    reward.write_text(textwrap.dedent('''
        import time
        def score(completion, ground_truth, row):
            return 1.0
        def _v(gt):
            time.sleep(120)
        score.validate = _v
    '''))
    rows = [{"prompt": f"{i}+{i}=", "response": str(2 * i), "ground_truth": str(2 * i), "uid": f"u{i}"}
            for i in range(30)]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "params.yaml").write_text("run: {name: t}\ndata: {num_sft: 10, num_rl: 10, num_eval: 4, num_val: 2, "
                                          "num_preference: 4}\n")
    stage = ("import signal, subprocess, sys, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
             "p = subprocess.Popen([sys.executable, '-m', 'dare_core.cli', 'stage', 'prepare', "
             "'-S', 'data.source=raw.jsonl', '-S', 'rl.reward=slow_reward_e41:score']); "
             "print(p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", stage], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              env={**worker_env(), "DARE_USER_CODE_TIMEOUT_S": "100"})
    try:
        child = int(parent.stdout.readline())
        time.sleep(8)  # imports, then prepare waits on the reward's validate
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "dare stage outlived its parent"
    finally:
        parent.kill()
