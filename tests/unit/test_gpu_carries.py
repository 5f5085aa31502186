"""tools/gpu_carries.py: files dealt into size-limited carry folders come back byte for byte, only once complete."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("gpu_carries", Path(__file__).parents[2] / "tools" / "gpu_carries.py")
gpu_carries = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_carries)


def make_files(root: Path) -> dict[str, bytes]:
    contents = {"d0/part-00": os.urandom(10_000), "d0/MANIFEST.sha256": b"", "m1/a.whl": os.urandom(4_097),
                "m1/sub/b.bin": os.urandom(100)}
    for name, data in contents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return contents


def test_pack_then_unpack_restores_every_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    contents = make_files(Path("."))
    carries = gpu_carries.pack([Path("d0"), Path("m1")], Path("carry"), limit=4096)
    assert len(carries) == 4  # 14,197 bytes in folders of 4,096
    assert all(sum(f.stat().st_size for f in c.glob("*.piece")) <= 4096 for c in carries)
    for name in contents:
        Path(name).unlink()
    done, waiting = gpu_carries.unpack(carries[0], Path("pieces"))
    assert "d0/part-00" in waiting and "d0/part-00" not in done and not Path("d0/part-00").exists()
    for carry in carries[1:]:
        done, waiting = gpu_carries.unpack(carry, Path("pieces"))
    assert waiting == []
    for name, data in contents.items():
        assert Path(name).read_bytes() == data, name


def test_a_corrupted_piece_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_files(Path("."))
    carries = gpu_carries.pack([Path("d0")], Path("carry"), limit=1 << 20)
    piece = next(carries[0].glob("*.piece"))
    if piece.stat().st_size == 0:
        piece = sorted(carries[0].glob("*.piece"))[-1]
    data = bytearray(piece.read_bytes())
    data[0] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="wrong sha256"):
        gpu_carries.unpack(carries[0], Path("pieces"))
