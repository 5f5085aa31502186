"""tools/apply_patches.py on a throw-away copy of the installed vLLM's target files (never the real install)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "apply_patches.py"

spec = importlib.util.spec_from_file_location("apply_patches", TOOL)
ap = importlib.util.module_from_spec(spec)
sys.modules["apply_patches"] = ap  # dataclasses look their module up there
spec.loader.exec_module(ap)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# A directory holding a pristine vLLM 0.26.0 ``vllm/`` package, for when the installed one is patched by another
# patch set (e.g. a shared venv patched from another branch): the tests then take the pristine files from there.
PRISTINE_ENV = "VLLM_DDTREE_PRISTINE_VLLM"


def pristine_target(ps, installed: Path, path: str) -> str:
    """The pristine text of one target file: the installed file, un-patched if this patch set patched it."""
    text = (installed / path).read_text()
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest == ps.manifest[path]["patched"]:
        return ap.pristine_text(ps, path, text)
    if digest != ps.manifest[path]["pristine"] and os.environ.get(PRISTINE_ENV):
        return (Path(os.environ[PRISTINE_ENV]) / path).read_text()
    if digest != ps.manifest[path]["pristine"]:
        pytest.skip(f"the installed {path} is patched by another patch set; set {PRISTINE_ENV} to a pristine vLLM")
    return text


@pytest.fixture()
def fake_vllm(tmp_path: Path) -> Path:
    """A site-packages-like dir with vllm/__init__.py, _version.py and pristine copies of every target file and of
    every file vllm_ddtree overrides parts of."""
    installed = ap.find_vllm_root(None)
    ps = ap.load_patch_set()
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.26.0'\n")
    for path in ps.file_patches:
        text = pristine_target(ps, installed, path)
        dest = tmp_path / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        assert sha(dest) == ps.manifest[path]["pristine"]
    for path in ps.overrides:
        dest = tmp_path / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((installed / path).read_bytes())
    return tmp_path


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args, "--vllm-dir", str(root)], capture_output=True, text=True)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha(p) for p in sorted(root.rglob("*.py"))}


def test_every_patch_has_a_header():
    for patch in ap.load_patch_set().patch_files:
        header = patch.read_text().split("\n--- ", 1)[0]
        for section in ("What it changes", "Why", "What would let us drop it"):
            assert section in header, f"{patch.name} lacks '{section}' in its header"


def test_manifest_covers_exactly_the_patched_files():
    ps = ap.load_patch_set()
    assert set(ps.manifest) == set(ps.file_patches)


def test_apply_status_reapply_revert_cycle(fake_vllm: Path):
    ps = ap.load_patch_set()
    pristine = snapshot(fake_vllm)

    r = run(fake_vllm, "check")
    assert r.returncode == 0 and "would patch" in r.stdout
    assert snapshot(fake_vllm) == pristine, "check must not write"

    r = run(fake_vllm, "apply")
    assert r.returncode == 0, r.stderr
    for path in ps.file_patches:
        assert sha(fake_vllm / path) == ps.manifest[path]["patched"]

    r = run(fake_vllm, "status")
    assert r.returncode == 0 and "vLLM is patched" in r.stdout

    patched = snapshot(fake_vllm)
    r = run(fake_vllm, "apply")
    assert r.returncode == 0 and "already applied" in r.stdout
    assert snapshot(fake_vllm) == patched

    r = run(fake_vllm, "revert")
    assert r.returncode == 0, r.stderr
    assert snapshot(fake_vllm) == pristine, "revert must restore byte-identical files"
    assert not list(fake_vllm.rglob("*.ddtree-tmp")), "no temporary files left behind"


def test_refuses_tampered_file_and_changes_nothing(fake_vllm: Path):
    ps = ap.load_patch_set()
    victim = sorted(ps.file_patches)[-1]
    with open(fake_vllm / victim, "a") as f:
        f.write("# local edit\n")
    before = snapshot(fake_vllm)
    for command in ("apply", "check", "revert"):
        r = run(fake_vllm, command)
        assert r.returncode == 2
        assert victim in r.stderr and "refusing" in r.stderr
        assert snapshot(fake_vllm) == before, f"{command} changed files despite refusing"
    r = run(fake_vllm, "status")
    assert r.returncode == 1 and "unknown" in r.stdout


def test_refuses_a_vllm_whose_overridden_privates_moved(fake_vllm: Path):
    """Every private we override is listed with its file's pristine hash: a changed file is refused at apply/check
    time (naming what we rely on), while revert still restores a patched install."""
    ps = ap.load_patch_set()
    assert "vllm/v1/spec_decode/llm_base_proposer.py" in ps.overrides
    assert "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py" in ps.overrides
    victim = "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"
    with open(fake_vllm / victim, "a") as f:
        f.write("# a newer vLLM\n")
    before = snapshot(fake_vllm)
    for command in ("apply", "check"):
        r = run(fake_vllm, command)
        assert r.returncode == 2 and victim in r.stderr and "_generate_draft" in r.stderr
        assert snapshot(fake_vllm) == before
    assert run(fake_vllm, "revert").returncode == 0


def test_refuses_wrong_version(fake_vllm: Path):
    (fake_vllm / "vllm" / "_version.py").write_text("__version__ = version = '0.27.0'\n")
    before = snapshot(fake_vllm)
    r = run(fake_vllm, "apply")
    assert r.returncode == 2
    assert "found 0.27.0" in r.stderr and "0.26.0" in r.stderr
    assert snapshot(fake_vllm) == before


def test_accepts_cpu_local_version_label(fake_vllm: Path):
    (fake_vllm / "vllm" / "_version.py").write_text("__version__ = version = '0.26.0+cpu'\n")
    assert run(fake_vllm, "apply").returncode == 0


def test_missing_vllm_is_a_clear_error(tmp_path: Path):
    r = run(tmp_path, "status")
    assert r.returncode == 2 and "no vllm package" in r.stderr


def test_read_only_directory_refused_before_any_write(fake_vllm: Path, monkeypatch):
    """CI runs as root, which ignores permission bits, so the writability check is driven through os.access."""
    ps = ap.load_patch_set()
    paths = sorted(ps.file_patches)
    readonly_dir = (fake_vllm / paths[-1]).parent
    real_access = os.access
    monkeypatch.setattr(ap.os, "access", lambda p, mode: False if Path(p) == readonly_dir else real_access(p, mode))
    before = snapshot(fake_vllm)
    with pytest.raises(ap.PatchError, match="not writable"):
        ap.cmd_apply(ps, fake_vllm)
    assert snapshot(fake_vllm) == before


def test_failed_write_restores_files_already_written(fake_vllm: Path, monkeypatch):
    ps = ap.load_patch_set()
    paths = sorted(ps.file_patches)
    assert len(paths) >= 2, "this test needs a patch set touching two files"
    before = snapshot(fake_vllm)
    real_replace = ap._replace_file
    calls = {"n": 0}

    def flaky_replace(target: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        real_replace(target, data)

    monkeypatch.setattr(ap, "_replace_file", flaky_replace)
    with pytest.raises(ap.PatchError, match="restored"):
        ap.cmd_apply(ps, fake_vllm)
    assert snapshot(fake_vllm) == before


def test_hunk_mismatch_is_refused():
    fp = ap.parse_patch("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n", "t.patch")[0]
    assert ap.apply_hunks("a\nb\n", fp) == "a\nc\n"
    assert ap.apply_hunks("a\nc\n", fp, reverse=True) == "a\nb\n"
    with pytest.raises(ap.PatchError, match="does not match"):
        ap.apply_hunks("a\nz\n", fp)
