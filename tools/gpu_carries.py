"""Deal the GPU bundle and model files into device transfers that fit beside the working tree, and rejoin them there.

A device call sends the working tree plus the folders it carries, 64 MiB in all. The tree holds the trained drafter
fixture (about 25 MB), so the vLLM bundle's 60 MiB parts (.gpu/d0 ...) no longer fit a call. ``pack`` cuts every
file under the given folders into pieces and deals them into ``.gpu/carry/NN/`` folders of at most ``--limit-mib``
(default: what the tracked tree leaves of 64 MiB, less a margin); each folder's ``pieces.json`` says which file,
offset and whole-file sha256 every piece belongs to. On the device, ``unpack`` after each call moves the pieces
into ``.gpu/_pieces/`` (ignored outputs stay between calls on a warm machine) and rejoins every file whose pieces
have all arrived at its original path, checked against its sha256. Then ``install.sh collect .gpu/dN`` and
``tools/gpu_session.sh setup`` find their files where they always did.

    python3 tools/gpu_carries.py pack .gpu/d0 .gpu/d1 .gpu/d2 .gpu/m0 .gpu/m1        # here; prints the calls
    python3 tools/gpu_carries.py unpack .gpu/carry/00                                # there, one per call
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

TRANSFER_LIMIT = 64 << 20
MARGIN = 2 << 20
PIECES = Path(".gpu/_pieces")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def tracked_tree_bytes(root: Path) -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def pack(folders: list[Path], out: Path, limit: int) -> list[Path]:
    """Deal the files under ``folders`` into ``out/NN/`` folders of at most ``limit`` bytes each; return them."""
    if out.exists():
        shutil.rmtree(out)
    carries: list[Path] = []
    manifest: dict[str, dict] = {}
    room = 0

    def close() -> None:
        if carries:
            (carries[-1] / "pieces.json").write_text(json.dumps(manifest, indent=1))

    files = sorted(f for folder in folders for f in folder.rglob("*") if f.is_file())
    for path in files:
        size, digest, offset = path.stat().st_size, sha256(path), 0
        with path.open("rb") as src:
            while True:  # at least one piece, so an empty file arrives too
                if room == 0:
                    close()
                    carries.append(out / f"{len(carries):02d}")
                    carries[-1].mkdir(parents=True)
                    manifest, room = {}, limit
                chunk = src.read(min(room, size - offset))
                name = f"{len(manifest):03d}.piece"
                (carries[-1] / name).write_bytes(chunk)
                manifest[name] = {"path": str(path), "offset": offset, "size": size, "sha256": digest}
                offset += len(chunk)
                room -= len(chunk)
                if offset >= size:
                    break
    close()
    return carries


def unpack(carry: Path, pieces: Path = PIECES) -> tuple[list[str], list[str]]:
    """Move ``carry``'s pieces into ``pieces`` and rejoin complete files; return (files rejoined, files waiting)."""
    for name, info in json.loads((carry / "pieces.json").read_text()).items():
        into = pieces / info["sha256"]
        into.mkdir(parents=True, exist_ok=True)
        (into / "file.json").write_text(json.dumps({k: info[k] for k in ("path", "size", "sha256")}))
        shutil.move(str(carry / name), into / f"{info['offset']:012d}")
    done, waiting = [], []
    for into in sorted(p for p in pieces.glob("*") if p.is_dir()):
        info = json.loads((into / "file.json").read_text())
        parts = sorted(p for p in into.iterdir() if p.name != "file.json")
        if sum(p.stat().st_size for p in parts) < info["size"]:
            waiting.append(info["path"])
            continue
        target = Path(info["path"])
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as dst:
            for part in parts:
                dst.write(part.read_bytes())
        if sha256(target) != info["sha256"]:
            target.unlink()
            raise SystemExit(f"gpu_carries: {target} rejoined with the wrong sha256; pack and send it again")
        shutil.rmtree(into)
        done.append(info["path"])
    return done, waiting


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: deal FOLDERS into .gpu/carry/NN")
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path(".gpu/carry"))
    p.add_argument("--limit-mib", type=float, default=None, help="per carry folder (default: 64 MiB - tracked tree)")
    u = sub.add_parser("unpack", help="on the device: rejoin what has arrived")
    u.add_argument("carry", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "pack":
        tree = tracked_tree_bytes(Path.cwd())
        limit = int(args.limit_mib * (1 << 20)) if args.limit_mib else TRANSFER_LIMIT - tree - MARGIN
        carries = pack(args.folders, args.out, limit)
        print(f"tracked tree {tree / (1 << 20):.1f} MiB; {len(carries)} carries of <= {limit / (1 << 20):.1f} MiB:")
        for c in carries:
            print(f'  run(carry=["{c}"], command="python3 tools/gpu_carries.py unpack {c}")')
        return 0
    done, waiting = unpack(args.carry)
    print(f"rejoined: {' '.join(done) or '-'}; waiting for more pieces: {' '.join(waiting) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
