"""The DFlash drafter checkpoint format as vLLM 0.26.0 reads it (z-lab layout): config.json for a given target and
the tensor names and shapes of model.safetensors. The random drafters and the trainer both write it."""

from __future__ import annotations

from pathlib import Path

from ddtree_testkit.model_files import chat_template_text, load_json, maybe_json


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
    cfg = load_json(target_dir / "config.json")
    text_cfg = cfg.get("text_config", cfg)
    vocab_size = int(text_cfg["vocab_size"])
    tok_json = target_dir / "tokenizer.json"
    if not tok_json.is_file():
        return vocab_size - 1
    tok = load_json(tok_json)
    vocab = (tok.get("model") or {}).get("vocab") or {}
    added = tok.get("added_tokens") or []
    n_tok = max([len(vocab)] + [int(a["id"]) + 1 for a in added])
    if vocab_size > n_tok:
        return n_tok
    reserved: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        for src in (text_cfg, maybe_json(target_dir / "generation_config.json")):
            v = src.get(key)
            if isinstance(v, int):
                reserved.add(v)
            elif isinstance(v, list):
                reserved.update(int(x) for x in v)
    template = chat_template_text(target_dir)
    candidates = [
        int(a["id"])
        for a in added
        if a.get("special") and int(a["id"]) not in reserved and a["content"] not in template
    ]
    if candidates:
        return max(candidates)
    return vocab_size - 1


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
    tcfg_full = load_json(target_dir / "config.json")
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
