"""The two spec-decode kernels of vLLM's GPU GDN layer, replaced by their tree versions for a DDTree worker.

``qwen_gdn_linear_attn.GatedDeltaNetAttention._forward_core`` verifies drafts with ``causal_conv1d_update`` and
``fused_sigmoid_gating_delta_rule_update`` (its "multi-query part"). ``conv_update`` and ``recurrent_update`` take
the same arguments and run ``tree_conv`` / ``tree_gdn`` over this step's trees instead, so the layer itself needs
no change beyond calling them (patch 0005's hook points, installed by ``target.HybridTreeTarget``). They read the
step's trees only from static buffers (the verifier's ``TreeBatch`` and ``tree_rows``), so a captured CUDA graph
replays them with each step's trees; a step without trees (``tree_rows`` all -1) gets chain parents, which makes both
kernels compute exactly what vLLM's do.

Token parents and conv windows are computed once per forward (the first GDN layer; every layer of a step shares
the batch) into static buffers. Node states follow the replay layout (``replay_layout``; docs/hybrid-state-layout.md):
one state block per request, read and never written here; branch nodes' states go to the stash's float32 workspace
and each layer's inputs into the stash, from which the relayout recomputes the accepted path after the walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_ddtree.hybrid.replay_layout import ReplayStash
from vllm_ddtree.hybrid.spec_parents import spec_token_parents
from vllm_ddtree.hybrid.tree_conv import tree_causal_conv1d_update, tree_conv_window
from vllm_ddtree.hybrid.tree_gdn import DeferredLeaves, tree_fused_sigmoid_gating_delta_rule_update


def forward_gdn_metadata() -> tuple[Any, Any]:
    """(key, metadata): the current forward context (one per forward, also per captured graph) and any of its GDN
    metadata objects (every GDN KV-cache group of a step shares the batch layout the hooks need)."""
    from vllm.forward_context import get_forward_context
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    context = get_forward_context()
    metadata = context.attn_metadata
    if isinstance(metadata, list):  # ubatching: one dict per micro-batch
        metadata = metadata[0]
    for value in metadata.values():
        if isinstance(value, GDNAttentionMetadata):
            return context, value
    raise RuntimeError("ddtree: a GDN layer ran without GDN attention metadata in the forward context")


class GDNTreeHooks:
    """Per worker; ``trees`` / ``tree_rows`` are the verifier's static buffers (batch rows)."""

    def __init__(
        self,
        trees,
        tree_rows: torch.Tensor,
        max_tokens: int,
        conv_width: int,
        device: torch.device,
        replay: ReplayStash,
        metadata_source: Callable[[], tuple[Any, Any]] = forward_gdn_metadata,
    ):
        """``replay``: the replay layout's stash, where each layer's inputs and the states of nodes with children go."""
        self.trees = trees
        self.replay = replay
        self.leaves: DeferredLeaves | None = None  # this forward's split of tree nodes (ReplayStash.record_step)
        self.tree_rows = tree_rows
        self.conv_width = conv_width
        self.metadata_source = metadata_source
        self.parents = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.window = torch.full((max_tokens, conv_width - 1), -1, dtype=torch.int32, device=device)
        self._computed_for: Any = None  # the forward whose parents are in the buffers

    def step_parents(self, num_tokens: int, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's ``[T]`` token parents and ``[T, width-1]`` conv windows (computed on first use)."""
        key, metadata = self.metadata_source()
        parents = self.parents[:num_tokens]
        window = self.window[:num_tokens]
        if key is not self._computed_for:
            spec_token_parents(
                metadata.spec_sequence_masks, metadata.spec_query_start_loc, self.trees.parents, self.tree_rows, parents
            )
            window.copy_(tree_conv_window(parents, query_start_loc, self.conv_width))
            self.leaves = self.replay.record_step(metadata.spec_sequence_masks, metadata.spec_query_start_loc,
                                                  parents)
            self._computed_for = key
        return parents, window

    def conv_update(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: bool | str | None = None,
        conv_state_indices: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        max_query_len: int = -1,
        **_unused,
    ) -> torch.Tensor:
        """``causal_conv1d_update`` as ``_forward_core`` calls it for spec tokens; returns the conv output."""
        assert conv_state_indices is not None and num_accepted_tokens is not None and query_start_loc is not None
        _, window = self.step_parents(x.shape[0], query_start_loc)
        return tree_causal_conv1d_update(
            x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens, query_start_loc,
            max_query_len, window,
        )

    def recurrent_update(
        self,
        A_log: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        dt_bias: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        initial_state: torch.Tensor,
        cu_seqlens: torch.Tensor,
        ssm_state_indices: torch.Tensor,
        num_accepted_tokens: torch.Tensor,
        use_qk_l2norm_in_kernel: bool = False,
        **_unused,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``fused_sigmoid_gating_delta_rule_update`` for spec tokens: the states of nodes with children to the
        stash's workspace, each leaf's output from its parent's (deferred leaves), this layer's inputs to the stash;
        the request's one block (every spec column names it) is read, not written."""
        num_tokens = q.shape[1]
        parents, _ = self.step_parents(num_tokens, cu_seqlens)
        self.replay.keep(self.replay.layer(A_log), q, k, v, a, b)
        o, _ = tree_fused_sigmoid_gating_delta_rule_update(
            A_log, a, b, dt_bias, q, k, v, parents,
            initial_state=initial_state, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices[:, :1],
            node_states=self.replay.node_states, node_state_indices=self.leaves.node_state_indices,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, leaves=self.leaves,
        )
        return o, initial_state
