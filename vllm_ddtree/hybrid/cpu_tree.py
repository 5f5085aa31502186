"""Tree verification on vLLM's CPU GatedDeltaNet path, exact to vLLM's own chain ops (for CPU engine tests).

vLLM's CPU engine verifies drafts with ``_spec_forward`` (``model_executor/layers/mamba/ops/cpu/gdn_attention.py``):
per request a torch ``F.conv1d`` over ``[committed columns, x_0..x_{T-1}]``, then one batched call of the C++ op
``fused_sigmoid_gating_delta_rule_update_spec_cpu``. That chain op and vLLM's one-token op differ by about a bf16
ulp, so a tree built from one-token steps cannot match vLLM bit for bit. Instead ``tree_spec_forward_cpu`` runs
vLLM's own ops on chains: for every leaf of a request's tree, the chain "root..leaf path, then the request's other
tokens in pop order" (same length T as the request). A node at depth j of that path gets position j of the chain's
results, i.e. exactly what vLLM's chain step of the same shape gives a node whose root path was verified as the
chain (the tokens after it never reach it: both ops are causal, and a chain of the same length keeps even the
vectorisation layout). Cost: leaves x T tokens per request; meant for tests, not speed. A chain-shaped tree has one
leaf, whose chain is vLLM's, so it reproduces ``_spec_forward``.

The C++ op reads a sequence's initial state from column ``num_accepted - 1`` of its ``spec_state_indices`` row,
writes the state after token t into column t of the same tensor, and has no null-slot check (a negative index
writes out of bounds). All chains of a request start from the same committed state, and a node's own slot may hold
that state, so the op runs in a float32 scratch tensor: every chain gets its own rows, the first a copy of the
committed state, with ``num_accepted = 1``. Each node's state is then copied from its chain row into
``ssm_state[node_state_indices[t]]``. Copies are exact, so this equals calling the op on vLLM's slots.

Slot layouts afterwards are those of the Triton tree kernels (tree_conv.py, tree_gdn.py), so
``relayout.relayout_accepted_path`` works unchanged: the conv slot becomes ``[row[a..a+width-3], x_0..x_{T-1}]``
(a = previous accepted count - 1, nodes in pop order, later columns untouched); node t's state lands at
``node_state_indices[t]`` (default: spec slot column t, vLLM's chain placement). vLLM's CPU roll instead puts the
inputs at the end of the slot; the two agree when ``T = state_len - width + 2`` (a full draft, the only length for
which vLLM's CPU next-step read is consistent) and differ for shorter trees, where this keeps vLLM's GPU layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import vllm._custom_ops as ops
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _unpacked_conv_weight


@dataclass
class LeafChains:
    """Per request, one chain per tree leaf, and where each node's results are read.

    chains[c]: flat token ids, root..leaf path then the request's other tokens in pop order; chain_request[c]: its
    request; home_chain[t], home_position[t]: the first chain whose path contains token t, and t's depth there.
    """

    chains: list[list[int]]
    chain_request: list[int]
    home_chain: list[int]
    home_position: list[int]


def leaf_chains(token_parents: list[int], query_start_loc: list[int]) -> LeafChains:
    """Build the chains of every request (parents request-relative, root -1, ``parents[i] < i``)."""
    num_tokens = query_start_loc[-1]
    out = LeafChains([], [], [-1] * num_tokens, [-1] * num_tokens)
    for req, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
        has_child = [False] * (end - start)
        for node in range(end - start):
            parent = token_parents[start + node]
            if node == 0:
                assert parent == -1, f"request {req}: its first token must be the tree root"
            else:
                assert 0 <= parent < node, f"request {req}, node {node}: parent {parent} is not an earlier node"
                has_child[parent] = True
        for leaf in (n for n in range(end - start) if not has_child[n]):
            path = [leaf]
            while token_parents[start + path[-1]] >= 0:
                path.append(token_parents[start + path[-1]])
            path.reverse()
            on_path = set(path)
            chain = [start + n for n in path] + [start + n for n in range(end - start) if n not in on_path]
            for depth, node in enumerate(path):
                if out.home_chain[start + node] < 0:
                    out.home_chain[start + node] = len(out.chains)
                    out.home_position[start + node] = depth
            out.chains.append(chain)
            out.chain_request.append(req)
    return out


def tree_conv_cpu(
    layer,
    mixed_qkv_spec: torch.Tensor,
    conv_buf: torch.Tensor,
    conv_slots: list[int],
    num_accepted: list[int],
    query_start_loc: list[int],
    chains: LeafChains,
    width: int,
    state_len: int,
) -> torch.Tensor:
    """Conv step of ``_spec_forward`` run per leaf chain; then rolls each conv slot (see module docstring).

    Chains of one length share a single ``F.conv1d`` call, a batch row each (vLLM calls it per sequence, batch 1):
    on CPUs without bf16 vector units a bf16 depthwise conv costs tens of milliseconds per call whatever its size,
    and a tree has one chain per leaf. Batch rows are computed independently, so each equals vLLM's own call."""
    w2d = _unpacked_conv_weight(layer)
    dim = w2d.size(0)
    weight = w2d.unsqueeze(1)
    bias = layer.conv1d.bias
    silu = layer.activation == "silu"
    conv_out = torch.empty_like(mixed_qkv_spec)
    by_length: dict[int, list[int]] = {}
    for c, chain in enumerate(chains.chains):
        by_length.setdefault(len(chain), []).append(c)
    for group in by_length.values():  # one depthwise conv per chain length, each chain a batch row of vLLM's shape
        conv_in = torch.stack([_conv_input(conv_buf, conv_slots, num_accepted, mixed_qkv_spec, chains, c, width)
                               for c in group])
        out = F.conv1d(conv_in, weight, bias, groups=dim)  # (chains, dim, T): vLLM's conv of each chain
        if silu:
            out = F.silu(out)
        for row, c in enumerate(group):
            homed = [(pos, tok) for pos, tok in enumerate(chains.chains[c]) if chains.home_chain[tok] == c]
            positions = torch.tensor([pos for pos, _ in homed], dtype=torch.int64)
            conv_out[[tok for _, tok in homed]] = out[row][:, positions].transpose(0, 1).to(conv_out.dtype)
    for req, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
        if end == start:
            continue
        assert width - 2 + end - start <= state_len, "conv slot too short for the tree (num_spec < tree size?)"
        slot_row, offset = conv_buf[conv_slots[req]], num_accepted[req] - 1
        kept = slot_row[:, offset + 1 : offset + width - 1].clone()
        slot_row[:, : width - 2] = kept
        slot_row[:, width - 2 : width - 2 + end - start] = mixed_qkv_spec[start:end].transpose(0, 1)
    return conv_out


