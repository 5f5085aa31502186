"""DDTree on a hybrid target: GDN layers verify trees through patch 0005's hooks; accepted paths are laid out after.

During the verify forward every GDN layer runs its speculative tokens through the tree versions of vLLM's kernels
(CPU: ``cpu_tree.tree_spec_forward_cpu`` in place of ``_spec_forward``; GPU: ``gdn_hooks.GDNTreeHooks``), which
leave node t's conv input in column ``width - 2 + t`` of the request's conv row, as vLLM's chain does for token t
(and on the CPU node t's state in spec slot column t). After the walk, ``relayout`` moves each request's accepted
path into columns ``0..a`` in every GDN layer (on GPU it recomputes the path's last state into the request's one
block), so vLLM's chain bookkeeping (``num_accepted_tokens = a + 1``) reads the right state and window next step,
unchanged.

The state layout (docs/hybrid-state-layout.md): on GPU the replay layout (``replay_layout``): one state block per
request, the accepted path's state recomputed after the walk from the inputs each layer stashed. On the CPU engine
vLLM's own layout (``1 + num_speculative_tokens`` blocks per request, ``num_speculative_tokens = B``; node t's state
in spec column t, where vLLM's C++ chain op writes it). Either way the slots come from the GDN layers' own KV-cache
groups, read from the runner's block tables by batch row, so the relayout runs for every row of the batch: rows
without a tree accepted the root only, and rows that verified nothing (a prefill) are skipped.
"""

from __future__ import annotations

import torch

from vllm_ddtree.cuda_graphs import GraphedStep, largest_bucket
from vllm_ddtree.hybrid.relayout import apply_relayout, apply_replay, move_conv_columns, relayout_plan, replay_plan
from vllm_ddtree.hybrid.replay_layout import ReplayStash, one_state_block, stash_size
from vllm_ddtree.hybrid.spec_parents import spec_token_parents


def gdn_groups(kv_cache_groups) -> list[tuple[int, list[str]]]:
    """(group id, layer names) of the KV-cache groups holding mamba (GDN) state."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = enumerate(kv_cache_groups)
    return [(gid, list(g.layer_names)) for gid, g in groups if isinstance(g.kv_cache_spec, MambaSpec)]


def conv_state_view(layer) -> torch.Tensor:
    """A GDN layer's conv cache as the kernels see it: ``(slots, dim, state_len)``."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv = layer.kv_cache[0]
    return conv if is_conv_state_dim_first() else conv.transpose(-1, -2)


