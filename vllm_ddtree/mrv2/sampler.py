"""MRV2TreeSampler: Model Runner V2's adapter on the verifying side, in its ``RejectionSampler``'s place.

MRV2 feeds each decode request ``1 + nd`` rows: the root (its last sampled token) and ``nd`` drafts read from
``req_states.draft_tokens[slot]``, which the speculator filled with the tree's tokens one step earlier. Per verify
step: one token per node with the runner's own ``Sampler`` (Gumbel noise keyed by the depth position, so siblings
share noise and every emitted token is a fresh draw given the emitted prefix: seeded sampling equals no-spec's token
for token), then ``TreeVerifyCore.walk`` (walk and KV compaction), then MRV2's ``SamplerOutput`` contract with
freshly allocated tensors (``AsyncOutput`` copies them on a side stream while the next step runs), the budget
choices' acceptance (``ddtree_acceptance``) among them. Steps without a verify step in flight, and chain steps (the
chain fallback: causal rows, each request's chain fed, swapped in by ``prepare`` where needed), go to vLLM's
``RejectionSampler``, as in vLLM's DFlash chain engine. No host sync: only the CPU arrays MRV2 holds for the step.

vLLM's warm-up decode step (``warmup_kernels``: B drafts per request) is a tree step here, so it would never run
vLLM's rejection kernels, which then compiled at the first chain step while serving (H100, 2026-12-06: four Triton
JIT compilations, 1-4 s, at the first request). The first tree step therefore also runs vLLM's sampler once, after
the walk is done with the logits (vLLM's sampler edits them in place), and drops its output; and a chain step's
sampled tokens are cut to ``depth + 1`` columns, as a tree step's, so MRV2's post-update kernel runs the variant
compiled for those (vLLM's are ``B + 1`` wide).
"""

from __future__ import annotations

import torch


class MRV2TreeSampler:
    """``(logits, input_batch, draft_logits) -> SamplerOutput``, MRV2's ``RejectionSampler`` call."""

    def __init__(self, speculator, sampler, fallback):
        self.speculator = speculator  # mrv2.speculator.DDTreeSpeculator: its core, block tables and KV caches
        self.core = speculator.core
        self.sampler = sampler  # the runner's gpu.sample.sampler.Sampler
        self.fallback = fallback  # vLLM's RejectionSampler
        self._fallback_compiled = not self.core.runner_verifies_chains  # (module docstring)

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits: torch.Tensor | None = None):
        core = self.core
        step = core.step
        if step is None:
            return self.fallback(logits, input_batch, draft_logits)
        if step.chain and core.runner_verifies_chains:
            core.runner_verified(step)
            output = self.fallback(logits, input_batch, draft_logits)
            output.sampled_token_ids = output.sampled_token_ids[:, : core.depth + 1].contiguous()
            return output
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.metrics.logits import get_num_nans
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        sampler = self.sampler
        if core.compaction is None:
            self.speculator.bind_kv_caches()
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        rows = input_batch.logits_indices
        max_num_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        return_logprobs = max_num_logprobs >= 0  # NO_LOGPROBS is -1
        # One token per node; positions are the depth positions, which key the Gumbel noise.
        node_row_tokens, processed = sampler.sample(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            input_batch.positions[rows],
            input_batch.input_ids[rows],
            input_batch.expanded_local_pos,
            return_logprobs=return_logprobs,
        )
        num_reqs = step.num_reqs
        block_table = self.speculator.block_tables.input_block_tables[core.compaction.group][:num_reqs]
        walk = core.walk(step, node_row_tokens, block_table, input_batch.seq_lens)

        width = min(core.depth + 1, step.output_width)  # CPU data: no sync
        sampled = walk.output_token_ids[:num_reqs, :width].to(torch.int64)  # a copy: AsyncOutput reads it later
        num_sampled = walk.num_accepted[:num_reqs] + 1  # a new tensor
        logprobs = None
        if return_logprobs:
            logprobs = self._logprobs(
                step,
                input_batch,
                processed if sampler.logprobs_mode in ("processed_logprobs", "processed_logits") else logits,
                sampled,
                num_sampled,
                max_num_logprobs,
            )
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled,
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            sampler.req_states.prefill_len.gpu,
        )
        output = SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )
        # Accepted drafts per budget choice, [R, C] (None for a fixed budget): patch 0004's AsyncOutput copies it to
        # the host beside the sampled tokens and hands it to the scheduler on ModelRunnerOutput.
        output.ddtree_acceptance = core.acceptance(step)
        if not self._fallback_compiled:  # vLLM's warm-up decode step: compile what chain steps run
            self.fallback(logits, input_batch, draft_logits)  # last: it edits the logits in place
            self._fallback_compiled = True
        return output

    def _logprobs(self, step, input_batch, logits, sampled, num_sampled, max_num_logprobs: int):
        """Logprobs as vLLM's RejectionSampler lays them out: output j of request r comes from logits row
        ``cu[r] + j``, so rows are first put in path order (``TreeVerifyCore.path_rows``)."""
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        num_logits = logits.shape[0]
        row_starts = step.prepared.row_starts
        order = self.core.path_rows(step, num_logits)
        width = sampled.shape[1]
        j = torch.arange(width, device=sampled.device)
        dest = torch.where(j[None, :] < num_sampled[:, None], row_starts[:, None] + j[None, :], num_logits)
        flat_sampled = torch.zeros(num_logits + 1, dtype=sampled.dtype, device=sampled.device)
        flat_sampled.scatter_(0, dest.reshape(-1), sampled.reshape(-1))
        expanded_logits = num_logits != input_batch.idx_mapping.shape[0]
        return compute_topk_scores(
            logits.index_select(0, order),
            max_num_logprobs,
            flat_sampled[:num_logits],
            input_batch.cu_num_logits_np.tolist() if expanded_logits else None,
            logits_mode=self.sampler.logprobs_mode in ("raw_logits", "processed_logits"),
        )
