"""Qwen3.5 / Qwen3.6 dense targets as vLLM 0.26.0 serves them (``Qwen3_5ForConditionalGeneration``), offline.

The deployment DDTree exists for is Qwen3.6-27B: GatedDeltaNet layers with full attention every fourth layer,
dense MLPs, M-RoPE (interleaved, three position rows; equal rows for text), a vision tower. vLLM builds it from a
``Qwen3_5Config`` (``model_type`` qwen3_5, text and vision sub-configs) and asks the model directory for a Qwen3-VL
processor, which it uses to profile the vision tower at start-up even when every prompt is text. So each directory
here holds the config, SmolLM2's tokenizer plus the four vision tokens the processor needs, and a processor whose
images are capped small (the profile stays cheap; text prompts never reach the tower).

* ``tiny_qwen3_5_dir()``: random weights (bf16 safetensors, deterministic from a seed), 8 layers (GDN, GDN, GDN,
  attention, ...), hidden 256, vision tower of 2 blocks, present and unused. For CPU engine tests.
* ``qwen3_5_shaped_dir("qwen3.6-27b")``: Qwen3.6-27B's public dimensions, config only (vLLM's
  ``load_format="dummy"`` makes the weights in memory), for step timing on one H200.

vLLM's Qwen3-VL processing imports torchvision (``transformers...image_processing_qwen2_vl``): without it vLLM
cannot even inspect the architecture (``ModuleNotFoundError: No module named 'torchvision'``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The cache, random weights and tokenizer plumbing of the other fixture models.
from ddtree_testkit.model_cache import build_atomic, cache_dir
from ddtree_testkit.model_files import tokenizer_files, tokenizer_ids
from ddtree_testkit.random_weights import random_tensor
from ddtree_testkit.smollm2 import smollm2_dir

# Qwen3-VL's processor finds its placeholders in the tokenizer under these names.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen3.6-27B (also Qwen3.5-27B), from third-party transcriptions of its config.json in the public code index (the
# HF file itself was not read; hybrid/memory.py uses the same GDN numbers).
QWEN36_27B_TEXT: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
QWEN36_27B_VISION: dict[str, Any] = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120,
    num_position_embeddings=2304,
)

# The tiny target: Qwen3.5's layout at test size. Rotary dims 64 * 0.25 = 16, so the three M-RoPE sections
# (8 frequency pairs) are all non-empty: a depth shift applied to only one position row would change the output.
TINY_TEXT: dict[str, Any] = dict(
    vocab_size=49280, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
)
TINY_VISION: dict[str, Any] = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256, num_position_embeddings=64,
)

SHAPES = {"qwen3.6-27b": (QWEN36_27B_TEXT, QWEN36_27B_VISION)}

# Shared by every Qwen3.5 dense model: attention output gate, float32 recurrent state (vLLM copies mamba_ssm_dtype
# into mamba_ssm_cache_dtype), 16x16 patches merged 2x2.
_TEXT_COMMON = dict(attn_output_gate=True, mamba_ssm_dtype="float32", hidden_act="silu", rms_norm_eps=1e-6,
                    tie_word_embeddings=False, partial_rotary_factor=0.25)
_VISION_COMMON = dict(in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[])
# Images up to 128 x 128 pixels (64 patches, 16 tokens): vLLM profiles the tower with the largest.
_MAX_PIXELS = 128 * 128

# Random init (N(0, std) per tensor, see tiny_targets.TINY_DEFAULTS for why embeddings and q/k are larger). The
# GDN gates get a decay near 0.88 per token (exp(-exp(A_log) * softplus(dt_bias)), dt_bias about -2), so the
# recurrent state carries several tokens back and a wrong state shows in the outputs.
_STD = {"embed_tokens": 0.5, "q_proj.weight": 0.2, "k_proj.weight": 0.2}
_INIT_STD = 0.05


def _init_std(name: str) -> float:
    return next((std for key, std in _STD.items() if key in name), _INIT_STD)


def qwen3_5_config(text: dict, vision: dict, vision_token_ids: dict[str, int], special_ids: dict):
    """The ``Qwen3_5Config`` of a dense Qwen3.5 target with these text / vision dimensions."""
    from transformers import Qwen3_5Config

    text_config = {**_TEXT_COMMON, **text, "bos_token_id": special_ids["bos_token_id"],
                   "eos_token_id": special_ids["eos_token_id"], "pad_token_id": special_ids["pad_token_id"],
                   "dtype": "bfloat16"}
    cfg = Qwen3_5Config(
        text_config=text_config, vision_config={**_VISION_COMMON, **vision}, tie_word_embeddings=False,
        image_token_id=vision_token_ids["<|image_pad|>"], video_token_id=vision_token_ids["<|video_pad|>"],
        vision_start_token_id=vision_token_ids["<|vision_start|>"],
        vision_end_token_id=vision_token_ids["<|vision_end|>"],
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.dtype = "bfloat16"
    return cfg


def write_tokenizer_and_processor(tokenizer_dir: Path, out: Path) -> dict[str, int]:
    """SmolLM2's tokenizer plus ``VISION_TOKENS`` (ids past its vocabulary, inside the target's padded one) and a
    Qwen3-VL processor with small images, into ``out``; returns the vision token ids."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    size = {"shortest_edge": 32 * 32, "longest_edge": _MAX_PIXELS}
    patches = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **patches),
        video_processor=Qwen3VLVideoProcessor(size={**size, "longest_edge": 4 * _MAX_PIXELS}, **patches),
        tokenizer=tok, chat_template=tok.chat_template,
    )
    processor.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}


