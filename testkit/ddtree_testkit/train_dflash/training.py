"""The training loop: weighted cross-entropy over the block slots, AdamW with warm-up and a cosine schedule (by steps or
a time budget), periodic held-out evals, a resume state every ``ckpt_every`` steps, and the export."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddtree_testkit.dflash_checkpoint import dflash_draft_config
from ddtree_testkit.train_dflash.batches import IGNORE, train_batch
from ddtree_testkit.train_dflash.drafter_model import DFlashDrafter, build_drafter, export_drafter
from ddtree_testkit.train_dflash.evaluation import evaluate
from ddtree_testkit.train_dflash.features import resolve_device
from ddtree_testkit.train_dflash.packing import attach_online_features, load_data

STATE_VERSION = 1


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
    dropout: float = 0.0  # on each layer's attention and MLP outputs, training only
    epochs: float | None = None  # token budget: steps = epochs x train anchors / (batch_size x anchors_per_seq)
    keep_best: bool = False  # export the weights of the best periodic held-out eval (tau_chain_est), not the last


def state_path_for(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.train-state" / "state.pt"


def lr_at(step: int, o: TrainOptions, time_frac: float | None = None) -> float:
    """Linear warm-up, then cosine to ``min_lr_ratio``. The cosine's progress is the larger of the step fraction and
    ``time_frac`` (the fraction of ``--time-budget`` spent since warm-up ended), so a time-limited run still anneals
    to the floor when the budget, not ``steps``, ends it."""
    if o.warmup and step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    span = max(1, o.steps - o.warmup)
    t = min(1.0, (step - o.warmup) / span)
    if time_frac is not None:
        t = max(t, min(1.0, max(0.0, time_frac)))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _fmt_acc(ev: dict) -> str:
    return " ".join(f"{a:.3f}" for a in ev["top1_per_depth"])


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


def train(target_dir: str | os.PathLike, out_dir: str | os.PathLike, data_dir: str | os.PathLike,
          opts: TrainOptions | None = None, device: str = "auto", fresh: bool = False) -> dict:
    """Train (or resume) a drafter on the cached data in ``data_dir``; write it to ``out_dir``; return the log."""
    opts = opts or TrainOptions()
    target_dir, out_dir = Path(target_dir).resolve(), Path(out_dir).resolve()
    dev = resolve_device(device)
    autocast = dev.type == "cuda"
    torch.manual_seed(opts.seed)
    meta, train_split, heldout = load_data(Path(data_dir))
    attach_online_features([train_split, heldout], target_dir, meta["layer_ids"], dev)
    if opts.epochs is not None:
        per_step = opts.batch_size * opts.anchors_per_seq
        opts = dataclasses.replace(opts, steps=max(1, math.ceil(opts.epochs * train_split.num_anchors() / per_step)))
        print(f"[train] {opts.epochs} epoch(s) of {train_split.num_anchors()} train anchors at {per_step} per step: "
              f"{opts.steps} steps", file=sys.stderr)
    cfg = dflash_draft_config(target_dir, block_size=opts.block_size, num_layers=opts.num_layers,
                                 mask_token_id=opts.mask_token_id, target_layer_ids=meta["layer_ids"])
    buffer_dtype = torch.bfloat16 if autocast else torch.float32
    model = build_drafter(cfg, target_dir, dev, seed=opts.seed, buffer_dtype=buffer_dtype, dropout=opts.dropout)
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
                                      "eval_anchors", "save_dtype", "stop_after", "keep_best", "epochs")
                         and not (k == "dropout" and v == 0.0)}}
    state_path = state_path_for(out_dir)
    log: dict[str, Any] = {"target_dir": str(target_dir), "data_dir": str(data_dir), "identity": ident,
                           "loss": [], "train_top1": [], "evals": [], "wall_s": 0.0, "warmup_end_wall_s": None}
    best: dict[str, Any] = {}  # keep_best: step, tau_chain_est, ce, state (of the best periodic eval)
    start = 0
    if state_path.is_file() and not fresh:
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        if st.get("version") == STATE_VERSION and st["identity"] == json.loads(json.dumps(ident)):
            model.load_state_dict(st["model"], strict=True)
            optim.load_state_dict(st["optim"])
            start, log = st["step"], st["log"]
            best = st.get("best") or {}
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
                      "optim": optim.state_dict(), "log": log, "best": best}, state_path)

    def better(ev: dict) -> bool:
        return not best or (ev["tau_chain_est"], -ev["ce"]) > (best["tau_chain_est"], -best["ce"])

    def wall() -> float:
        return wall0 + time.monotonic() - t0

    def time_frac() -> float | None:
        if opts.time_budget_s is None or log.get("warmup_end_wall_s") is None:
            return None
        w0 = log["warmup_end_wall_s"]
        return (wall() - w0) / max(1e-6, opts.time_budget_s - w0)

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
        if opts.time_budget_s is not None and wall() > opts.time_budget_s:
            print(f"[train] time budget reached at step {step}", file=sys.stderr)
            break
        if step >= opts.warmup and log.get("warmup_end_wall_s") is None:
            log["warmup_end_wall_s"] = wall()
        lr = lr_at(step, opts, time_frac())
        if opts.dropout:  # dropout masks a function of (seed, step): runs stay reproducible and resumable
            torch.manual_seed(opts.seed * 1_000_003 + step)
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
            mark = ""
            if opts.keep_best and better(ev):
                best = {"step": step, "tau_chain_est": ev["tau_chain_est"], "ce": ev["ce"],
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
                mark = " (best)"
            tqdm.write(f"[eval] step {step} held-out ce {ev['ce']:.4f} top1/depth {_fmt_acc(ev)} "
                       f"τ_chain≈{ev['tau_chain_est']:.3f}{mark}", file=sys.stderr)
        log["wall_s"] = wall0 + time.monotonic() - t0
        if opts.ckpt_every and step % opts.ckpt_every == 0:
            save_state(step)
    bar.close()
    log["wall_s"] = wall0 + time.monotonic() - t0
    log["steps_done"] = step
    save_state(step)  # the last weights, for resuming (before keep_best may swap in the best ones)
    if opts.keep_best and best:
        ev = evaluate(model, heldout, dev, autocast, max_anchors=opts.eval_anchors)
        log["evals"].append({"step": step, "subset": True, **ev})
        if better(ev):
            best = {"step": step, "tau_chain_est": ev["tau_chain_est"], "ce": ev["ce"]}
        else:
            model.load_state_dict(best["state"], strict=True)
        log["exported_step"] = best["step"]
        print(f"[train] keep_best: exporting step {best['step']} (held-out subset τ_chain≈{best['tau_chain_est']:.3f},"
              f" last step {step}: {ev['tau_chain_est']:.3f})", file=sys.stderr)
    ev = evaluate(model, heldout, dev, autocast)
    log["final_eval"] = {"step": log.get("exported_step", step), **ev}
    print(f"[eval] final (step {log.get('exported_step', step)}) held-out ce {ev['ce']:.4f} top1/depth "
          f"{_fmt_acc(ev)} τ_chain≈{ev['tau_chain_est']:.3f} over {ev['blocks']} blocks", file=sys.stderr)
    export_drafter(model, cfg, out_dir, getattr(torch, opts.save_dtype), log)
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    print(f"[train] wrote {out_dir} ({size / 1e6:.1f} MB); training wall {log['wall_s']:.0f} s", file=sys.stderr)
    return log
