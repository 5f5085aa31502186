"""Reading a Hugging Face model directory: its JSON files, chat template, tokenizer files and special token ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def maybe_json(path: Path) -> dict:
    try:
        return load_json(path)
    except (OSError, ValueError):
        return {}


def config_fingerprint(model_dir: Path) -> str:
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]


def chat_template_text(model_dir: Path) -> str:
    model_dir = Path(model_dir)
    parts = []
    if (model_dir / "chat_template.jinja").is_file():
        parts.append((model_dir / "chat_template.jinja").read_text())
    tc = maybe_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(tc, str):
        parts.append(tc)
    elif isinstance(tc, list):
        parts.extend(str(t.get("template", "")) for t in tc)
    return "\n".join(parts)


def tokenizer_files(tokenizer_dir: Path) -> list[str]:
    """The ``TOKENIZER_FILES`` present in ``tokenizer_dir`` (what a model built with its tokenizer copies)."""
    return sorted(f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file())


def tokenizer_ids(tokenizer_dir: Path) -> dict:
    """bos / eos / pad token ids and the vocabulary size of the tokenizer (and config) in ``tokenizer_dir``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = maybe_json(Path(tokenizer_dir) / "config.json")
    return {
        "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else cfg.get("bos_token_id"),
        "eos_token_id": tok.eos_token_id if tok.eos_token_id is not None else cfg.get("eos_token_id"),
        "pad_token_id": tok.pad_token_id,
        "vocab_size": int(cfg.get("vocab_size") or len(tok)),
    }
