"""Where training checkpoints live: a local directory or any fsspec URL (deepspec/train/checkpoint.py
says what a checkpoint holds). Locally a checkpoint is staged in a temporary directory beside it and
renamed into place; on an object store, where a rename is a copy, its files are uploaded one by one
from a local staging directory with meta.json, the commit mark, last, and read through a local copy."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

FILES = ("model.safetensors", "optimizer.safetensors", "meta.json")  # meta.json last: the commit mark


class StateDir:
    """The directory checkpoints live in: a local path or an fsspec URL. Entries are named by their
    path relative to it (`ckpt-00000010`, `stale-<fingerprint>/ckpt-00000010`)."""

    def __init__(self, url: str | Path, storage_options: dict | None = None):
        self.url = str(url).rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def __str__(self) -> str:
        return self.url

    def where(self, name: str) -> str:
        """`name` as the user would find it (for messages)."""
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def entries(self, prefix: str, under: str = "") -> list[str]:
        """Sorted names of the directories directly under `under` whose name starts with `prefix`."""
        self.fs.invalidate_cache()  # another rank or node may have written since the last listing
        try:
            listed = self.fs.ls(self._path(under), detail=True)
        except FileNotFoundError:
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in listed if e["type"] == "directory"]
        return sorted(f"{under}/{n}" if under else n for n in names if n.startswith(prefix))

    def read_text(self, name: str, file: str) -> str:
        return self.fs.cat_file(self._path(f"{name}/{file}")).decode()

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self._path(name))

    def remove(self, name: str) -> None:
        if self.exists(name):
            self.fs.rm(self._path(name), recursive=True)

    def move(self, name: str, dest: str) -> None:
        if self.local:
            Path(self._path(dest)).parent.mkdir(parents=True, exist_ok=True)
            Path(self._path(name)).rename(self._path(dest))
            return
        tmp = self._download(name)  # S3 has no rename: copied through a local copy, meta.json last
        try:
            self.commit_from(Path(tmp), dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.remove(name)

    @contextlib.contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        """A local directory to write checkpoint `name` in; `commit_from` it afterwards."""
        if self.local:
            tmp = Path(self._path(f".tmp-{name}"))
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                yield tmp
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return
        with tempfile.TemporaryDirectory(prefix="deepspec-ckpt-") as tmp:
            yield Path(tmp)

    def commit_from(self, staged: Path, name: str) -> None:
        """Put the checkpoint files in `staged` at `name`, replacing what was there, meta.json last."""
        if self.local:
            final = Path(self._path(name))
            shutil.rmtree(final, ignore_errors=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            staged.rename(final)
            return
        self.remove(name)
        for file in FILES:
            if (staged / file).exists():  # a damaged checkpoint set aside keeps what it had
                self.fs.put_file(str(staged / file), self._path(f"{name}/{file}"))

    def _download(self, name: str) -> str:
        tmp = tempfile.mkdtemp(prefix="deepspec-ckpt-")
        for file in FILES:
            try:
                self.fs.get_file(self._path(f"{name}/{file}"), f"{tmp}/{file}")
            except FileNotFoundError:
                pass  # reported by read_checkpoint, which names what is missing
        return tmp

    @contextlib.contextmanager
    def local_copy(self, name: str) -> Iterator[Path]:
        """Checkpoint `name` as a local directory (the directory itself when it is local)."""
        if self.local:
            yield Path(self._path(name))
            return
        tmp = self._download(name)
        try:
            yield Path(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def as_state(root: StateDir | str | Path) -> StateDir:
    return root if isinstance(root, StateDir) else StateDir(root)
