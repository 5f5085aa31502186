"""GDN state memory for tree verification: persistent per-node slots vs a transient per-step workspace.

vLLM sizes hybrid spec decode through ``MambaSpec(num_speculative_blocks=K)``: every request holds 1 + K state
blocks per GDN layer, each with a conv row of ``width - 1 + K`` columns and a full recurrent state
``HV × V × K`` (``mamba_utils.py::gated_delta_net_state_shape``, ``abstract.py::get_kv_cache_spec``). Setting
K = budget B for a tree makes that (1 + B) recurrent states per request per layer, reserved for the whole life
of every request. The per-node states are only needed between the verify forward and the relayout of the same
step, so a workspace sized for one step's tree tokens can replace the extra blocks, if the runner
keeps 1 block per request, widens only the conv row, and the relayout copies from the workspace.

Numbers for Qwen3.6-27B (also Qwen3.5-27B): 64 layers, ``full_attention_interval`` 4, so 48 GDN layers;
``linear_num_key_heads`` 16, ``linear_num_value_heads`` 48, key/value head dim 128, conv kernel 4;
``mamba_ssm_dtype`` float32 (vLLM's ``Qwen3_5ForConditionalGenerationConfig`` copies it into
``mamba_ssm_cache_dtype``). Sources: third-party transcriptions of the Qwen/Qwen3.6-27B ``config.json`` found in
the public code index (the HF file itself was not read); vLLM's ``Qwen3_5TextConfig`` defaults differ (4096
hidden, 32 value heads), so they are not the 27B shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GDNShapes:
    """Per-rank GDN layer shapes (divide heads and conv dim by the TP size before passing them)."""

    num_gdn_layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    state_bytes: int = 4  # recurrent state dtype (float32 for Qwen3.5/3.6)
    conv_bytes: int = 2  # conv state dtype (model dtype, bf16)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def state_elems(self) -> int:
        return self.num_v_heads * self.head_v_dim * self.head_k_dim

    @classmethod
    def from_config(cls, config: dict, tp_size: int = 1) -> GDNShapes:
        """From a model's config.json (Qwen3-Next at the top level, Qwen3.5/3.6 under ``text_config``)."""
        text = config.get("text_config", config)
        layers = text.get("layer_types") or []
        return cls(num_gdn_layers=layers.count("linear_attention"), num_k_heads=text["linear_num_key_heads"],
                   num_v_heads=text["linear_num_value_heads"], head_k_dim=text["linear_key_head_dim"],
                   head_v_dim=text["linear_value_head_dim"], conv_kernel=text["linear_conv_kernel_dim"]).tp(tp_size)

    def tp(self, tp_size: int) -> GDNShapes:
        return GDNShapes(self.num_gdn_layers, self.num_k_heads // tp_size, self.num_v_heads // tp_size,
                         self.head_k_dim, self.head_v_dim, self.conv_kernel, self.state_bytes, self.conv_bytes)


QWEN36_27B = GDNShapes(num_gdn_layers=48, num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128,
                       conv_kernel=4)


def vllm_block_bytes(s: GDNShapes, num_spec: int) -> int:
    """One vLLM state block of one GDN layer (conv row + recurrent state) when num_speculative_tokens = num_spec."""
    return s.conv_dim * (s.conv_kernel - 1 + num_spec) * s.conv_bytes + s.state_elems * s.state_bytes


def persistent_bytes_per_request(s: GDNShapes, budget: int) -> int:
    """vLLM's layout with num_speculative_tokens = budget: 1 + B blocks per request, all GDN layers."""
    return s.num_gdn_layers * (1 + budget) * vllm_block_bytes(s, budget)


def chain_bytes_per_request(s: GDNShapes, num_spec: int) -> int:
    """Same, for a DFlash chain of num_spec drafts (the baseline DDTree must not exceed by much)."""
    return persistent_bytes_per_request(s, num_spec)


