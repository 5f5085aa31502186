"""spec_token_parents: the device-side mapping from GDN spec tokens to tree parents equals a host-side walk over
the batch (which rows are spec sequences, which verify a tree, how many tokens each scheduled)."""

import torch

from vllm_ddtree.hybrid.spec_parents import spec_token_parents

BUDGET = 6


def random_tree_parents(gen: torch.Generator, num_rows: int) -> torch.Tensor:
    parents = torch.full((num_rows, BUDGET + 1), -1, dtype=torch.int32)
    for r in range(num_rows):
        for i in range(1, BUDGET + 1):
            parents[r, i] = int(torch.randint(0, i, (), generator=gen))
    return parents


def host_reference(mask, query_lens, tree_parents, tree_rows, num_tokens):
    out = []
    spec_rows = [r for r in range(len(mask)) if mask[r]]
    for row, q in zip(spec_rows, query_lens):
        for k in range(q):
            out.append(int(tree_parents[row, k]) if tree_rows[row] >= 0 else k - 1)
    while len(out) < num_tokens:  # padding tokens: chain parents of the last sequence, never read
        out.append(None)
    return out


def test_spec_token_parents_matches_a_host_walk_of_the_batch():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        num_rows = int(torch.randint(1, 7, (), generator=gen))
        mask = torch.rand(num_rows, generator=gen) < 0.7
        tree_rows = torch.where(torch.rand(num_rows, generator=gen) < 0.7, torch.arange(num_rows), -1).to(torch.int32)
        tree_parents = random_tree_parents(gen, num_rows + 2)
        num_spec = int(mask.sum())
        query_lens = torch.randint(1, BUDGET + 2, (num_spec,), generator=gen).tolist()
        qsl = torch.tensor([0] + torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
        padding = trial % 3
        num_tokens = sum(query_lens) + padding
        out = torch.full((num_tokens,), 99, dtype=torch.int32)
        spec_token_parents(mask, qsl, tree_parents, tree_rows, out)
        expected = host_reference(mask.tolist(), query_lens, tree_parents, tree_rows.tolist(), num_tokens)
        got = out.tolist()
        for t, (e, g) in enumerate(zip(expected, got)):
            if e is not None:
                assert g == e, (trial, t, expected, got)
            else:
                assert -1 <= g < t + 1, "padding tokens must still get a valid sequence-relative parent"


def test_rows_without_a_tree_get_chain_parents_and_rows_with_one_their_tree():
    tree_parents = torch.full((3, BUDGET + 1), -1, dtype=torch.int32)
    tree_parents[0, 1:4] = torch.tensor([0, 0, 1], dtype=torch.int32)  # row 0: a branching tree
    tree_parents[2, 1:4] = torch.tensor([0, 0, 0], dtype=torch.int32)  # row 2: a star, but it verifies no tree
    mask = torch.tensor([True, False, True])  # row 1 is a prefill: not a spec sequence
    tree_rows = torch.tensor([0, -1, -1], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    out = torch.empty(8, dtype=torch.int32)
    spec_token_parents(mask, qsl, tree_parents, tree_rows, out)
    assert out.tolist() == [-1, 0, 0, 1, -1, 0, 1, 2]
