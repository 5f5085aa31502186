"""The target's side of the data: its continuations (transformers ``generate``) and the hidden states of the drafter's
target layers, from the generation pass or from one teacher-forced forward per batch of whole sequences.

Layer id ``i`` means the *output of decoder layer i* = HF ``hidden_states[i + 1]`` (vLLM captures aux layer ``i + 1``
for it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch


def resolve_device(spec: str | torch.device) -> torch.device:
    if isinstance(spec, torch.device):
        return spec
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def load_target_model(target_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # features are stored in bf16 anyway
    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()


def check_layer_ids(model, layer_ids: list[int]) -> None:
    n_layers = model.config.get_text_config().num_hidden_layers
    if max(layer_ids) + 1 >= n_layers:
        # HF's last hidden_states entry is after the final norm; vLLM's aux capture is before it.
        raise ValueError(f"target layer ids {layer_ids} must be < num_hidden_layers - 1 = {n_layers - 1}")


def layer_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the drafter's target layers from HF ``hidden_states``: layer id i is ``hidden_states[i + 1]``
    (the output of decoder layer i; entry 0 is the embeddings), as vLLM's aux capture of layer i + 1."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Teacher-forced target features of right-padded ids [B, T] -> [B, T, n*H] (row t = concat over ids of HF
    ``hidden_states[id + 1][t]``). Causal attention: padding after a sequence never changes its rows, so no mask."""
    out = model(input_ids=ids.to(next(model.parameters()).device), output_hidden_states=True, logits_to_keep=1,
                use_cache=False)
    return layer_features(out.hidden_states, layer_ids)


@torch.no_grad()
def teacher_forced_features(model, seqs: list[list[int]], layer_ids: list[int], *, batch_tokens: int = 32768,
                            feature_dtype: torch.dtype = torch.bfloat16, desc: str = "features") -> list[torch.Tensor]:
    """Features [len, n*H] of each full token sequence from ONE teacher-forced forward per batch of sequences (the
    same rows ``generate_with_features`` takes from the generation pass; the last row is zeros likewise)."""
    from tqdm import tqdm

    check_layer_ids(model, layer_ids)
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
    batches: list[list[int]] = []
    for i in order:  # longest first: a batch's width is its first sequence's length
        if batches and (len(batches[-1]) + 1) * len(seqs[batches[-1][0]]) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    results: list[Any] = [None] * len(seqs)
    for batch in tqdm(batches, desc=desc, unit="batch", dynamic_ncols=True, file=sys.stderr):
        width = len(seqs[batch[0]])
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        feats = target_features(model, ids, layer_ids).to("cpu", feature_dtype)
        for r, i in enumerate(batch):
            f = feats[r, : len(seqs[i])].clone()
            f[-1] = 0
            results[i] = f
    return results


def _eos_ids(model, tok) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tok.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


@torch.no_grad()
def generate_with_features(model, tok, prompts: list[list[int]], layer_ids: list[int], *, max_new_tokens: int,
                           sample: bool, seed: int, batch_size: int, feature_dtype: torch.dtype,
                           desc: str = "generate", temperature: float = 1.0) -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt: (prompt + continuation token ids, features [len, n*H]).

    Features row t = concat over ids of HF ``hidden_states[id + 1][t]`` (the output of decoder layer id), taken from
    the generation pass itself (prefill rows for the prompt, one row per decode step after it). The last token's
    row is zeros: no anchor ever uses it as context. The continuation stops after the first EOS."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    check_layer_ids(model, layer_ids)
    device = next(model.parameters()).device
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = _eos_ids(model, tok)
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample,
                               temperature=temperature if sample else None, top_k=0 if sample else None,
                               top_p=1.0 if sample else None,
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
        prefill = layer_features(steps[0], layer_ids).float().cpu()
        decode = (torch.cat([layer_features(s, layer_ids) for s in steps[1:]], dim=1).float().cpu()
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


class OnlineFeatures:
    """Target-layer features computed when a batch is made (``features="online"`` data): one teacher-forced forward
    of the frozen target over the batch's context ids, on the training device (bf16 on CUDA, float32 on CPU)."""

    def __init__(self, target_dir: Path, layer_ids: list[int], device: torch.device):
        self.model = load_target_model(Path(target_dir), device)
        check_layer_ids(self.model, layer_ids)
        self.layer_ids = list(layer_ids)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return target_features(self.model, ids, self.layer_ids)
