"""Both runner adapters against the one-screen reference step (ddtree_testkit/reference_step.py).

A batch of requests, each with a prefix in a paged KV cache, a root and its drafter's logits, goes through a verify
step the way each runner drives it: trees built on the device and handed over by request slot, the runner's row
layout (Model Runner V2's own input kernels; V1's spec-decode metadata), ``prepare_verify``, a toy target forward
(K/V written at linear slots, the tree attention kernel with depth positions), the adapter's sampler (walk and KV
compaction) and the drafter's linearisation. Each must commit the reference's tokens and leave in the cache the K/V
the reference computes by running each request's accepted path as a plain chain. Sampled steps are held to the
target's distribution by the chi-square tests in test_tree_sampler.py (both runners' ways of drawing).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddtree_testkit.reference_step import ToyTarget, reference_step
from vllm_ddtree.attention.triton_tree import tree_attention
from vllm_ddtree.kv_compact import kv_compact_torch
from vllm_ddtree.tree.build import build_chain, build_tree
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.tree_handover import RequestSlots, TreeHandover
from vllm_ddtree.verify_core import TreeVerifyCore

VOCAB, DIM, BUDGET, DEPTH, BLOCK, MAX_BLOCKS, MAX_REQS, MAX_TOKENS = 24, 16, 8, 4, 4, 8, 6, 96
# (request slot, prefix length s, drafts fed): one fed fewer drafts than the budget (a prefix of its tree).
REQUESTS = [(4, 9, BUDGET), (1, 5, 5), (3, 13, BUDGET)]
# A chain step (the chain fallback): the widest requests were fed ``DEPTH`` drafts, one ``DEPTH - 1``.
CHAIN_REQUESTS = [(4, 9, DEPTH), (1, 5, DEPTH - 1), (3, 13, DEPTH)]
DEVICE = torch.device("cpu")


class Scenario:
    """Prefixes in a paged cache, roots and draft logits, the reference step of every request."""

    def __init__(self, seed: int, step: str = "tree"):
        """``step``: "tree"; "chain", the step verifies the DFlash chains (the chain fallback on, each request fed its
        tree's first drafts, the widest ``DEPTH``); "chain-only", the same step after a drafter that knew it would be
        a chain step and filed only the chains (``build_chain``), which the runner fed."""
        chain = step != "tree"
        self.requests = CHAIN_REQUESTS if chain else REQUESTS
        self.chain, self.chain_only = chain, step == "chain-only"
        gen = torch.Generator().manual_seed(seed)
        self.target = ToyTarget.random(VOCAB, DIM, seed)
        self.prefixes = [torch.randint(0, VOCAB, (s,), generator=gen).tolist() for _, s, _ in self.requests]
        self.roots = torch.randint(0, VOCAB, (len(self.requests),), generator=gen)
        # A drafter that knows the target's greedy continuation and ranks it first or second at each depth (or not
        # at all), beside decoys: trees that get accepted, down branches that are not the first child too.
        self.draft_logits = torch.randn(len(self.requests), DEPTH, VOCAB, generator=gen)
        for r, prefix in enumerate(self.prefixes):
            for d, token in enumerate(self.greedy_continuation(prefix + [int(self.roots[r])], DEPTH)):
                decoys = torch.randint(0, VOCAB, (2,), generator=gen)
                self.draft_logits[r, d, decoys] += torch.tensor([6.0, 5.0])
                u = float(torch.rand((), generator=gen))
                self.draft_logits[r, d, token] += 7.0 if u < 0.5 else 5.5 if u < 0.85 else 0.0
        self.refs = [reference_step(self.target, prefix, int(root), self.draft_logits[r], BUDGET, fed, chain)
                     for r, (prefix, root, (_, _, fed)) in enumerate(zip(self.prefixes, self.roots, self.requests))]
        by_slot = torch.randperm(MAX_REQS * MAX_BLOCKS, generator=gen).view(MAX_REQS, MAX_BLOCKS).to(torch.int32)
        self.block_table = by_slot[[slot for slot, _, _ in self.requests]]  # batch order
        self.cache = torch.zeros(MAX_REQS * MAX_BLOCKS, BLOCK, 1, 2 * DIM, dtype=torch.float32)
        for r, prefix in enumerate(self.prefixes):
            _, k, v = self.target.qkv(torch.tensor(prefix), torch.arange(len(prefix)))
            self.write_kv(r, torch.arange(len(prefix)), k, v)
        self.handover = TreeHandover(MAX_REQS, BUDGET, DEVICE, DEPTH if chain else 0)
        self.core = TreeVerifyCore(self.handover, DEPTH, MAX_REQS, MAX_TOKENS, DEVICE, cuda_graphs=False)
        self.core.compaction = self
        self.group = 0

    def greedy_continuation(self, tokens: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            seq = torch.tensor(tokens + out)
            q, k, v = self.target.qkv(seq, torch.arange(len(seq)))
            mask = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
            out.append(int(self.target.logits(q, k, v, mask)[-1].argmax()))
        return out

    # ------------------------------------------------------------------ the paged cache

    def write_kv(self, r: int, logical: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        blocks = self.block_table[r, logical // BLOCK].long()
        self.cache[blocks, logical % BLOCK, 0] = torch.cat([k, v], dim=1).to(torch.float32)

    def read_kv(self, r: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        logical = torch.arange(n)
        row = self.cache[self.block_table[r, logical // BLOCK].long(), logical % BLOCK, 0]
        return row[:, :DIM], row[:, DIM:]

    def __call__(self, block_table, ctx_lens, accepted):  # the core's compaction over this cache
        kv_compact_torch([self.cache], block_table, ctx_lens, accepted)

    # ------------------------------------------------------------------ the step

    def file_trees(self, slots: torch.Tensor) -> TreeBatch:
        """The drafter's side: the device build of every request's tree, filed under its slot."""
        batch_trees = TreeBatch.allocate(MAX_REQS, BUDGET, DEVICE)
        chains = torch.zeros(MAX_REQS, DEPTH, dtype=torch.int64) if self.chain else None
        if self.chain_only:
            build_chain(self.draft_logits, batch_trees, self.roots, chains)
        else:
            build_tree(self.draft_logits, BUDGET, batch_trees, self.roots, chain_out=chains)
        self.batch_trees = batch_trees
        self.handover.file(slots, batch_trees, len(self.requests), chains)
        return batch_trees

    def forward(self, input_ids, linear_positions, positions, query_start_loc, logits_indices) -> torch.Tensor:
        """The toy target over this step's rows: K/V at linear slots, RoPE at (depth) positions, tree attention."""
        q, k, v = self.target.qkv(input_ids, positions)
        starts = query_start_loc.tolist()
        for r in range(len(self.requests)):
            rows = slice(starts[r], starts[r + 1])
            self.write_kv(r, linear_positions[rows], k[rows], v[rows])
        seq_lens = torch.tensor([s + fed + 1 for _, s, fed in self.requests], dtype=torch.int32)
        key_cache, value_cache = self.cache.split(DIM, dim=-1)
        out = torch.zeros(q.shape[0], 1, DIM, dtype=torch.float32)
        tree_attention(q.to(torch.float32)[:, None], key_cache, value_cache, out, query_start_loc, seq_lens,
                       self.block_table, self.core.attention.ancestor_bits, DIM**-0.5,
                       tree_rows=self.core.attention.tree_rows[: len(self.requests)])
        return (out[:, 0].to(torch.float64) @ self.target.wo)[logits_indices.long()]

    def check(self, tokens_by_request: list[list[int]]) -> None:
        """Committed tokens and the cache after the step equal the reference's."""
        for r, ((_, s, _), ref) in enumerate(zip(self.requests, self.refs)):
            assert tokens_by_request[r] == ref.tokens, f"request {r}"
            m = len(ref.accepted) - 1
            keys, values = self.read_kv(r, s + m + 1)
            torch.testing.assert_close(keys, ref.keys.to(torch.float32), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(values, ref.values.to(torch.float32), atol=1e-4, rtol=1e-4)
        assert max(len(ref.accepted) for ref in self.refs) >= 3, "the scenario should accept a path of depth >= 2"
        if self.chain:  # the runner fed the trees' first drafts, which are not the chains: prepare swapped them
            fed = [self.batch_trees.token_ids[r, 1 : n + 1].tolist() for r, (_, _, n) in enumerate(self.requests)]
            chains = [ref.tree.token_ids[0, 1 : n + 1].tolist() for ref, (_, _, n) in zip(self.refs, self.requests)]
            assert (fed == chains) == self.chain_only  # (after build_chain the runner fed the chains themselves)
        else:
            assert any(node != k for ref in self.refs for k, node in enumerate(ref.accepted)), "and off the node order"


def well_conditioned(scenario: Scenario) -> bool:
    """No node's greedy choice sits within float32 error of a tie (the test must not depend on near-ties)."""
    return all(ref.min_margin > 1e-3 for ref in scenario.refs)


SEEDS = [0, 1, 7]  # each accepts paths off the node order (checked in Scenario.check)
CHAIN_SEEDS = [1, 23, 33]  # each accepts a chain of depth >= 2 (checked too)
STEPS = [pytest.param(seed, "tree", id=f"tree-{seed}") for seed in SEEDS] + [
    pytest.param(seed, step, id=f"{step}-{seed}") for step in ("chain", "chain-only") for seed in CHAIN_SEEDS]


@pytest.mark.parametrize("seed, step", STEPS)
def test_model_runner_v2_adapter_commits_the_reference_step(seed, step):
    from vllm.v1.worker.gpu.input_batch import (
        InputBuffers,
        combine_sampled_and_draft_tokens,
        expand_idx_mapping,
        prepare_pos_seq_lens,
    )

    from vllm_ddtree.mrv2.sampler import MRV2TreeSampler
    from vllm_ddtree.mrv2.speculator import DDTreeSpeculator

    sc = Scenario(seed, step)
    assert well_conditioned(sc)
    idx_mapping = torch.tensor([slot for slot, _, _ in sc.requests], dtype=torch.int32)
    batch_trees = sc.file_trees(idx_mapping)
    # MRV2's request state: s computed tokens, the root as last sampled, the tree's tokens as the drafts.
    num_computed = torch.zeros(MAX_REQS, dtype=torch.int32)
    last_sampled = torch.zeros(MAX_REQS, dtype=torch.int64)
    draft_tokens = torch.zeros(MAX_REQS, BUDGET, dtype=torch.int64)
    for r, (slot, s, _) in enumerate(sc.requests):
        num_computed[slot], last_sampled[slot] = s, sc.roots[r]
        draft_tokens[slot] = batch_trees.token_ids[r, 1:]
    nd = np.array([fed for _, _, fed in sc.requests], dtype=np.int32)
    cu_np = np.concatenate([[0], np.cumsum(nd + 1)]).astype(np.int32)
    num_reqs, num_tokens = len(sc.requests), int(cu_np[-1])
    buffers = InputBuffers(MAX_REQS, MAX_TOKENS, DEVICE)
    buffers.query_start_loc[: num_reqs + 1] = torch.from_numpy(cu_np)
    buffers.query_start_loc[num_reqs + 1 :] = num_tokens
    cu = torch.from_numpy(cu_np)
    expanded_idx_mapping, expanded_local_pos = expand_idx_mapping(idx_mapping, num_tokens, cu, 1 + BUDGET)
    prepare_pos_seq_lens(idx_mapping, buffers.query_start_loc[: num_reqs + 1], num_computed, buffers.positions,
                         buffers.seq_lens)
    logits_indices = combine_sampled_and_draft_tokens(
        buffers.input_ids, idx_mapping, last_sampled, buffers.query_start_loc[: num_reqs + 1],
        buffers.seq_lens[:num_reqs], torch.ones(MAX_REQS, dtype=torch.int32), draft_tokens, cu, num_tokens)
    batch = SimpleNamespace(
        num_reqs=num_reqs, num_tokens=num_tokens, idx_mapping=idx_mapping, idx_mapping_np=idx_mapping.numpy(),
        expanded_idx_mapping=expanded_idx_mapping, expanded_local_pos=expanded_local_pos,
        num_draft_tokens=int(nd.sum()), num_draft_tokens_per_req=nd, seq_lens=buffers.seq_lens[:num_reqs],
        input_ids=buffers.input_ids[:num_tokens], positions=buffers.positions[:num_tokens],
        logits_indices=logits_indices, cu_num_logits=cu, cu_num_logits_np=cu_np,
        query_start_loc=buffers.query_start_loc[: num_reqs + 1],
    )
    linear = batch.positions.clone()
    speculator = SimpleNamespace(core=sc.core, block_tables=SimpleNamespace(input_block_tables=[sc.block_table]))
    DDTreeSpeculator.prepare_verify(speculator, batch)
    logits = sc.forward(batch.input_ids, linear, batch.positions, batch.query_start_loc, logits_indices)
    stub = SimpleNamespace(
        compute_nans=False, logprobs_mode="raw_logprobs",
        req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=torch.ones(MAX_REQS, dtype=torch.int32))),
        sampling_states=SimpleNamespace(max_num_logprobs=lambda _: -1),
        sample=lambda logits, *args, **kwargs: (logits.argmax(-1), logits),
    )
    out = MRV2TreeSampler(speculator, stub, fallback=None)(logits, batch)
    sc.check([out.sampled_token_ids[r, : int(out.num_sampled[r])].tolist() for r in range(num_reqs)])
    order = sc.core.linearise(sc.core.take_step())
    assert torch.equal(batch.positions, linear)  # the drafter sees linear positions again
    if order is None:  # a chain step: no permutation, for each accepted path already follows its root
        assert step in ("chain", "chain-only")
        order = torch.arange(num_tokens)
    for r, ref in enumerate(sc.refs):  # and each accepted path right after its root
        root = int(cu_np[r])
        assert order[root : root + len(ref.accepted)].tolist() == [root + node for node in ref.accepted]


