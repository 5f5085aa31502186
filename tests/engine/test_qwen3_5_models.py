"""The Qwen3_5ForConditionalGeneration fixtures (ddtree_testkit.qwen3_5_models): the architecture vLLM serves
Qwen3.5/3.6 dense models as, at test size and at Qwen3.6-27B's dimensions."""

from __future__ import annotations

import json

from safetensors import safe_open

from ddtree_testkit import qwen3_5_models
from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.shapes import shaped_target_dir
from vllm_ddtree.hybrid import memory


def test_tiny_qwen3_5_is_the_architecture_vllm_serves(smollm2_dir):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    target = qwen3_5_models.tiny_qwen3_5_dir()
    cfg = json.loads((target / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["Qwen3_5ForConditionalGeneration"], "qwen3_5")
    text = cfg["text_config"]
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    rope = text["rope_parameters"]
    assert rope["mrope_interleaved"] and min(rope["mrope_section"]) > 0
    assert 2 * sum(rope["mrope_section"]) == int(text["head_dim"] * rope["partial_rotary_factor"])
    assert text["mamba_ssm_dtype"] == "float32" and text["attn_output_gate"]
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.visual.blocks.") for n in names), "the vision tower is present"
    assert any(n.endswith("linear_attn.in_proj_qkv.weight") for n in names)  # Qwen3.5's unfused GDN projections
    processor = json.loads((target / "processor_config.json").read_text())
    assert processor["processor_class"] == "Qwen3VLProcessor"
    vocab = json.loads((target / "tokenizer.json").read_text())["added_tokens"]
    assert {t["content"]: t["id"] for t in vocab}["<|image_pad|>"] == cfg["image_token_id"] < text["vocab_size"]

    drafter = json.loads((random_dflash_dir(target, block_size=8) / "config.json").read_text())
    assert drafter["num_target_layers"] == 8 and drafter["hidden_size"] == text["hidden_size"]
    mask = drafter["dflash_config"]["mask_token_id"]
    assert max(t["id"] for t in vocab) < mask < text["vocab_size"], "the mask token is a padded vocabulary id"

    # Not degenerate: the random target continues different prompts differently (transformers, float32).
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(target), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in ([1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
            outs.append(tuple(out[0, len(prompt):].tolist()))
    assert len(set(outs)) == len(outs), outs


def test_the_27b_shape_is_qwen36_27b_and_what_the_memory_model_sizes(smollm2_dir):
    """bench_e2e --shape qwen3.6-27b times the target whose GDN state hybrid/memory.py budgets."""
    cfg = json.loads((shaped_target_dir("qwen3.6-27b") / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert memory.GDNShapes.from_config(cfg) == memory.QWEN36_27B
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["intermediate_size"]) == (64, 5120, 17408)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (24, 4, 256)
    assert text["rope_parameters"]["mrope_section"] == [11, 11, 10] and text["vocab_size"] == 248320
    assert (vision["depth"], vision["hidden_size"], vision["out_hidden_size"]) == (27, 1152, 5120)