def compact_bytes_per_request(s: GDNShapes, budget: int) -> int:
    """One block per request whose conv row is widened for B + 1 tree tokens (the workspace variant)."""
    return s.num_gdn_layers * vllm_block_bytes(s, budget)


def workspace_bytes(s: GDNShapes, tree_tokens: int, state_bytes: int = 4) -> int:
    """Transient per-node states for one step: tree_tokens (= sum over requests of nodes + 1) × all GDN layers.

    Every layer's node states must survive until the walk has chosen the path, hence the layer factor; float32
    so that reloading a parent is lossless. Freed (reused) every step, not held per request.
    """
    return s.num_gdn_layers * tree_tokens * s.state_elems * state_bytes


def replay_bytes(s: GDNShapes, tree_tokens: int, act_bytes: int = 2) -> int:
    """relayout.replay_accepted_path instead of keeping node states: one float32 node-state workspace for one
    layer at a time (reused by every layer), plus each layer's post-conv q/k/v and a/b rows kept until the walk."""
    layer_ws = tree_tokens * s.state_elems * 4
    stash = s.num_gdn_layers * tree_tokens * (s.conv_dim + 2 * s.num_v_heads) * act_bytes
    return layer_ws + stash


def step_bytes(s: GDNShapes, budget: int, num_reqs: int, mode: str) -> int:
    """GDN state memory for num_reqs requests at budget B: "persistent" | "workspace" | "replay"."""
    if mode == "persistent":
        return num_reqs * persistent_bytes_per_request(s, budget)
    extra = workspace_bytes if mode == "workspace" else replay_bytes
    return num_reqs * compact_bytes_per_request(s, budget) + extra(s, num_reqs * (budget + 1))


def max_budget(s: GDNShapes, bytes_available: int, num_reqs: int, mode: str) -> int:
    """Largest B <= 128 whose GDN state for num_reqs requests fits in bytes_available (0 if none)."""
    return max((b for b in range(1, 129) if step_bytes(s, b, num_reqs, mode) <= bytes_available), default=0)


def max_requests(s: GDNShapes, bytes_available: int, budget: int, mode: str, limit: int = 1024) -> int:
    """Most concurrent requests (<= limit) whose GDN state at budget B fits in bytes_available (0 if none)."""
    return max((n for n in range(1, limit + 1) if step_bytes(s, budget, n, mode) <= bytes_available), default=0)


def report(s: GDNShapes = QWEN36_27B, budgets=(8, 16, 32, 64, 128), tp_sizes=(1, 2)) -> str:
    """Human-readable table (GiB) used in the README / issue notes."""
    gib = 1024**3
    lines = []
    for tp in tp_sizes:
        r = s.tp(tp)
        lines.append(f"TP={tp}: per-layer recurrent state {r.state_elems * r.state_bytes / 2**20:.2f} MiB, "
                     f"conv row {r.conv_dim} x (w-1+K) x {r.conv_bytes} B; chain K=15: "
                     f"{chain_bytes_per_request(r, 15) / gib:.2f} GiB/request")
        for b in budgets:
            per = {m: step_bytes(r, b, 1, m) / gib for m in ("persistent", "workspace", "replay")}
            lines.append(f"  B={b:3d} per request: persistent {per['persistent']:6.2f} GiB | all-layer workspace "
                         f"{per['workspace']:6.2f} GiB | replay {per['replay']:5.2f} GiB")
    for tp, mem in ((1, 20), (2, 20)):
        r = s.tp(tp)
        for n in (1, 8):
            fits = ", ".join(f"{m} B<={max_budget(r, mem * gib, n, m)}" for m in ("persistent", "workspace", "replay"))
            lines.append(f"TP={tp}, {mem} GiB for GDN state, {n} request(s): {fits}")
        lines.append(f"TP={tp}, 20 GiB for GDN state, concurrent requests by budget (persistent | replay): "
                     + ", ".join(f"B={b}: {max_requests(r, mem * gib, b, 'persistent')} | "
                                 f"{max_requests(r, mem * gib, b, 'replay')}" for b in budgets))
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
