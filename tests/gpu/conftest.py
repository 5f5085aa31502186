"""Tests that need a CUDA GPU (tools/gpu_session.sh phase ``gputests``); every test here skips without one.

Unlike tests/unit, Triton compiles for the GPU here (no interpreter). The unit tests' batch builders are shared."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
