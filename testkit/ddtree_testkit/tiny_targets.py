"""Random-weight tiny targets (Llama, Qwen3, the hybrid Qwen3-Next) with SmolLM2's tokenizer and vocabulary (49152).

Deterministic from a seed, bf16 safetensors. Head counts are divisible by 2 (TP=2 works).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from ddtree_testkit.model_cache import build_atomic, cache_dir
from ddtree_testkit.model_files import tokenizer_files, tokenizer_ids
from ddtree_testkit.random_weights import random_tensor
from ddtree_testkit.smollm2 import smollm2_dir

logger = logging.getLogger("ddtree_testkit.tiny_targets")

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


def tiny_config(arch: str, p: dict, tok_cfg: dict):
    """The transformers config of a target of architecture ``arch`` with the sizes ``p`` (``TINY_DEFAULTS`` keys and
    ``vocab_size``; ``hybrid`` overrides ``TINY_HYBRID``) and the special ids ``tok_cfg`` (``tokenizer_ids``)."""
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
    tok_files = tokenizer_files(tok_dir)
    tok_hash = hashlib.sha256(b"".join((tok_dir / f).read_bytes() for f in tok_files)).hexdigest()[:16]
    recipe = {"recipe": "tiny-target", "arch": arch, "params": params, "tokenizer_sha": tok_hash}

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file

        ids = tokenizer_ids(tok_dir)
        p = {**params, "vocab_size": ids["vocab_size"]}
        cfg = tiny_config(arch, p, ids)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        tensors = {}
        for name, param in sorted(model.state_dict().items()):
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            std = (p["embed_std"] if "embed_tokens" in name
                   else p["qk_std"] if name.endswith(("q_proj.weight", "k_proj.weight")) else p["init_std"])
            tensors[name] = random_tensor(tuple(param.shape), name, seed, std, torch.bfloat16)
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

    return build_atomic(cache / _tiny_dirname(arch, params), recipe, build, force=force)


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