def _conv_input(conv_buf, conv_slots, num_accepted, mixed_qkv_spec, chains: LeafChains, c: int, width: int):
    """Chain c's conv input as vLLM builds it: ``[committed columns, x of the chain's tokens]`` ``(dim, w-1+T)``."""
    req = chains.chain_request[c]
    slot_row = conv_buf[conv_slots[req]]  # (dim, state_len)
    offset = num_accepted[req] - 1
    x_chain = mixed_qkv_spec[chains.chains[c]].transpose(0, 1).to(slot_row.dtype)
    return torch.cat([slot_row[:, offset : offset + width - 1], x_chain], dim=-1)


def tree_gdn_cpu(
    layer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    a_spec: torch.Tensor,
    b_spec: torch.Tensor,
    ssm_state: torch.Tensor,
    committed_slots: list[int],
    chains: LeafChains,
    node_state_indices: torch.Tensor,
) -> torch.Tensor:
    """Recurrent step of ``_spec_forward``: one C++ op call whose sequences are the leaf chains, in scratch rows.

    query, key ``[T, H, K]``; value ``[T, HV, V]``; a_spec, b_spec ``[T, HV]``; ssm_state vLLM's
    ``_ssm_state_view``; committed_slots[req]: the slot holding the request's committed state. Returns ``[T, HV, V]``;
    node t's state goes to ``ssm_state[node_state_indices[t]]`` (< 0: not stored).
    """
    chain_starts = [0]
    for chain in chains.chains:
        chain_starts.append(chain_starts[-1] + len(chain))
    chain_tokens = torch.tensor([tok for chain in chains.chains for tok in chain], dtype=torch.int64)
    first_rows = torch.tensor(chain_starts[:-1], dtype=torch.int64)
    last_rows = torch.tensor(chain_starts[1:], dtype=torch.int64) - 1

    scratch = ssm_state.new_empty((chain_starts[-1], *ssm_state.shape[1:]))
    scratch[first_rows] = ssm_state[[committed_slots[req] for req in chains.chain_request]]
    columns = torch.arange(max(len(chain) for chain in chains.chains), dtype=torch.int64)
    scratch_rows = torch.minimum(first_rows[:, None] + columns, last_rows[:, None])  # padding: never written

    out = ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        q=query.index_select(0, chain_tokens).contiguous(),
        k=key.index_select(0, chain_tokens).contiguous(),
        v=value.index_select(0, chain_tokens).contiguous(),
        a=a_spec.index_select(0, chain_tokens).contiguous(),
        b=b_spec.index_select(0, chain_tokens).contiguous(),
        initial_state_source=scratch,
        spec_state_indices=scratch_rows.to(torch.int32).contiguous(),
        num_accepted_tokens=torch.ones(len(chains.chains), dtype=torch.int32),
        cu_seqlens=torch.tensor(chain_starts, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
    )
    home_rows = first_rows[chains.home_chain] + torch.tensor(chains.home_position, dtype=torch.int64)
    destinations = node_state_indices.to("cpu", torch.int64)
    stored = destinations >= 0
    ssm_state[destinations[stored]] = scratch[home_rows[stored]]
    return out.index_select(0, home_rows)


