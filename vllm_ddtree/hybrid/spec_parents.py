"""Each GDN speculative token's parent in this step's trees, from the GDN metadata alone (device ops, capturable).

vLLM's GDN layers see a verify step as "spec sequences" (``GDNAttentionMetadata.spec_sequence_masks``: the batch
rows decoding with drafts, in batch order) whose tokens are packed by ``spec_query_start_loc``. The tree kernels
(``tree_conv``, ``tree_gdn``) need, per packed token, its sequence-relative parent. The trees live in the
verifier's static ``TreeBatch`` by batch row, with ``tree_rows[r] >= 0`` while row r verifies a tree.

Inside a full CUDA graph the GDN layers replay without Python, so the parents cannot be gathered on the host:
this maps tokens to batch rows with a cumulative sum and a scatter (no data-dependent shapes, no host sync), once
per step, and every GDN layer of the step reads the result. Tokens of rows without a tree (a stale tree, or no
drafts) get chain parents (token k continues from k - 1), which is what vLLM's chain kernels compute for them.
"""

from __future__ import annotations

import torch


def spec_token_parents(
    spec_sequence_masks: torch.Tensor,
    spec_query_start_loc: torch.Tensor,
    tree_parents: torch.Tensor,
    tree_rows: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill ``out [T]`` (int32) with each spec token's sequence-relative parent (root -1) and return it.

    spec_sequence_masks ``[R]`` bool by batch row; spec_query_start_loc ``[N+1]`` over the N spec sequences
    (N = the number of True rows; tokens past ``spec_query_start_loc[N]``, padding, get chain parents);
    tree_parents ``[>=R, B+1]`` (``TreeBatch.parents``, batch rows); tree_rows ``[>=R]`` (< 0: no tree).
    """
    device = out.device
    num_rows = spec_sequence_masks.shape[0]
    num_tokens = out.shape[0]
    budget = tree_parents.shape[1] - 1
    mask = spec_sequence_masks.to(torch.bool)
    spec_index = torch.cumsum(mask.to(torch.int64), 0) - 1  # [R] index among spec sequences of each masked row
    rows = torch.arange(num_rows, device=device)
    row_of_spec = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)  # [N] used; slot R takes the rest
    row_of_spec.scatter_(0, torch.where(mask, spec_index, num_rows), rows)
    qsl = spec_query_start_loc.to(torch.int64)
    num_spec = qsl.shape[0] - 1
    tok = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=max(num_spec - 1, 0))
    node = tok - qsl[seq]
    row = row_of_spec[seq]
    in_tree = (tree_rows[row] >= 0) & (node <= budget) & (tok < qsl[-1])
    parent = tree_parents[row, node.clamp(0, budget)].to(torch.int64)
    out.copy_(torch.where(in_tree, parent, node - 1))
    return out
