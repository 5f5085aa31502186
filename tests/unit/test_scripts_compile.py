"""Every Python file of the repo compiles. Lint parses files but skips the compiler's symbol-table checks, and most
benchmark and tool scripts run only on the GPU host: bench_tree_core.py once reached it with a SyntaxError (a name
used before its ``global`` statement) and cost that device call its attention table."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("benchmarks", "tools", "testkit", "vllm_ddtree", "tests")
                 for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_compiles(path: Path):
    compile(path.read_text(), str(path), "exec")