class HybridTreeTarget:
    """Per worker; ``verifier`` is the ``TreeVerifyCore`` (its static ``verify_trees`` and ``tree_rows``; V1 runner)."""

    def __init__(self, verifier, runner, device: torch.device):
        self.verifier = verifier
        self.runner = runner
        self.device = device
        self.replay: ReplayStash | None = None  # the replay layout's stash (GPU; the CPU engine keeps vLLM's layout)
        # (group, conv, ssm, width, layer module) per GDN layer
        self._layers: list[tuple[int, torch.Tensor, torch.Tensor, int, object]] | None = None
        self.install_hooks()

    # ------------------------------------------------------------------ the verify forward

    def install_hooks(self) -> None:
        """Point patch 0005's hook attributes at the tree versions (one engine per process, as vLLM's workers)."""
        if self.device.type == "cpu":
            from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

            gdn_attention.SPEC_FORWARD = self.cpu_spec_forward
            return
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

        from vllm_ddtree.hybrid.gdn_hooks import GDNTreeHooks

        config = self.runner.vllm_config
        layers = [m for m in config.compilation_config.static_forward_context.values()
                  if isinstance(m, qwen_gdn_linear_attn.QwenGatedDeltaNetAttention)]
        for layer in layers:
            one_state_block(layer)
        self.replay = ReplayStash(layers, *stash_size(config), config.model_config.dtype, self.device)
        hooks = GDNTreeHooks(self.verifier.verify_trees, self.verifier.tree_rows,
                             config.scheduler_config.max_num_batched_tokens, _conv_width(self.runner), self.device,
                             self.replay)
        qwen_gdn_linear_attn.SPEC_CONV_UPDATE = hooks.conv_update
        qwen_gdn_linear_attn.SPEC_RECURRENT_UPDATE = hooks.recurrent_update

    def cpu_spec_forward(self, layer, attn_metadata, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, width,
                         state_len):
        """``_spec_forward``'s signature; the trees of this step's spec sequences (chains where a row has none)."""
        from vllm_ddtree.hybrid.cpu_tree import tree_spec_forward_cpu

        num_spec = attn_metadata.num_spec_decodes
        parents = torch.empty(mixed_qkv_spec.shape[0], dtype=torch.int32)
        spec_token_parents(
            attn_metadata.spec_sequence_masks, attn_metadata.spec_query_start_loc[: num_spec + 1],
            self.verifier.verify_trees.parents, self.verifier.tree_rows, parents,
        )
        return tree_spec_forward_cpu(
            layer, attn_metadata, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, width, state_len, parents
        )

    # ------------------------------------------------------------------ after the walk

    def relayout(self, num_reqs: int, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Every GDN layer: request r's accepted nodes ``accepted[r, :num_accepted[r] + 1]`` to spec columns
        ``0..num_accepted[r]`` (``accepted [R, L+1]`` node ids, -1 past the path; ``num_accepted`` = drafts kept).
        Both are the walk's static buffers; with the block tables also static, the whole relayout (the index work
        once per KV-cache group, then a few data moves per GDN layer, 48 layers on a 27B) replays from one CUDA
        graph per padded row count."""
        if self._layers is None:
            self._layers = self._find_layers()
            self._accepted, self._num_accepted = accepted, num_accepted
            max_reqs = accepted.shape[0]
            self._num_live = torch.zeros((), dtype=torch.int64, device=self.device)
            self._graphs = GraphedStep(self._relayout_rows, largest_bucket(max_reqs), self.device, idempotent=False,
                                       enabled=self.verifier.cuda_graphs)
        assert accepted is self._accepted and num_accepted is self._num_accepted, "the walk's static buffers"
        self._num_live.fill_(num_reqs)
        self._graphs(num_reqs)

    def _relayout_rows(self, rows: int) -> None:
        """Rows past the live batch (graph padding) are masked onto the null block, moving nothing: their stale
        block tables may name blocks that live requests own now."""
        live = torch.arange(rows, device=self.device) < self._num_live
        kept = torch.where(live, self._num_accepted[:rows] + 1, 1).to(torch.int32)
        paths = torch.where(live[:, None], self._accepted[:rows], 0)  # a never-walked row may hold -1 at its root
        if self.replay is not None:
            self._replay_rows(rows, live, paths, kept)
            return
        node_starts = torch.arange(rows + 1, dtype=torch.int32, device=self.device) * (self.verifier.budget + 1)
        plans = {}  # one index plan per KV-cache group, shared by its layers
        for group, conv, ssm, width, _ in self._layers:
            if group not in plans:
                table = self.runner.input_batch.block_table[group].get_device_tensor(rows)
                slots = torch.where(live[:, None], table[:, : self.verifier.budget + 1], 0).to(torch.int32)
                plans[group] = relayout_plan(slots[:, 0], slots, paths, kept, width, slots.reshape(-1), node_starts)
            apply_relayout(conv, ssm, plans[group], ssm)

    def _replay_rows(self, rows: int, live: torch.Tensor, paths: torch.Tensor, kept: torch.Tensor) -> None:
        """Replay layout: conv columns as in the persistent layout, then each layer's accepted path rerun from the
        request's one block over the stash. Rows that verified no spec sequence this step (a prefill) are skipped:
        vLLM's own kernels already left their state in the block."""
        stash = self.replay
        row_start = stash.row_start[:rows]
        verified = live & (row_start >= 0)
        # Unverified rows all map to the null block, with a path of one node: they move nothing there (a moved path
        # would race another row's copy into the same block).
        kept = torch.where(verified, kept, 1)
        plans = {}  # (blocks, replay plan) per KV-cache group, shared by its layers
        for group, conv, ssm, width, layer in self._layers:
            if group not in plans:
                table = self.runner.input_batch.block_table[group].get_device_tensor(rows)
                blocks = torch.where(verified, table[:, 0], 0).to(torch.int32)
                plans[group] = (blocks, replay_plan(blocks, blocks, paths, kept, row_start))
            blocks, plan = plans[group]
            move_conv_columns(conv, blocks, paths, kept, width)
            i = stash.layer(layer.A_log)
            apply_replay(plan, layer.A_log, stash.a[i], stash.b[i], layer.dt_bias, stash.q[i][None], stash.k[i][None],
                         stash.v[i][None], ssm)
        stash.row_start.fill_(-1)  # a later relayout without a verify forward in between replays nothing

    def _find_layers(self) -> list[tuple[int, torch.Tensor, torch.Tensor, int, object]]:
        forward_context = self.runner.compilation_config.static_forward_context
        width = _conv_width(self.runner)  # not the weight's shape: the CPU may have packed it (AMX)
        layers = []
        for group, names in gdn_groups(self.runner.kv_cache_config.kv_cache_groups):
            for name in names:
                layer = forward_context[name]
                layers.append((group, conv_state_view(layer), layer.kv_cache[1], width, layer))
        if not layers:
            raise RuntimeError("ddtree: a hybrid target without GDN state in its KV cache groups")
        return layers


def _conv_width(runner) -> int:
    """The GDN layers' conv kernel width, from the model config (Qwen3-Next / Qwen3.5 name it so)."""
    hf = runner.vllm_config.model_config.hf_text_config
    return int(getattr(hf, "linear_conv_kernel_dim", 4))
