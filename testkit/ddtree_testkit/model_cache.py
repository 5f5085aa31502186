"""The offline model cache: directories built once from a recipe, atomically, and reused while the recipe holds.

Cache: ``$VLLM_DDTREE_CACHE`` or ``<repo root>/.cache/models``. Every directory is built in a temp dir next to its
final path and renamed into place, so an interrupted build never leaves a half model at the final path. A finished
directory carries a marker file (``.offline_model.json``) with the recipe, a recipe hash and the file sizes; a
directory is reused only when the marker matches. Builds of the same directory from several processes are
serialized with a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger("ddtree_testkit.model_cache")

# Bump when a recipe's output changes; stale directories are then rebuilt.
RECIPE_VERSION = 1
MARKER = ".offline_model.json"
TMP_TAG = ".tmp-"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The model cache: ``cache`` if given, else ``$VLLM_DDTREE_CACHE``, else ``<repo root>/.cache/models``."""
    if cache is None:
        cache = os.environ.get("VLLM_DDTREE_CACHE") or (repo_root() / ".cache" / "models")
    path = Path(cache).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def recipe_key(recipe: dict) -> str:
    blob = json.dumps({"recipe_version": RECIPE_VERSION, **recipe}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def read_marker(path: Path) -> dict | None:
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path, recipe: dict | None = None) -> bool:
    """True when ``path`` holds a finished build (marker present, files present with their recorded sizes) and,
    if ``recipe`` is given, was built from that recipe."""
    path = Path(path)
    marker = read_marker(path)
    if marker is None:
        return False
    if recipe is not None and marker.get("key") != recipe_key(recipe):
        return False
    for rel, size in marker.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def build_atomic(final: Path, recipe: dict, builder: Callable[[Path], None], force: bool = False) -> Path:
    """Build ``final`` with ``builder(tmp_dir)`` unless a complete build of the same recipe is there.

    The builder writes into a fresh temp dir next to ``final``; the marker is written last and the temp dir is
    renamed onto ``final``. On any exception the temp dir is removed and ``final`` is left untouched (absent, or
    the previous build)."""
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with file_lock(parent / f".{final.name}.lock"):
        if not force and is_complete(final, recipe):
            return final
        # We hold the lock: any leftover temp dir of this name is from a dead build.
        for stale in parent.glob(f".{final.name}{TMP_TAG}*"):
            remove_tree(stale)
        if final.exists():
            logger.info("rebuilding %s (stale or incomplete)", final)
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP_TAG}", dir=parent))
        try:
            builder(tmp)
            files = {
                str(p.relative_to(tmp)): p.stat().st_size
                for p in sorted(tmp.rglob("*"))
                if p.is_file() and p.name != MARKER
            }
            marker = {
                "recipe": recipe,
                "recipe_version": RECIPE_VERSION,
                "key": recipe_key(recipe),
                "files": files,
                "bytes": sum(files.values()),
                "build_seconds": round(time.monotonic() - t0, 2),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            _normalize_permissions(tmp)
            if final.exists() or final.is_symlink():
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP_TAG}old-", dir=parent))
                os.rename(final, old / "x")
                remove_tree(old)
            os.rename(tmp, final)
        except BaseException:
            remove_tree(tmp)
            raise
        logger.info("built %s in %.1f s (%.1f MB)", final, marker["build_seconds"], marker["bytes"] / 1e6)
        return final


def _normalize_permissions(root: Path) -> None:
    """mkdtemp makes 0700 dirs and some writers 0600 files; make the model readable like a normal checkout."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
