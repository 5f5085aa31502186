"""Held-out evaluation of a drafter without an engine: top-1 accuracy per block position and the chain's τ estimate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree_testkit.train_dflash.batches import IGNORE, make_batch
from ddtree_testkit.train_dflash.drafter_model import DFlashDrafter
from ddtree_testkit.train_dflash.packing import Split


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
