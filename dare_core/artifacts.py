"""Copies of a run's artifacts under `run.artifact_root` (an fsspec URL such as s3://bucket/prefix,
or a local folder).

The local folders stay the pipeline's outputs (DVC tracks them); the artifact root receives copies:
`<artifact_root>/<run.name>/<canonical path>`, where the canonical path is the output's path under
its configured folder, named as in the default layout (`runs/`, `models/`, `metrics/`,
`data/prepared/`, `data/tokenizer/`), so two machines with different local folders share one
remote layout. Training checkpoints are uploaded as each is completed (training/checkpoint.py);
the rest of a stage's outputs when the stage has succeeded (`publish_stage`, called by `dare
stage`). A stage DVC restores from its cache never runs `dare stage`, so the pipeline flow copies its
outputs with `dare upload` (the same `publish_stage`), and those of a stage DVC found up to date
where their copies are missing (`missing_only`). Every object is written whole (an S3 PUT, or a rename into place for a local root); a
checkpoint counts remotely only once its marker file is there, and the marker is uploaded after
the checkpoint's other files, `latest` after the marker. One line is printed per upload; a URL is
shown without credentials, and credentials come from the backend's standard environment
(dare_core/remote.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from dare_core.config import DareConfig
from dare_core.remote import RemoteError, describe, download_to, listing, redact, remote_errors, remote_fs
from dare_core.storage import atomic_write_text, is_remote

# A training checkpoint folder (training/checkpoint.py) holds `step*` tag folders, each complete
# once this file is in it, and `latest`, naming the newest.
CHECKPOINT_MARKER = "dare_checkpoint.json"
LATEST = "latest"
SUPERSEDED = "superseded"  # checkpoints set aside by a fresh start: kept locally, never uploaded


def shown(path: Path) -> str:
    """`path` as a message shows it: relative to the working directory (the project) when inside."""
    absolute = Path(path).absolute()
    return absolute.relative_to(Path.cwd()).as_posix() if absolute.is_relative_to(Path.cwd()) else str(path)


class ArtifactRoot:
    """Where the copies of one run's artifacts go, and how they get there."""

    def __init__(self, cfg: DareConfig):
        root = str(cfg.run.artifact_root)
        self.local = not is_remote(root)
        if self.local:  # a folder; relative to the project
            root = str(Path(root[len("file://"):] if root.startswith("file://") else root).absolute())
        self.root = root.rstrip("/")
        self.run = cfg.run.name
        self._filesystem: Any = None
        # configured local folder -> its name in the remote layout
        self._folders = [(Path(cfg.run.runs_dir), "runs"), (Path(cfg.run.models_dir), "models"),
                         (Path(cfg.run.metrics_dir), "metrics"), (Path(cfg.data.prepared_dir), "data/prepared"),
                         (Path(cfg.data.tokenizer_dir), "data/tokenizer")]

    # ---- addresses

    def key(self, local: Path) -> str:
        """The canonical path of a local output: e.g. runs/<run>/sft/model."""
        path = Path(local).absolute()
        # the innermost folder that holds it (models_dir may lie inside runs_dir)
        for folder, name in sorted(((f.absolute(), n) for f, n in self._folders), key=lambda f: -len(f[0].parts)):
            if path.is_relative_to(folder):
                rel = path.relative_to(folder).as_posix()
                return name if rel == "." else f"{name}/{rel}"
        if path.is_relative_to(Path.cwd()):
            return path.relative_to(Path.cwd()).as_posix()
        raise RemoteError(f"{local}: not under any of the run's output folders, so it has no place under run.artifact_root")

    def url(self, local: Path) -> str:
        return f"{self.root}/{self.run}/{self.key(local)}"

    def _fs(self) -> tuple[Any, str]:
        """(filesystem, the run's base path in it). One client for this root (a new one per upload
        costs a connection and a credential lookup), its cached listings dropped before each use:
        another process may have written meanwhile."""
        if self._filesystem is None:
            self._filesystem = remote_fs(self.root)
        fs, base = self._filesystem
        fs.invalidate_cache()
        return fs, f"{base.rstrip('/')}/{self.run}"

    def _rpath(self, base: str, local: Path) -> str:
        return f"{base}/{self.key(local)}"

    # ---- writing

    def _put(self, fs: Any, pairs: list[tuple[Path, str]], url: str) -> None:
        """Upload (local file, remote path) pairs, each object whole."""
        if not pairs:
            return
        if self.local:
            for src, dest in pairs:
                Path(dest).parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(dest).parent / f".{Path(dest).name}.{uuid.uuid4().hex[:8]}.part"
                try:
                    shutil.copyfile(src, tmp)
                    os.replace(tmp, dest)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
            return
        with remote_errors(url, "uploading to it"):
            fs.put([str(src) for src, _ in pairs], [dest for _, dest in pairs])

    def _remove(self, fs: Any, rpath: str, url: str) -> None:
        with remote_errors(url, "deleting from it"):
            if fs.exists(rpath):
                fs.rm(rpath, recursive=True)

    def _sizes(self, fs: Any, dest: str, url: str, folder: bool) -> dict[str, int]:
        """{remote path: size} of what the artifact root holds at `dest` (a folder: every file in it)."""
        with remote_errors(url, "listing it"):
            if not folder:
                try:
                    return {fs._strip_protocol(dest): int(fs.info(dest).get("size") or 0)}
                except FileNotFoundError:
                    return {}
            found = fs.find(dest, detail=True) if fs.exists(dest) else {}
        return {fs._strip_protocol(p): int(i.get("size") or 0) for p, i in found.items() if i.get("type") != "directory"}

    def upload(self, local: Path, missing_only: bool = False) -> None:
        """Copy a file, or a folder with everything in it, to its place; remote files of that folder
        that no longer exist locally are deleted afterwards (the copy mirrors the output).
        `missing_only`: send only the files whose copy is missing or has another size (the check of
        an output DVC found up to date: listing the root is cheap, hashing a model is not)."""
        local = Path(local)
        fs, base = self._fs()
        dest, url = self._rpath(base, local), self.url(local)
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        pairs = [(f, dest if f == local else f"{dest}/{f.relative_to(local).as_posix()}") for f in files]
        remote = self._sizes(fs, dest, url, local.is_dir()) if missing_only or local.is_dir() else {}
        sent = [(f, r) for f, r in pairs if remote.get(fs._strip_protocol(r)) != f.stat().st_size] if missing_only else pairs
        self._put(fs, sent, url)
        stale = sorted(set(remote) - {fs._strip_protocol(r) for _, r in pairs}) if local.is_dir() else []
        if stale:
            with remote_errors(url, "deleting from it"):
                fs.rm(stale)
        size = describe(len(sent), sum(f.stat().st_size for f, _ in sent))
        if sent or not missing_only:
            print(f"uploaded {shown(local)} -> {redact(url)} ({size})", flush=True)
        else:  # a line per output either way: the log shows that the copy was checked
            print(f"already uploaded: {shown(local)} -> {redact(url)}", flush=True)

    def sync_checkpoints(self, ckpt_dir: Path, pruned: Iterable[str] = ()) -> None:
        """Upload each complete checkpoint of `ckpt_dir` that the artifact root lacks (its marker
        last), then `latest`; delete the remote copies of the `pruned` tags (removed locally by
        keep_last), marker first, so a remote tag never looks complete while it is half gone."""
        ckpt_dir = Path(ckpt_dir)
        fs, base = self._fs()
        rdir, url = self._rpath(base, ckpt_dir), self.url(ckpt_dir)
        with remote_errors(url, "listing it"):
            remote = fs.find(rdir) if fs.exists(rdir) else []
        have = {posixpath.basename(posixpath.dirname(p)) for p in remote if p.endswith("/" + CHECKPOINT_MARKER)}
        for tag in sorted(p.name for p in ckpt_dir.glob("step*") if (p / CHECKPOINT_MARKER).is_file()):
            if tag in have:
                continue
            local, rtag = ckpt_dir / tag, f"{rdir}/{tag}"
            self._remove(fs, rtag, url)  # what an interrupted upload of this tag left
            files = sorted(p for p in local.rglob("*") if p.is_file())
            pairs = [(f, f"{rtag}/{f.relative_to(local).as_posix()}") for f in files]
            marker = [pair for pair in pairs if pair[0].name == CHECKPOINT_MARKER and pair[0].parent == local]
            self._put(fs, [pair for pair in pairs if pair not in marker], url)
            self._put(fs, marker, url)
            print(f"uploaded {shown(local)} -> {redact(url)}/{tag} "
                  f"({describe(len(files), sum(f.stat().st_size for f in files))})", flush=True)
        if (ckpt_dir / LATEST).is_file():
            self._put(fs, [(ckpt_dir / LATEST, f"{rdir}/{LATEST}")], url)
        for tag in pruned:
            self._remove(fs, f"{rdir}/{tag}/{CHECKPOINT_MARKER}", url)
            self._remove(fs, f"{rdir}/{tag}", url)

    # ---- reading back (a run continued on another machine)

    def latest_checkpoint(self, ckpt_dir: Path) -> Optional[tuple[str, dict, str]]:
        """(tag, its marker's content, URL) of the newest complete checkpoint in the artifact root's
        copy of `ckpt_dir`: the one `latest` names, else the newest tag with its marker; None when
        there is none."""
        fs, base = self._fs()
        rdir, url = self._rpath(base, ckpt_dir), self.url(ckpt_dir)
        with remote_errors(url, "reading its checkpoints"):
            if not fs.exists(rdir):
                return None
            named = fs.cat_file(f"{rdir}/{LATEST}").decode().strip() if fs.exists(f"{rdir}/{LATEST}") else None
            tags = sorted((posixpath.basename(p.rstrip("/")) for p in fs.ls(rdir, detail=False)), reverse=True)
            for tag in ([named] if named else []) + [t for t in tags if t.startswith("step")]:
                marker = f"{rdir}/{tag}/{CHECKPOINT_MARKER}"
                if fs.exists(marker):
                    try:
                        return tag, json.loads(fs.cat_file(marker)), f"{url}/{tag}"
                    except ValueError:
                        continue  # not a marker this DARE wrote
        return None

    def fetch_checkpoint(self, ckpt_dir: Path, tag: str) -> None:
        """Download checkpoint `tag` into `ckpt_dir` (verified, renamed into place when complete)
        and point `latest` at it."""
        url = f"{self.url(ckpt_dir)}/{tag}"
        download_to(url, Path(ckpt_dir) / tag, listing(url, "checkpoint", folder=True), what="checkpoint")
        atomic_write_text(Path(ckpt_dir) / LATEST, tag)
        print(f"restored checkpoint {tag} from {redact(url)} -> {shown(Path(ckpt_dir) / tag)}", flush=True)


