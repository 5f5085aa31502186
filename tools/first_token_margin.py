"""How close the target's first generated token is to a tie, per prompt: top-1 against top-2 log-probability.

bf16 outputs of two correct engines may differ where the target's top two logits are within rounding of each other:
batch composition changes the rounding of vLLM's matrix products (its kernels are not batch-invariant). This says
which prompts of ``bench_e2e.py``'s sets are such near-ties at token 0, in float32 and bf16, with HF transformers on
the CPU (CPU bf16 kernels are not the GPU's: the bf16 gaps show the sensitivity, not the GPU's logits).

    python tools/first_token_margin.py --prompt-set heldout --num-prompts 12 --out out/first_token_margin.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def first_token_top2(model, tokenizer, prompt_ids: list[list[int]]) -> list[dict]:
    rows = []
    for ids in prompt_ids:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        logprobs = torch.log_softmax(logits.float(), -1)
        top, tokens = logprobs.topk(2)
        rows.append({"tokens": tokens.tolist(), "text": [tokenizer.decode([t]) for t in tokens.tolist()],
                     "logprobs": top.tolist(), "gap": (top[0] - top[1]).item(),
                     "argmax": int(logits.float().argmax())})  # an exact tie goes to the lower token id
    return rows


def main() -> None:
    from bench_e2e import load_prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (ddtree_testkit)")
    parser.add_argument("--prompt-set", choices=["chat", "heldout"], default="heldout")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--out", default="out/first_token_margin.json")
    args = parser.parse_args()
    if args.model is None:
        from ddtree_testkit.smollm2 import smollm2_dir

        args.model = str(smollm2_dir())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = load_prompts(args.prompt_set, args.num_prompts)
    # as bench_e2e renders them; vLLM then tokenises the text with add_special_tokens=True
    prompt_ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                          add_generation_prompt=True)).input_ids for t in texts]
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        results[str(dtype).removeprefix("torch.")] = first_token_top2(model, tokenizer, prompt_ids)
    print(f"{'prompt':>6}  {'top-1 / top-2 (float32)':32s} {'gap fp32':>9} {'gap bf16':>9} {'bf16 argmax':>11}")
    for i, (f32, b16) in enumerate(zip(results["float32"], results["bfloat16"])):
        pair = f"{f32['text'][0]!r} / {f32['text'][1]!r}"
        flip = "" if b16["argmax"] == f32["tokens"][0] else "  <- differs"
        print(f"{i:>6}  {pair:32s} {f32['gap']:9.4f} {b16['gap']:9.4f} {b16['argmax']:>11}{flip}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "prompt_set": args.prompt_set, "texts": texts, "prompt_ids": prompt_ids,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