@pytest.mark.parametrize("seed, step", STEPS)
def test_v1_adapter_commits_the_reference_step(seed, step):
    from vllm_ddtree.v1.sampler import TreeRejectionSampler

    sc = Scenario(seed, step)
    assert well_conditioned(sc)
    req_ids = [f"req-{slot}" for slot, _, _ in sc.requests]
    slots = RequestSlots(MAX_REQS)
    slot_ids = torch.tensor(slots.lookup(req_ids, set(req_ids)), dtype=torch.int64)  # as the proposer files them
    batch_trees = sc.file_trees(slot_ids)
    # V1's rows: each request schedules its root then the drafts fed, contiguously; logits on all of them.
    nd = np.array([fed for _, _, fed in sc.requests], dtype=np.int32)
    cu_tokens = np.cumsum(nd + 1)
    num_tokens = int(cu_tokens[-1])
    input_ids = torch.zeros(MAX_TOKENS, dtype=torch.int32)
    positions = torch.zeros(MAX_TOKENS, dtype=torch.int64)
    for r, (_, s, fed) in enumerate(sc.requests):
        start = int(cu_tokens[r]) - fed - 1
        input_ids[start : start + fed + 1] = batch_trees.token_ids[r, : fed + 1].to(torch.int32)
        positions[start : start + fed + 1] = torch.arange(s, s + fed + 1)
    linear = positions[:num_tokens].clone()
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids, block_table=[SimpleNamespace(
            get_device_tensor=lambda n: sc.block_table[:n])]),
        requests=set(req_ids), input_ids=SimpleNamespace(gpu=input_ids), positions=positions,
        seq_lens=torch.tensor([s + fed + 1 for _, s, fed in sc.requests], dtype=torch.int32), uses_mrope=False,
    )
    metadata = SimpleNamespace(cu_num_sampled_tokens=torch.from_numpy(cu_tokens.astype(np.int32)),
                               logits_indices=torch.arange(num_tokens, dtype=torch.int32))
    tree_sampler = TreeRejectionSampler(sc.core, slots, runner, SimpleNamespace(sampler=None))
    tree_sampler.prepare_verify(metadata, nd, cu_tokens)
    qsl = torch.from_numpy(np.concatenate([[0], cu_tokens]).astype(np.int32))
    logits = sc.forward(input_ids[:num_tokens], linear, positions[:num_tokens], qsl, metadata.logits_indices)
    greedy = SimpleNamespace(allowed_token_ids_mask=None, all_greedy=True, max_num_logprobs=None)
    out = tree_sampler(metadata, None, logits, greedy).sampled_token_ids
    sc.check([[t for t in row if t >= 0] for row in out.tolist()])
