"""Run the CPU vLLM engine once and print the generated token ids as JSON (tests run this in a subprocess).

    python tests/engine/engine_run.py '{"spec": null | {...}, "prompts": [...], "max_tokens": 32, ...}'

The engine runs in this process (no engine-core or worker subprocesses), so ``"oracle"`` can replace the ddtree
drafter's logits with an oracle that knows the no-spec continuation: it puts the right token first, second or
nowhere at each depth with the given probabilities. A random-weight drafter accepts nothing, so without the
oracle a verify step would never accept a node and the tree paths (walk, compaction, linearisation, depth
positions) would go untested.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def install_oracle(reference: dict[tuple[int, ...], list[int]], p_first: float, p_second: float, seed: int):
    """Make DDTreeProposer draft from the reference continuations (keyed by prompt token ids)."""
    import torch

    from vllm_ddtree import proposer as proposer_module
    from vllm_ddtree.tree.build import build_tree

    rng = torch.Generator().manual_seed(seed)

    def oracle_sample_draft_tokens(self, hidden_states, sampling_metadata):
        logits = self.model.compute_logits(hidden_states)
        depth = self.tree_depth
        num_reqs = logits.shape[0] // depth
        logits = torch.randn(logits.shape, generator=rng).view(num_reqs, depth, -1)
        roots = self.positions[: num_reqs * (1 + depth)].view(num_reqs, 1 + depth)[:, 0].tolist()
        for r, req_id in enumerate(self.runner.input_batch.req_ids[:num_reqs]):
            prompt = tuple(self.runner.requests[req_id].prompt_token_ids)
            sequence = list(prompt) + reference[prompt]
            for i in range(depth):
                pos = roots[r] + 1 + i
                if pos >= len(sequence):
                    break
                u = torch.rand((), generator=rng).item()
                decoy = int(torch.randint(logits.shape[-1], (), generator=rng))
                logits[r, i, decoy] += 9.0
                if u < p_first:
                    logits[r, i, sequence[pos]] += 10.0
                elif u < p_first + p_second:
                    logits[r, i, sequence[pos]] += 8.0
        build_tree(logits, self.tree_budget, self.draft_trees, self._root_token_ids)
        return self._placeholder_drafts[: num_reqs * depth], None

    proposer_module.DDTreeProposer._sample_draft_tokens = oracle_sample_draft_tokens


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    if args.get("oracle"):
        o = args["oracle"]
        reference = {tuple(p): c for p, c in zip(o["prompt_token_ids"], o["continuations"])}
        install_oracle(reference, o.get("p_first", 0.6), o.get("p_second", 0.25), o.get("seed", 0))

    llm = LLM(
        model=args["model"],
        dtype=args.get("dtype", "float32"),
        speculative_config=args.get("spec"),
        gpu_memory_utilization=0.1,
        max_model_len=args.get("max_model_len", 512),
        max_num_seqs=args.get("max_num_seqs", 8),
        max_num_batched_tokens=args.get("max_num_batched_tokens", 1024),
        enforce_eager=True,
        distributed_executor_backend="uni",
        seed=0,
        disable_log_stats=False,
    )
    params = [
        SamplingParams(
            temperature=args.get("temperature", 0.0),
            max_tokens=args.get("max_tokens", 32),
            seed=args.get("seed"),
            ignore_eos=args.get("ignore_eos", False),
        )
    ]
    prompts = [{"prompt_token_ids": p} for p in args["prompt_token_ids"]]
    results = []
    if args.get("one_at_a_time"):
        for prompt in prompts:
            results += llm.generate([prompt], params * 1, use_tqdm=False)
    else:
        results = llm.generate(prompts, params * len(prompts), use_tqdm=False)
    out = {"token_ids": [list(r.outputs[0].token_ids) for r in results]}
    metrics = {
        m.name: getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
        for m in llm.get_metrics()
        if "spec_decode" in m.name
    }
    out["spec_decode"] = metrics
    print("ENGINE_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