def _recipe_inputs(tok_dir: Path) -> dict:
    import hashlib

    files = tokenizer_files(tok_dir)
    return {"tokenizer_sha": hashlib.sha256(b"".join((tok_dir / f).read_bytes() for f in files)).hexdigest()[:16]}


def tiny_qwen3_5_dir(*, seed: int = 0, cache: str | os.PathLike | None = None,
                     tokenizer_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The random-weight tiny ``Qwen3_5ForConditionalGeneration`` (see the module docstring)."""
    cache = cache_dir(cache)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else smollm2_dir(cache)
    recipe = {"recipe": "tiny-qwen3_5", "text": TINY_TEXT, "vision": TINY_VISION, "seed": seed,
              "max_pixels": _MAX_PIXELS, **_recipe_inputs(tok_dir)}

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import Qwen3_5ForConditionalGeneration

        cfg = qwen3_5_config(TINY_TEXT, TINY_VISION, write_tokenizer_and_processor(tok_dir, tmp),
                             tokenizer_ids(tok_dir))
        with torch.device("meta"):
            model = Qwen3_5ForConditionalGeneration(cfg)
        tensors = {}
        for name, param in sorted(model.state_dict().items()):
            tensor = random_tensor(tuple(param.shape), name, seed, _init_std(name), torch.float32)
            if name.endswith("linear_attn.dt_bias"):
                tensor = tensor * 10 - 2.0
            tensors[name] = tensor.to(torch.bfloat16)
        del model
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(tmp)

    return build_atomic(cache / ("tiny-qwen3_5" + (f"-s{seed}" if seed else "")), recipe, build, force=force)


def qwen3_5_shaped_dir(shape: str, *, cache: str | os.PathLike | None = None,
                       tokenizer_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """A config-only ``Qwen3_5ForConditionalGeneration`` of a real model's dimensions (``SHAPES``): load it with
    ``load_format="dummy"``. Token ids past the tokenizer's vocabulary can be generated: don't detokenize."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    text, vision = SHAPES[shape]
    cache = cache_dir(cache)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else smollm2_dir(cache)
    recipe = {"recipe": "qwen3_5-shaped", "shape": shape, "text": text, "vision": vision, "max_pixels": _MAX_PIXELS,
              **_recipe_inputs(tok_dir)}

    def build(tmp: Path) -> None:
        cfg = qwen3_5_config(text, vision, write_tokenizer_and_processor(tok_dir, tmp), tokenizer_ids(tok_dir))
        cfg.save_pretrained(tmp)

    return build_atomic(cache / f"shaped-{shape}", recipe, build, force=force)

