"""Opt-in stack dumps from a stuck engine: with ``VLLM_DDTREE_HANG_DUMP_S=N`` every ddtree worker writes all its
threads' Python stacks to stderr every N seconds. On a remote GPU host a hung engine is killed by a time limit and
otherwise leaves no trace of where it was. (In its first use, on the H200 on 2026-11-30, only the first dump came out
although the process lived on; the engine's own log, which bench_e2e now keeps, was the better trace.)"""

from __future__ import annotations

import faulthandler
import os

HANG_DUMP_ENV = "VLLM_DDTREE_HANG_DUMP_S"


def arm_from_env() -> None:
    """Start the periodic dump when the variable asks for it (a no-op otherwise; re-arming replaces the timer)."""
    seconds = float(os.environ.get(HANG_DUMP_ENV) or 0)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, repeat=True)
