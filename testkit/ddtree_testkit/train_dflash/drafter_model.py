"""A second implementation of vLLM 0.26.0's DFlash drafter (``qwen3_dflash.py``), trainable, with the checkpoint's
parameter names; loaded from and exported to the DFlash checkpoint format (``ddtree_testkit.dflash_checkpoint``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_testkit.dflash_checkpoint import dflash_weight_shapes


class RMSNorm(nn.Module):
    """vLLM ``ir.ops.rms_norm`` / ``fused_add_rms_norm``: float32 statistics, weight applied in its dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        orig = x.dtype
        xf = x.float()
        if residual is not None:
            xf = xf + residual.float()
            residual = xf.to(orig)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf.to(self.weight.dtype) * self.weight).to(orig)
        return out if residual is None else (out, residual)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (vLLM ``get_rope`` default, HF ``rotate_half``).

    x [..., T, heads, hd]; cos/sin [..., T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nq, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(h, self.nq * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=bias)
        self.o_proj = nn.Linear(self.nq * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """vLLM ``precompute_and_store_context_kv``: k = RoPE(k_norm(k_proj(ctx))), v = v_proj(ctx)."""
        B, T, _ = ctx.shape
        k = _rope(self.k_norm(self.k_proj(ctx).view(B, T, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(ctx).view(B, T, self.nkv, self.hd)
        return k, v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        B, Q, _ = x.shape
        q = _rope(self.q_norm(self.q_proj(x).view(B, Q, self.nq, self.hd)), cos, sin)
        k = _rope(self.k_norm(self.k_proj(x).view(B, Q, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(x).view(B, Q, self.nkv, self.hd)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # [B, nkv, T+Q, hd]
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        rep = self.nq // self.nkv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1),
                                           scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nq * self.hd))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: dict, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout  # training only, on the attention and MLP outputs (vLLM has none: eval mode)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = DFlashMLP(cfg)

    def forward(self, x, residual, cos, sin, ctx_k, ctx_v, mask):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, ctx_k, ctx_v, mask)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        return x, residual


class DFlashDrafter(nn.Module):
    """vLLM 0.26.0 ``DFlashQwen3ForCausalLM`` as a trainable module; parameter names are the checkpoint's names.

    * context: ``ctx = hidden_norm(fc(concat target features))``; every layer projects it with its own k/v
      (``k_norm`` + RoPE at the context positions on K); the context never enters the residual stream.
    * block: target embeddings of ``[root, MASK...]`` through standard Qwen3 blocks whose attention sees the context
      K/V before the anchor and the whole block (non-causal); ``norm`` then the target's lm_head.
    ``embed`` / ``lm_head`` are the target's, frozen buffers (not saved)."""

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor, dropout: float = 0.0):
        super().__init__()
        dcfg = cfg.get("dflash_config") or {}
        if dcfg.get("causal") or cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
            raise ValueError("only all-full-attention, non-causal DFlash drafters are supported")
        self.cfg = cfg
        h = cfg["hidden_size"]
        n_feat = len(dcfg["target_layer_ids"])
        self.fc = nn.Linear(n_feat * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(cfg, dropout) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        rp = cfg.get("rope_parameters") or {}
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rp.get('rope_type')!r} is not supported (default RoPE only)")
        theta = float(rp.get("rope_theta") or cfg.get("rope_theta") or 1e6)
        hd = cfg["head_dim"]
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)),
                             persistent=False)
        self.block_size = int(cfg["block_size"])
        self.mask_token_id = int(dcfg["mask_token_id"])

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def _cos_sin(self, pos: torch.Tensor):
        freqs = pos.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos(), freqs.sin()

    def forward(self, feats: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor,
                block_valid: torch.Tensor | None = None) -> torch.Tensor:
        """feats [B, T, n*H] (context rows 0..T-1 at positions 0..T-1), block_ids [B, K, bs], anchors [B, K]
        (block k sits at positions anchors[:, k] + 0..bs-1 and sees context rows < anchors[:, k]).
        Returns the final hidden states [B, K, bs, H] (before the lm_head)."""
        B, T, _ = feats.shape
        K, bs = block_ids.shape[1], block_ids.shape[2]
        dev = feats.device
        ctx = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        ctx_cos, ctx_sin = self._cos_sin(torch.arange(T, device=dev).expand(B, T))
        qpos = (anchors.unsqueeze(-1) + torch.arange(bs, device=dev)).reshape(B, K * bs)
        q_cos, q_sin = self._cos_sin(qpos)
        # mask [B, K*bs, T + K*bs]: context rows before the anchor, plus the query's own block
        blk = torch.arange(K, device=dev).repeat_interleave(bs)
        ctx_vis = torch.arange(T, device=dev).view(1, 1, T) < anchors.repeat_interleave(bs, dim=1).unsqueeze(-1)
        own = (blk.view(-1, 1) == blk.view(1, -1)).expand(B, -1, -1)
        mask = torch.cat([ctx_vis, own], dim=-1)
        x = F.embedding(block_ids.reshape(B, K * bs), self.embed)
        if x.dtype != self.fc.weight.dtype and not torch.is_autocast_enabled(dev.type):
            x = x.to(self.fc.weight.dtype)
        residual = None
        for layer in self.layers:
            ck, cv = layer.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
            x, residual = layer(x, residual, q_cos, q_sin, ck, cv, mask)
        x, _ = self.norm(x, residual)
        return x.view(B, K, bs, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.to(hidden.dtype) if not torch.is_autocast_enabled(hidden.device.type)
                        else self.lm_head)

    def checkpoint_tensors(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.named_parameters()}


def _target_tensor(target_dir: Path, suffix: str) -> torch.Tensor | None:
    from safetensors import safe_open

    files = sorted(Path(target_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name.endswith(suffix) and "mtp" not in name:
                    return fh.get_tensor(name)
    return None


def target_embed_and_head(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head (the embedding when tied), float32."""
    embed = _target_tensor(target_dir, "embed_tokens.weight")
    if embed is None:
        raise RuntimeError(f"no embed_tokens.weight in {target_dir}")
    head = _target_tensor(target_dir, "lm_head.weight")
    return embed.float(), (embed if head is None else head).float()


def build_drafter(cfg: dict, target_dir: Path, device: torch.device, seed: int = 0,
                  buffer_dtype: torch.dtype = torch.float32, dropout: float = 0.0) -> DFlashDrafter:
    embed, head = target_embed_and_head(target_dir)
    model = DFlashDrafter(cfg, embed.to(buffer_dtype), head.to(buffer_dtype), dropout=dropout)
    model.init_weights(seed)
    return model.to(device)


def load_drafter(drafter_dir: str | os.PathLike, target_dir: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A saved drafter (config.json + model.safetensors) as a DFlashDrafter in ``dtype``."""
    from safetensors.torch import load_file

    drafter_dir = Path(drafter_dir)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    model = build_drafter(cfg, Path(target_dir), torch.device(device), buffer_dtype=dtype)
    sd = load_file(str(drafter_dir / "model.safetensors"))
    model.load_state_dict(sd, strict=True)
    for prm in model.parameters():  # not .to(dtype): the RoPE inv_freq buffer stays float32
        prm.data = prm.data.to(dtype)
    return model


def export_drafter(model: DFlashDrafter, cfg: dict, out_dir: Path, dtype: torch.dtype, log: dict | None = None) -> Path:
    """Write config.json + model.safetensors (names/shapes checked against dflash_weight_shapes)."""
    from safetensors.torch import save_file

    tensors = model.checkpoint_tensors(dtype)
    expect = dflash_weight_shapes(cfg)
    got = {n: tuple(t.shape) for n, t in tensors.items()}
    if got != expect:
        raise RuntimeError(f"checkpoint tensors differ from vLLM's expected layout: {set(got) ^ set(expect)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = dict(cfg, dtype=str(dtype).removeprefix("torch."))
    tmp = out_dir / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    (out_dir / ".config.json.tmp").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    os.replace(out_dir / ".config.json.tmp", out_dir / "config.json")
    if log is not None:
        (out_dir / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return out_dir
