"""Launch configurations of the tree-attention kernel at verify shapes: which tile, warps, stages and KV split
make one layer's tree verify fastest (issue 19: at batch 1 and B=16 the kernel's 36 layers cost about 1 ms of a
7 ms step, FlashAttention 3's chain verify a third of that).

Needs only PyTorch and Triton (runs on a GPU host without vLLM). Per case (batch x budget, Qwen3-8B's attention
shape, a ``--context``-token prefix, trees from the real build), every configuration is checked against the
default's output and timed as a CUDA graph of ``--layers`` back-to-back calls (launch gaps as inside the model's
graph), median per call over ``--iters`` replays. Prints a table per case, writes JSON.

    python benchmarks/attention_sweep.py --out out/attention_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_tree_core as core  # noqa: E402

SPLITS = (None, 4, 8, 32)  # None: auto_kv_splits
LAUNCHES = (None, (64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2))  # block_m, tile, warps, stages
# --block: the tree-block pass after FlashAttention's prefix (tree_attention prefix_lse), a few keys per query.
BLOCK_LAUNCHES = (None, (128, 128, 8, 2), (128, 64, 4, 1), (128, 64, 8, 1), (128, 32, 4, 1), (128, 16, 4, 1),
                  (64, 64, 4, 1), (64, 32, 4, 1), (64, 16, 4, 1), (32, 32, 2, 1), (32, 16, 2, 1), (16, 16, 2, 1))


def _timed_layers(call, layers: int, iters: int) -> float:
    """Median microseconds per call of a graph replaying ``call`` ``layers`` times (bench_tree_core's timer)."""

    def step():
        for _ in range(layers):
            call()

    return statistics.median(core._time_graph(step, iters)) / layers


def sweep_case(batch: int, budget: int, context: int, layers: int, iters: int) -> list[dict]:
    from vllm_ddtree.attention.triton_tree import tree_attention

    core.ATTN_CTX = context
    case = core.Case(batch, budget, 15, 151936, "cuda", torch.bfloat16)
    x = core._attn_inputs(case)
    args = (x["q"], x["k"], x["v"], x["out"], x["qsl"], x["seq_lens"], x["block_table"], x["bits"], core.ATTN_D**-0.5)
    reference = tree_attention(*args).float().clone()
    rows = []
    for splits, launch in itertools.product(SPLITS, LAUNCHES):
        kwargs = {"num_kv_splits": splits}
        if launch is not None:
            kwargs.update(zip(("block_m", "tile_size", "num_warps", "num_stages"), launch))
        row = {"batch": batch, "budget": budget, "context": context, "splits": splits or "auto",
               "launch": "default" if launch is None else "/".join(map(str, launch))}
        try:
            out = tree_attention(*args, **kwargs).float()
            err = float((out - reference).norm() / reference.norm())
            row["rel_err"] = err
            if err < 1e-2:
                row["us"] = _timed_layers(lambda kw=kwargs: tree_attention(*args, **kw), layers, iters)
        except Exception as exc:  # a configuration the kernel cannot run (shared memory, registers)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep_block_case(batch: int, budget: int, context: int, layers: int, iters: int) -> list[dict]:
    """The tree-block pass (``prefix_lse``: keys from the prefix's end on, merged into a prefix output) per launch
    configuration, beside the kernel over every key; the prefix output and log-sum-exp are synthetic (this times
    the pass, test_tree_attention checks its arithmetic). Each call merges into ``out`` in place, so the timed graph
    needs no copy; every configuration is checked against the default from the same starting output."""
    from vllm_ddtree.attention.triton_tree import tree_attention

    core.ATTN_CTX = context
    case = core.Case(batch, budget, 15, 151936, "cuda", torch.bfloat16)
    x = core._attn_inputs(case)
    args = (x["q"], x["k"], x["v"], x["out"], x["qsl"], x["seq_lens"], x["block_table"], x["bits"], core.ATTN_D**-0.5)
    gen = torch.Generator(device="cuda").manual_seed(3)
    prefix_out = torch.randn(x["q"].shape, generator=gen, device="cuda").to(x["q"].dtype)
    # Prefix and block weigh alike (lse near the block's own), so a configuration that drops keys fails the check.
    lse = torch.randn(x["q"].shape[1], x["q"].shape[0], generator=gen, device="cuda") + 2.0

    def merged(**kwargs) -> torch.Tensor:
        x["out"].copy_(prefix_out)
        return tree_attention(*args, prefix_lse=lse, **kwargs).float().clone()

    reference = merged()
    base = {"batch": batch, "budget": budget, "context": context}
    rows = [{**base, "mode": "every key", "launch": "default",
             "us": _timed_layers(lambda: tree_attention(*args), layers, iters)}]
    print(json.dumps(rows[0]), flush=True)
    for launch in BLOCK_LAUNCHES:
        kwargs = {} if launch is None else dict(zip(("block_m", "tile_size", "num_warps", "num_stages"), launch))
        row = {**base, "mode": "block", "launch": "default" if launch is None else "/".join(map(str, launch))}
        try:
            err = float((merged(**kwargs) - reference).norm() / reference.norm())
            row["rel_err"] = err
            if err < 1e-2:
                row["us"] = _timed_layers(lambda kw=kwargs: tree_attention(*args, prefix_lse=lse, **kw), layers,
                                          iters)
        except Exception as exc:  # a configuration the kernel cannot run (shared memory, registers)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1x16,1x64,8x16,8x64", help="comma list of BATCHxBUDGET")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default="out/attention_sweep.json")
    parser.add_argument("--block", action="store_true", help="sweep the tree-block pass that follows FlashAttention's "
                        "prefix (FLASH_ATTN's verify) instead of the kernel over every key")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.cases.split(","):
        batch, budget = map(int, spec.split("x"))
        sweep = sweep_block_case if args.block else sweep_case
        case_rows = sweep(batch, budget, args.context, args.layers, args.iters)
        rows += case_rows
        timed = sorted((r for r in case_rows if "us" in r and r.get("mode") != "every key"), key=lambda r: r["us"])
        default = next((r for r in case_rows if r.get("splits", "auto") == "auto" and r["launch"] == "default"
                        and r.get("mode") != "every key"), {})
        every = next((r for r in case_rows if r.get("mode") == "every key"), None)
        print(f"\nbatch {batch}, B={budget}, context {args.context}: default {default.get('us', float('nan')):.1f} us"
              + (f" (every key: {every['us']:.1f} us)" if every else ""))
        for r in timed[:6]:
            print(f"  splits {r.get('splits', '-')!s:>4}  launch {r['launch']:>13}  {r['us']:7.1f} us")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