def tree_spec_forward_cpu(
    layer,
    attn_metadata_i,
    mixed_qkv_spec: torch.Tensor,
    b_spec: torch.Tensor,
    a_spec: torch.Tensor,
    conv_buf: torch.Tensor,
    ssm_state: torch.Tensor,
    width: int,
    state_len: int,
    token_parents: torch.Tensor,
    node_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree counterpart of vLLM's CPU ``_spec_forward``: same arguments, plus the trees.

    token_parents ``[T]``: request-relative parent per spec token (root -1), as ``tree_conv.flat_token_parents``
    gives. node_state_indices ``[T]``: ssm_state row receiving each node's state (< 0: not stored); default
    ``spec_state_indices[request, node]``, where vLLM's chain puts token t's state. Returns the core attention
    output ``[T, HV, V]`` in token order, like ``_spec_forward``.
    """
    num_requests = attn_metadata_i.num_spec_decodes
    slot_rows = attn_metadata_i.spec_state_indices_tensor[:num_requests].tolist()
    query_start_loc = attn_metadata_i.spec_query_start_loc[: num_requests + 1].tolist()
    num_accepted = attn_metadata_i.num_accepted_tokens[:num_requests].tolist()
    num_tokens = query_start_loc[-1]
    assert token_parents.shape[0] == num_tokens == mixed_qkv_spec.shape[0]
    if node_state_indices is None:
        lengths = [end - start for start, end in zip(query_start_loc[:-1], query_start_loc[1:])]
        assert all(n <= len(row) for n, row in zip(lengths, slot_rows)), "a tree has more nodes than spec slots"
        node_state_indices = torch.tensor(
            [row[n] for row, length in zip(slot_rows, lengths) for n in range(length)], dtype=torch.int64
        )
    assert node_state_indices.shape[0] == num_tokens
    if num_tokens == 0:
        return mixed_qkv_spec.new_empty((0, layer.num_v_heads // layer.tp_size, layer.head_v_dim))

    chains = leaf_chains(token_parents.tolist(), query_start_loc)
    conv_slots = [row[0] for row in slot_rows]
    conv_out = tree_conv_cpu(
        layer, mixed_qkv_spec, conv_buf, conv_slots, num_accepted, query_start_loc, chains, width, state_len
    )
    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    committed_slots = [row[n - 1] for row, n in zip(slot_rows, num_accepted)]
    return tree_gdn_cpu(
        layer,
        query.squeeze(0),
        key.squeeze(0),
        value.squeeze(0),
        a_spec,
        b_spec,
        ssm_state,
        committed_slots,
        chains,
        node_state_indices,
    )
