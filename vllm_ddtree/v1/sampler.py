"""TreeRejectionSampler: the V1 runner's adapter on the verifying side, in ``RejectionSampler``'s place.

Patch 0002 builds it with ``tree_rejection_sampler(runner)`` and calls ``prepare_verify`` right after the slot
mapping of a step with drafts. It translates V1's contracts for ``TreeVerifyCore``:

- ``prepare_verify``: V1's spec-decode metadata (logits rows = each request's last ``1 + drafts`` tokens) and the
  runner's buffers become ``RowInputs``; each request's slot comes from the proposer's ``RequestSlots``;
- ``forward`` (``RejectionSampler``'s signature): one token per logits row with the request's sampling parameters
  (V1's semantics, ``sampler.sample_node_tokens``), the walk and compaction, then V1's output contract
  ``[R, 1 + max drafts]`` (accepted tokens, bonus, -1) and logprobs along the accepted path, and under budget
  choices what each would have accepted (``ddtree_acceptance``, for the scheduler). Steps without a verify
  step in flight (vLLM's dummy and profiling runs) go to vLLM's own ``RejectionSampler``.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree.sampler import sample_node_tokens
from vllm_ddtree.verify_rows import RowInputs


def tree_rejection_sampler(runner) -> TreeRejectionSampler:
    """Patch 0002's hook: the runner's drafter is a ``DDTreeProposer``; vLLM's RejectionSampler stays the fallback."""
    drafter = runner.drafter
    fallback = runner.rejection_sampler
    # The fallback sees only steps without trees (vLLM's dummy runs); synthetic acceptance is the walk's
    # (synthetic_acceptance.py), and vLLM's CPU kernels refuse its chain version.
    fallback.synthetic_conditional_rates, fallback.synthetic_mode = None, False
    return TreeRejectionSampler(drafter.core, drafter.slots, runner, fallback)


class TreeRejectionSampler(torch.nn.Module):
    def __init__(self, core, slots, runner, fallback: torch.nn.Module):
        super().__init__()
        self.core = core
        self.slots = slots
        self.runner = runner
        self.sampler = fallback.sampler  # vLLM's Sampler: its logprobs helpers and mode
        self.fallback = fallback
        device = core.device
        max_reqs = core.verify_trees.token_ids.shape[0]
        self._cu_num_logits = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self._slot_ids = torch.zeros(max_reqs, dtype=torch.int64, device=device)

    def prepare_verify(self, metadata, num_draft_tokens: np.ndarray, cu_num_tokens: np.ndarray) -> None:
        """Right after the slot mapping of a step with drafts (patch 0002)."""
        runner = self.runner
        num_reqs = len(num_draft_tokens)
        slots = self.slots.lookup(runner.input_batch.req_ids[:num_reqs], runner.requests)
        self._slot_ids[:num_reqs].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        self._cu_num_logits[1 : num_reqs + 1].copy_(metadata.cu_num_sampled_tokens)
        rows = RowInputs(
            slots=self._slot_ids[:num_reqs],
            cu_num_logits=self._cu_num_logits[: num_reqs + 1],
            logits_indices=metadata.logits_indices,
            input_ids=runner.input_ids.gpu,
            positions=runner.positions,
            mrope_positions=runner.mrope_positions.gpu if getattr(runner, "uses_mrope", False) else None,
            num_reqs=num_reqs,
            num_tokens=int(cu_num_tokens[num_reqs - 1]),
        )
        self.core.prepare(rows, np.asarray(num_draft_tokens))

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        core = self.core
        step = core.step
        if step is None:
            return self.fallback(metadata, draft_probs, logits, sampling_metadata)
        runner = self.runner
        if core.compaction is None:  # the KV caches exist only after vLLM allocated them
            core.bind_kv_caches(runner.compilation_config.static_forward_context,
                                runner.drafter._draft_attn_layer_names, runner.kv_cache_config.kv_cache_groups)
        row_tokens = self._sample_rows(logits, step, sampling_metadata)
        block_table = runner.input_batch.block_table[core.compaction.group].get_device_tensor(step.num_reqs)
        walk = core.walk(step, row_tokens, block_table, runner.seq_lens)
        width = step.output_width
        out = torch.full((step.num_reqs, width), -1, dtype=torch.int32, device=core.device)
        n = min(width, core.depth + 1)
        out[:, :n] = walk.output_token_ids[: step.num_reqs, :n]
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(step, logits, out, sampling_metadata.max_num_logprobs)
        output = SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)
        # Accepted drafts per budget choice (None for a fixed budget); patch 0002 puts it on the synchronous
        # ModelRunnerOutput. The asynchronous output goes without: the budget policy then keeps its own samples.
        output.ddtree_acceptance = core.acceptance(step)
        return output

    def _sample_rows(self, logits: torch.Tensor, step, md) -> torch.Tensor:
        """One token per logits row with its request's sampling parameters (vLLM's semantics, sampler.py).

        min_p and logit_bias need no handling: vLLM refuses them for every speculative method."""
        req = step.prepared.row_request
        if md.allowed_token_ids_mask is not None:
            logits = logits.masked_fill(md.allowed_token_ids_mask[req], float("-inf"))
        if md.all_greedy:
            return logits.argmax(dim=-1)

        def per_row(x):
            return None if x is None else x[req]

        # Seeded requests draw every one of their rows from their own generator, in row order.
        generators = {}
        if md.generators:
            starts = np.cumsum(step.num_drafts_cpu + 1) - (step.num_drafts_cpu + 1)
            for r, gen in md.generators.items():
                for row in range(starts[r], starts[r] + step.num_drafts_cpu[r] + 1):
                    generators[int(row)] = gen
        tokens = sample_node_tokens(
            logits[:, None, :],
            all_greedy=False,
            all_random=md.all_random,
            temperature=per_row(md.temperature),
            top_k=per_row(md.top_k),
            top_p=per_row(md.top_p),
            generators=generators,
        )
        return tokens.view(-1)

    def _logprobs(self, step, logits: torch.Tensor, tokens: torch.Tensor, k: int):
        """Logprobs of every output slot: output j of request r was drawn at its j-th accepted node, logits row
        ``start[r] + acc[r, j]``; padding slots (token -1) are dropped by vLLM's parse_output."""
        num_reqs, width = tokens.shape
        order = self.core.path_rows(step, logits.shape[0])
        j = torch.arange(width, device=logits.device)
        rows = (step.prepared.row_starts[:, None] + j[None, :]).clamp(max=logits.shape[0] - 1)
        chosen = logits[order[rows.flatten()]].to(torch.float32)
        if not self.sampler.logprobs_mode.endswith("logits"):
            chosen = self.sampler.compute_logprobs(chosen)
        return self.sampler.gather_logprobs(chosen, k, tokens.clamp(min=0).flatten().to(torch.int64))
