"""Training batches: random anchor blocks ``[token@a, MASK x (bs-1)]`` with their context features and labels, each
step's batch a function of (seed, step) only (reproducible, resumable)."""

from __future__ import annotations

import hashlib

import torch

from ddtree_testkit.train_dflash.packing import Split

IGNORE = -100


def _gen(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(hashlib.sha256(repr(parts).encode()).hexdigest()[:15], 16))


def make_batch(split: Split, seqs: list[int], anchor_lists: list[list[int]], block_size: int, mask_token_id: int):
    """Tensors for ``DFlashDrafter.forward`` + labels [B, K, bs-1] (IGNORE past the sequence end / padding)."""
    B = len(seqs)
    K = max(1, max(len(a) for a in anchor_lists))
    T = max(max(a) for a in anchor_lists if a)  # context rows needed: those before the last anchor
    online = split.feats is None
    if online:
        if split.featurizer is None:
            raise RuntimeError("this data has no stored features (features='online'): attach_online_features first")
        ctx_ids = torch.zeros(B, T, dtype=torch.long)
    else:
        feats = torch.zeros(B, T, split.feats.shape[1], dtype=split.feats.dtype)
    lens = []
    for b, i in enumerate(seqs):
        o, n = split.offsets[i], split.seq_len(i)
        m = min(T, n)
        lens.append(m)
        if online:
            ctx_ids[b, :m] = split.ids[o: o + m]
        else:
            feats[b, :m] = split.feats[o: o + m]
    # blocks, vectorised: padding blocks (k >= len(anchor list)) are all MASK at anchor 1 with IGNORE labels
    anchors = torch.ones(B, K, dtype=torch.long)
    real = torch.zeros(B, K, dtype=torch.bool)
    for b, alist in enumerate(anchor_lists):
        anchors[b, : len(alist)] = torch.tensor(alist, dtype=torch.long)
        real[b, : len(alist)] = True
    off = torch.tensor([split.offsets[i] for i in seqs], dtype=torch.long).view(B, 1, 1)
    n = torch.tensor([split.seq_len(i) for i in seqs], dtype=torch.long).view(B, 1, 1)
    pos = anchors.unsqueeze(-1) + torch.arange(block_size)  # [B, K, bs]: root at a, labels at a+1 .. a+bs-1
    tok = split.ids[off + torch.minimum(pos, n - 1)]
    inside = (pos < n) & real.unsqueeze(-1)
    block_ids = torch.full((B, K, block_size), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.where(real, tok[:, :, 0], block_ids[:, :, 0])
    labels = torch.where(inside[:, :, 1:], tok[:, :, 1:], torch.full_like(tok[:, :, 1:], IGNORE))
    if online:
        feats = split.featurizer(ctx_ids)
        for b, m in enumerate(lens):  # rows past a sequence are zeros, as in stored data (never visible anyway)
            if m < T:
                feats[b, m:] = 0
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