def artifact_root(cfg: DareConfig) -> Optional[ArtifactRoot]:
    """The run's artifact root, or None when `run.artifact_root` is not set."""
    return ArtifactRoot(cfg) if cfg.run.artifact_root else None


def stage_outputs(cfg: DareConfig, stage: str) -> list[Path]:
    """What `stage` writes (dvc.yaml's outs, metrics and plots of the stage). A training stage's
    folder is listed whole: its model, checkpoints, metrics, plot files and tensorboard logs."""
    metrics = Path(cfg.run.metrics_dir) / f"{stage}.json"
    from_scratch = not cfg.model.path
    outputs = {
        "inputs": [Path(cfg.run.metrics_dir) / "inputs.json"],
        "prepare": [Path(cfg.data.prepared_dir)] + ([Path(cfg.data.tokenizer_dir)] if from_scratch else []),
        "sft": ([cfg.base_model_dir] if from_scratch else []) + [cfg.stage_dir("sft"), metrics],
        "preference": [cfg.stage_dir("preference"), metrics],
        "rl": [cfg.stage_dir("rl"), metrics],
        "convert": [cfg.final_model_dir],
        "eval": [cfg.stage_dir("eval"), metrics],
    }
    return outputs[stage]


def publish_stage(cfg: DareConfig, stage: str, missing_only: bool = False) -> None:
    """Copy what `stage` wrote to the artifact root (nothing when none is set). Checkpoints are
    synchronised (those already uploaded during training are not sent again); checkpoints set aside
    and temporary files are not copied. `missing_only`: the other files too are sent only where
    their copy is missing or has another size (`ArtifactRoot.upload`)."""
    root = artifact_root(cfg)
    if root is None:
        return
    for path in stage_outputs(cfg, stage):
        if not path.exists():
            continue
        if path == cfg.stage_dir(stage) and path.is_dir():
            for child in sorted(path.iterdir()):
                if child.name.startswith(".") or child.name == SUPERSEDED:
                    continue
                if child.name == "checkpoints":
                    root.sync_checkpoints(child)
                else:
                    root.upload(child, missing_only)
        else:
            root.upload(path, missing_only)
