"""The data set on disk and in memory: every split's sequences packed flat (ids, features unless computed online) with
per-sequence offsets and prompt lengths, in one safetensors file per split."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree_testkit.train_dflash.features import OnlineFeatures


def pack(seqs: list[tuple[list[int], torch.Tensor | None]], prompt_lens: list[int]) -> dict[str, torch.Tensor]:
    """Flat ids (+ features unless None: ``features="online"``) with per-sequence offsets."""
    lens = [len(ids) for ids, _ in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    out = {
        "ids": torch.tensor([t for ids, _ in seqs for t in ids], dtype=torch.int32),
        "offsets": offsets,
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
    }
    if seqs and seqs[0][1] is not None:
        out["feats"] = torch.cat([f for _, f in seqs], dim=0).contiguous()
    return out


class Split:
    """One data split in memory: flat ids / features with per-sequence offsets."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        t = load_file(str(path))
        self.ids = t["ids"].long()
        self.feats = t.get("feats")  # None for features="online" data: ``featurizer`` computes them per batch
        self.offsets = t["offsets"].tolist()
        self.prompt_lens = t["prompt_lens"].tolist()
        self.featurizer: OnlineFeatures | None = None

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq_len(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def anchors(self, i: int) -> range:
        """Roots vLLM drafts from: target-generated tokens that have at least one label after them."""
        return range(self.prompt_lens[i], self.seq_len(i) - 1)

    def num_anchors(self) -> int:
        return sum(len(self.anchors(i)) for i in range(len(self)))


def attach_online_features(splits: list[Split], target_dir: Path, layer_ids: list[int], device: torch.device) -> None:
    """Give the splits without stored features an ``OnlineFeatures`` (one target model shared by all)."""
    need = [sp for sp in splits if sp.feats is None and sp.featurizer is None]
    if need:
        feat = OnlineFeatures(target_dir, layer_ids, device)
        for sp in need:
            sp.featurizer = feat


def load_data(data_dir: Path) -> tuple[dict, Split, Split]:
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    return meta, Split(Path(data_dir) / "train.safetensors"), Split(Path(data_dir) / "heldout.safetensors")
