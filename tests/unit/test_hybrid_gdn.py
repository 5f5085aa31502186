"""GDN (hybrid target) tree kernels: references vs per-path chains vs vLLM's own kernels vs the Triton tree kernels.

Chain of trust: (1) the float64 chain references equal vLLM 0.26.0's spec-decode conv and recurrence kernels;
(2) the tree references equal the chain reference run along every root-to-node path; (3) the Triton tree kernels
equal the tree references (and vLLM bit for bit on chain-shaped trees); (4) after relayout, vLLM's chain
bookkeeping continues exactly as if the accepted path had been verified as a chain.
"""

import pytest
import torch
from tree_shapes import path_to, random_parents

from vllm_ddtree.hybrid import memory
from vllm_ddtree.hybrid.reference import (
    conv_chain_reference,
    conv_roll_reference,
    conv_tree_reference,
    gdn_chain_reference,
    gdn_tree_reference,
    relayout_reference,
)
from vllm_ddtree.hybrid.relayout import relayout_accepted_path, replay_accepted_path
from vllm_ddtree.hybrid.tree_conv import flat_token_parents, tree_causal_conv1d_update, tree_conv_window
from vllm_ddtree.hybrid.tree_gdn import deferred_leaves, tree_fused_sigmoid_gating_delta_rule_update

H, HV, K, V, W = 2, 4, 16, 16, 4
DIM = 2 * H * K + HV * V
SPEC = 12  # num_speculative_tokens: slots hold up to SPEC + 1 tree tokens
ATOL = 2e-5


def gdn_inputs(t: int, gen: torch.Generator, dtype=torch.float64):
    q = torch.randn(t, H, K, generator=gen, dtype=dtype)
    k = torch.randn(t, H, K, generator=gen, dtype=dtype)
    v = torch.randn(t, HV, V, generator=gen, dtype=dtype)
    a = torch.randn(t, HV, generator=gen, dtype=dtype)
    b = torch.randn(t, HV, generator=gen, dtype=dtype)
    return q, k, v, a, b


def layer_params(gen: torch.Generator, dtype=torch.float64):
    A_log = torch.rand(HV, generator=gen, dtype=dtype) - 0.5
    dt_bias = torch.rand(HV, generator=gen, dtype=dtype) * 0.2
    weight = torch.randn(DIM, W, generator=gen, dtype=dtype) * 0.5
    bias = torch.randn(DIM, generator=gen, dtype=dtype) * 0.1
    return A_log, dt_bias, weight, bias


# ---------------------------------------------------------------- (2) tree reference == chain along every path


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_references_equal_per_path_chains(seed):
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(14, gen)
    A_log, dt_bias, weight, bias = layer_params(gen)
    x = torch.randn(14, DIM, generator=gen, dtype=torch.float64)
    prior = torch.randn(DIM, W - 1, generator=gen, dtype=torch.float64)
    q, k, v, a, b = gdn_inputs(14, gen)
    h0 = torch.randn(HV, V, K, generator=gen, dtype=torch.float64)
    conv_tree = conv_tree_reference(x, parents, prior, weight, bias)
    o_tree, s_tree = gdn_tree_reference(q, k, v, a, b, A_log, dt_bias, h0, parents)
    for node in range(14):
        p = path_to(parents, node)
        conv_chain = conv_chain_reference(x[p], prior, weight, bias)
        o_chain, s_chain = gdn_chain_reference(q[p], k[p], v[p], a[p], b[p], A_log, dt_bias, h0)
        torch.testing.assert_close(conv_tree[p], conv_chain, rtol=0, atol=1e-12)
        torch.testing.assert_close(o_tree[p], o_chain, rtol=0, atol=1e-12)
        torch.testing.assert_close(s_tree[node], s_chain[-1], rtol=0, atol=1e-12)


# ---------------------------------------------------------------- batched fixtures in vLLM's cache layout


def make_step(seed: int, chain: bool = False, sizes=(7, 1, 13, 4)):
    """A batch of trees plus vLLM-style caches: conv (slots, dim, W-1+SPEC), ssm (slots, HV, V, K), float32."""
    gen = torch.Generator().manual_seed(seed)
    n = len(sizes)
    parents = [random_parents(s, gen, chain) for s in sizes]
    qsl = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), dtype=torch.int32)
    t = int(qsl[-1])
    A_log, dt_bias, weight, bias = (p.float() for p in layer_params(gen))
    slots = 1 + n * (SPEC + 1)
    conv_state = torch.randn(slots, DIM, W - 1 + SPEC, generator=gen)
    ssm_state = torch.randn(slots, HV, V, K, generator=gen) * 0.3
    spec_idx = (1 + torch.randperm(slots - 1, generator=gen)[: n * (SPEC + 1)]).view(n, SPEC + 1).int()
    num_acc = torch.randint(1, SPEC + 2, (n,), generator=gen).int()
    x = torch.randn(t, DIM, generator=gen)
    q, k, v, a, b = (z.float() for z in gdn_inputs(t, gen))
    flat_parents = torch.tensor([p for ps in parents for p in ps], dtype=torch.int32)
    return dict(parents=parents, flat_parents=flat_parents, qsl=qsl, A_log=A_log, dt_bias=dt_bias, weight=weight,
                bias=bias, conv_state=conv_state, ssm_state=ssm_state, spec_idx=spec_idx, num_acc=num_acc, x=x,
                q=q, k=k, v=v, a=a, b=b, max_len=max(sizes))


def run_tree_conv(s, conv_state, max_query_len=None):
    window = tree_conv_window(s["flat_parents"], s["qsl"], W)
    slots = s["spec_idx"][:, 0]  # a strided column, as vLLM passes it (_forward_core)
    return tree_causal_conv1d_update(s["x"], conv_state, s["weight"], s["bias"], "silu", slots, s["num_acc"], s["qsl"],
                                     s["max_len"] if max_query_len is None else max_query_len, window)


def run_tree_gdn(s, **kw):
    return tree_fused_sigmoid_gating_delta_rule_update(
        s["A_log"], s["a"], s["b"], s["dt_bias"], s["q"][None], s["k"][None], s["v"][None], s["flat_parents"],
        initial_state=s["ssm_state"], cu_seqlens=s["qsl"], ssm_state_indices=s["spec_idx"],
        num_accepted_tokens=s["num_acc"], use_qk_l2norm_in_kernel=True, **kw)


def test_flat_token_parents_from_tree_batch():
    from vllm_ddtree.tree.layout import TreeBatch

    s = make_step(4)
    tree = TreeBatch.allocate(len(s["parents"]), SPEC, "cpu")
    for r, ps in enumerate(s["parents"]):
        tree.parents[r, : len(ps)] = torch.tensor(ps, dtype=torch.int32)
    flat = flat_token_parents(tree.parents, s["qsl"], int(s["qsl"][-1]))
    assert flat.tolist() == s["flat_parents"].tolist()


def test_conv_window_matches_reference():
    from vllm_ddtree.hybrid.reference import conv_window_sources

    s = make_step(3)
    window = tree_conv_window(s["flat_parents"], s["qsl"], W).tolist()
    expected = [w for ps in s["parents"] for w in conv_window_sources(ps, W)]
    assert window == expected


# ---------------------------------------------------------------- (3) Triton tree kernels == tree references


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_conv_kernel_matches_reference(seed):
    s = make_step(seed)
    conv_state = s["conv_state"].clone()
    out = run_tree_conv(s, conv_state)
    for n, ps in enumerate(s["parents"]):
        lo, hi = int(s["qsl"][n]), int(s["qsl"][n + 1])
        slot, off = int(s["spec_idx"][n, 0]), int(s["num_acc"][n]) - 1
        prior = s["conv_state"][slot, :, off : off + W - 1]
        ref = conv_tree_reference(s["x"][lo:hi], ps, prior, s["weight"], s["bias"])
        torch.testing.assert_close(out[lo:hi].double(), ref, rtol=0, atol=ATOL)
        roll = conv_roll_reference(s["conv_state"][slot], s["x"][lo:hi], off + 1, W)
        torch.testing.assert_close(conv_state[slot], roll, rtol=0, atol=0)


def test_tree_conv_does_not_trust_max_query_len():
    """vLLM passes ``max_query_len=spec_state_indices_tensor.size(-1)``: 1 + B on its full-graph path, but 1 in the
    replay layout wherever the GDN metadata skips its graph buffers (a verify batched with a prefill, or more verify
    tokens than its largest decode graph). Outputs and the rolled slot must not change (until 2026-12-04 the roll
    then kept only the first columns of the slot)."""
    s = make_step(2)
    assert s["max_len"] > 4
    conv_a, conv_b = s["conv_state"].clone(), s["conv_state"].clone()
    out_a = run_tree_conv(s, conv_a)
    out_b = run_tree_conv(s, conv_b, max_query_len=1)
    assert torch.equal(out_a, out_b)
    assert torch.equal(conv_a, conv_b)


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_gdn_with_deferred_leaves_computes_the_same_bits(seed):
    """``deferred_leaves``: the main kernel runs roots and internal nodes, the leaf kernel each leaf from its parent's
    stored state, in the same arithmetic: outputs bit-equal to the one-kernel run, internal nodes' states too."""
    s = make_step(seed, sizes=(7, 1, 13, 4, 9))
    t = len(s["flat_parents"])
    o_ref, states_ref = run_tree_gdn(s)
    plan = deferred_leaves(s["flat_parents"], s["qsl"])
    o, states = run_tree_gdn(s, node_states=torch.zeros(t, HV, V, K), node_state_indices=plan.node_state_indices,
                             leaves=plan)
    internal = plan.node_state_indices >= 0
    deferred = plan.deferred.bool()
    assert int(deferred.sum()) >= 8 and int(internal.sum()) >= 8  # both kernels have work in these trees
    assert torch.equal(o, o_ref)
    assert torch.equal(states[internal], states_ref[internal])
    assert not states[deferred].any(), "a deferred leaf's state was stored"


def test_deferred_leaves_plan():
    """Each request's roots and nodes with children in order for the main kernel, every leaf pointing at its
    parent's stored state (absolute rows), roots never deferred."""
    parents = torch.tensor([-1, 0, 0, 1, -1, 0, 1, 0], dtype=torch.int32)  # two requests: rows 0-3, 4-7
    plan = deferred_leaves(parents, torch.tensor([0, 4, 8], dtype=torch.int32))
    assert plan.deferred.tolist() == [False, False, True, True, False, False, True, True]
    assert plan.node_state_indices.tolist() == [0, 1, -1, -1, 4, 5, -1, -1]
    assert plan.main_order[:4].tolist() == [0, 1, 4, 5]
    assert plan.main_start.tolist() == [0, 2, 4]
    assert plan.leaf_state_rows.tolist() == [-1, -1, 0, 1, -1, -1, 5, 4]


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_gdn_kernel_matches_reference(seed):
    s = make_step(seed)
    ssm_before = s["ssm_state"].clone()
    o, states = run_tree_gdn(s)
    assert torch.equal(s["ssm_state"], ssm_before), "the tree kernel must not touch vLLM's slots by default"
    for n, ps in enumerate(s["parents"]):
        lo, hi = int(s["qsl"][n]), int(s["qsl"][n + 1])
        h0 = ssm_before[int(s["spec_idx"][n, int(s["num_acc"][n]) - 1])]
        sl = slice(lo, hi)
        o_ref, s_ref = gdn_tree_reference(s["q"][sl], s["k"][sl], s["v"][sl], s["a"][sl], s["b"][sl], s["A_log"],
                                          s["dt_bias"], h0, ps)
        torch.testing.assert_close(o[0, sl].double(), o_ref, rtol=0, atol=ATOL)
        torch.testing.assert_close(states[sl].double(), s_ref, rtol=0, atol=ATOL)


# ---------------------------------------------------------------- (1) + chain-shaped trees == vLLM's kernels


def vllm_chain_step(s, conv_state, ssm_state, x, q, k, v, a, b, qsl, num_acc, max_len):
    """vLLM 0.26.0's spec-decode verify for one GDN layer, as _forward_core calls it (Triton, interpreted)."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    conv_out = causal_conv1d_update(x.clone(), conv_state, s["weight"], s["bias"], "silu",
                                    conv_state_indices=s["spec_idx"][:, 0].contiguous(), num_accepted_tokens=num_acc,
                                    query_start_loc=qsl, max_query_len=max_len)
    o, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=s["A_log"], a=a, b=b, dt_bias=s["dt_bias"], q=q[None], k=k[None], v=v[None], initial_state=ssm_state,
        inplace_final_state=True, cu_seqlens=qsl, ssm_state_indices=s["spec_idx"], num_accepted_tokens=num_acc,
        use_qk_l2norm_in_kernel=True)
    return conv_out, o


def test_chain_references_and_chain_trees_equal_vllm():
    s = make_step(5, chain=True)
    conv_v, ssm_v = s["conv_state"].clone(), s["ssm_state"].clone()
    conv_out_v, o_v = vllm_chain_step(s, conv_v, ssm_v, s["x"], s["q"], s["k"], s["v"], s["a"], s["b"], s["qsl"],
                                      s["num_acc"], s["max_len"])
    conv_t = s["conv_state"].clone()
    conv_out_t = run_tree_conv(s, conv_t)
    o_t, states_t = run_tree_gdn(s)
    torch.testing.assert_close(conv_out_t, conv_out_v, rtol=0, atol=1e-6)
    torch.testing.assert_close(conv_t, conv_v, rtol=0, atol=0)
    torch.testing.assert_close(o_t, o_v, rtol=0, atol=1e-6)
    for n in range(len(s["parents"])):
        lo, hi = int(s["qsl"][n]), int(s["qsl"][n + 1])
        slot, off = int(s["spec_idx"][n, 0]), int(s["num_acc"][n]) - 1
        ref = conv_chain_reference(s["x"][lo:hi], s["conv_state"][slot, :, off : off + W - 1], s["weight"], s["bias"])
        torch.testing.assert_close(conv_out_v[lo:hi].double(), ref, rtol=0, atol=ATOL)
        h0 = s["ssm_state"][int(s["spec_idx"][n, off])]
        sl = slice(lo, hi)
        o_ref, s_ref = gdn_chain_reference(s["q"][sl], s["k"][sl], s["v"][sl], s["a"][sl], s["b"][sl], s["A_log"],
                                           s["dt_bias"], h0)
        torch.testing.assert_close(o_v[0, sl].double(), o_ref, rtol=0, atol=ATOL)
        written = ssm_v[s["spec_idx"][n, : hi - lo].long()]  # vLLM stores the state after token t in column t
        torch.testing.assert_close(written.double(), s_ref, rtol=0, atol=ATOL)
        torch.testing.assert_close(states_t[sl], written, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- (4) relayout: vLLM's bookkeeping continues unchanged


def random_accepted(s, gen):
    n = len(s["parents"])
    acc = torch.full((n, SPEC + 1), -1, dtype=torch.int32)
    num = torch.zeros(n, dtype=torch.int32)
    for r, ps in enumerate(s["parents"]):
        p = path_to(ps, int(torch.randint(0, len(ps), (), generator=gen)))
        acc[r, : len(p)] = torch.tensor(p)
        num[r] = len(p)
    return acc, num


@pytest.mark.parametrize("seed", [0, 1])
def test_move_conv_columns_equals_the_relayout_plan(seed):
    """The replay layout's one-launch conv relayout against ``apply_relayout`` (its torch reference) on vLLM's
    transposed slot view: paths with moves, a chain-shaped path, and padding rows with a one-node path on the null
    block."""
    from vllm_ddtree.hybrid.relayout import apply_relayout, move_conv_columns, relayout_plan

    gen = torch.Generator().manual_seed(seed)
    slots, depth, dim = 7, 6, 40
    base = torch.randn(slots, W - 1 + depth, dim, generator=gen)  # vLLM's SD layout; the kernels see it transposed
    blocks = torch.tensor([3, 5, 1, 0, 0], dtype=torch.int32)
    paths = torch.full((5, depth + 1), -1, dtype=torch.int32)
    kept = torch.tensor([4, 3, 5, 1, 1], dtype=torch.int32)
    paths[0, :4] = torch.tensor([0, 2, 3, 6])
    paths[1, :3] = torch.tensor([0, 4, 5])
    paths[2, :5] = torch.tensor([0, 1, 2, 3, 4])  # chain-shaped: nothing moves
    paths[3:, 0] = 0
    expected = base.clone()
    conv_e = expected.transpose(-1, -2)
    apply_relayout(conv_e, None, relayout_plan(blocks, blocks[:, None], paths.clamp(min=0), kept, W, None, None),
                   None)
    got = base.clone()
    move_conv_columns(got.transpose(-1, -2), blocks, paths, kept, W)
    assert torch.equal(got, expected)
    assert not torch.equal(got, base), "no column moved"


@pytest.mark.parametrize("mode", ["workspace", "persistent", "replay"])
def test_relayout_then_vllm_chain_continues(mode):
    gen = torch.Generator().manual_seed(11)
    s = make_step(7)
    conv_t, ssm_t = s["conv_state"].clone(), s["ssm_state"].clone()
    run_tree_conv(s, conv_t)
    t = s["flat_parents"].shape[0]
    if mode == "persistent":  # node i of request n lives in vLLM's spec slot column i (num_speculative_tokens = B)
        rel = torch.arange(t) - s["qsl"][:-1].repeat_interleave(s["qsl"].diff())
        seq = torch.arange(len(s["parents"])).repeat_interleave(s["qsl"].diff())
        node_idx = s["spec_idx"][seq, rel].int()
        o, node_states = run_tree_gdn(dict(s, ssm_state=ssm_t), node_states=ssm_t, node_state_indices=node_idx)
    elif mode == "replay":  # nodes with children in a per-layer workspace, leaves deferred; the path recomputed
        plan = deferred_leaves(s["flat_parents"], s["qsl"])
        node_idx = plan.node_state_indices
        assert 0 < int((node_idx >= 0).sum()) < t
        o, _ = run_tree_gdn(s, node_states=torch.zeros(t, HV, V, K), node_state_indices=node_idx, leaves=plan)
        node_states = None
    else:
        o, node_states = run_tree_gdn(s)
        node_idx = torch.arange(t, dtype=torch.int32)
    o_ref, _ = run_tree_gdn(s)  # outputs do not depend on where node states live
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    acc, num = random_accepted(s, gen)
    args = (s["spec_idx"][:, 0], s["spec_idx"], acc, num, W, node_states, node_idx, s["qsl"])
    if mode == "replay":
        relayout_accepted_path(conv_t, ssm_t, *args)
        replay_accepted_path(s["A_log"], s["a"], s["b"], s["dt_bias"], s["q"][None], s["k"][None], s["v"][None], ssm_t,
                             s["spec_idx"], s["num_acc"], acc, num, s["qsl"])
    else:
        ref_conv, ref_ssm = relayout_reference(conv_t, ssm_t, *args)
        relayout_accepted_path(conv_t, ssm_t, *args)
        torch.testing.assert_close(conv_t, ref_conv, rtol=0, atol=0)
        torch.testing.assert_close(ssm_t, ref_ssm, rtol=0, atol=0)

    # Expected: vLLM verifies only the accepted path, as a chain, from the same caches.
    n = len(s["parents"])
    path_tok = [int(s["qsl"][r]) + int(acc[r, i]) for r in range(n) for i in range(int(num[r]))]
    pqsl = torch.tensor([0] + num.cumsum(0).tolist(), dtype=torch.int32)
    conv_c, ssm_c = s["conv_state"].clone(), s["ssm_state"].clone()
    pick = [z[path_tok] for z in (s["x"], s["q"], s["k"], s["v"], s["a"], s["b"])]
    vllm_chain_step(s, conv_c, ssm_c, *pick, pqsl, s["num_acc"], int(num.max()))
    for r in range(n):
        slot, a = int(s["spec_idx"][r, 0]), int(num[r]) - 1
        torch.testing.assert_close(conv_t[slot, :, : W - 1 + a], conv_c[slot, :, : W - 1 + a], rtol=0, atol=0)
        torch.testing.assert_close(ssm_t[int(s["spec_idx"][r, a])], ssm_c[int(s["spec_idx"][r, a])], rtol=0,
                                   atol=1e-6)

    # Next step: vLLM's own kernels with num_accepted_tokens = a + 1 give the same outputs on both cache sets.
    nxt = make_step(8, chain=True, sizes=(3, 2, 4, 1))
    outs = [vllm_chain_step(s, cs, ss, nxt["x"], nxt["q"], nxt["k"], nxt["v"], nxt["a"], nxt["b"], nxt["qsl"], num,
                            nxt["max_len"]) for cs, ss in ((conv_t, ssm_t), (conv_c, ssm_c))]
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- memory


def test_memory_numbers():
    s = memory.QWEN36_27B
    assert s.conv_dim == 10240 and s.state_elems * s.state_bytes == 3 * 2**20  # 3 MiB per layer per state
    # vLLM's layout: (1 + B) blocks, each a full state plus a (W-1+B)-column conv row, per GDN layer.
    assert memory.persistent_bytes_per_request(s, 15) == 48 * 16 * (10240 * 18 * 2 + 3 * 2**20)
    assert memory.workspace_bytes(s, 65) == 48 * 65 * 3 * 2**20
    budgets = [memory.max_budget(s, 10 * 2**30, 1, m) for m in ("persistent", "workspace", "replay")]
    assert budgets[0] < budgets[1] < budgets[2] == 128
    # The README's numbers: concurrent requests that 20 GiB of GDN state holds at TP=1, wired layout vs replay.
    fits = {b: (memory.max_requests(s, 20 * 2**30, b, "persistent"), memory.max_requests(s, 20 * 2**30, b, "replay"))
            for b in (16, 64)}
    assert fits == {16: (7, 89), 64: (1, 44)}


# ---------------------------------------------------------------- (5) the hooks vLLM's GDN layer would call


def make_hooks(s, tree_rows, masks=None, trees_at=None):
    """Hooks over one forward of ``s``'s spec sequences (batch rows ``trees_at``, default 0..n-1; ``masks``: which
    batch rows are spec sequences), with a replay stash for its one GDN layer."""
    from types import SimpleNamespace

    from vllm_ddtree.hybrid.gdn_hooks import GDNTreeHooks
    from vllm_ddtree.hybrid.replay_layout import ReplayStash
    from vllm_ddtree.tree.layout import TreeBatch

    n = len(s["parents"])
    masks = torch.ones(n, dtype=torch.bool) if masks is None else masks
    trees_at = range(n) if trees_at is None else trees_at
    trees = TreeBatch.allocate(len(masks) + 1, SPEC, "cpu")
    for r, ps in zip(trees_at, s["parents"]):
        trees.parents[r, : len(ps)] = torch.tensor(ps, dtype=torch.int32)
    layer = SimpleNamespace(A_log=s["A_log"], dt_bias=s["dt_bias"], num_k_heads=H, num_v_heads=HV, tp_size=1,
                            head_k_dim=K, head_v_dim=V)
    stash = ReplayStash([layer], 64, 8, torch.float32, torch.device("cpu"))
    metadata = SimpleNamespace(spec_sequence_masks=masks, spec_query_start_loc=s["qsl"])
    forward = object()  # one forward: both hooks and every layer share its parents
    hooks = GDNTreeHooks(trees, tree_rows, 64, W, torch.device("cpu"), stash,
                         metadata_source=lambda: (forward, metadata))
    return hooks, stash, layer


@pytest.mark.parametrize("tokens", [5, 70])
def test_stash_keeps_a_layers_rows_in_one_launch(tokens):
    """``ReplayStash.keep``: this layer's first min(T, stash) rows of q, k, v and of a, b (strided column halves of
    one [T, 2 HV] tensor, as vLLM splits them) land in its stash rows, bit for bit; nothing else is written."""
    from types import SimpleNamespace

    from vllm_ddtree.hybrid.replay_layout import ReplayStash

    layer = SimpleNamespace(A_log=torch.zeros(HV), num_k_heads=H, num_v_heads=HV, tp_size=1, head_k_dim=K,
                            head_v_dim=V)
    stash = ReplayStash([layer, layer], 64, 8, torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(tokens)
    q, k = (torch.randn(1, tokens, H, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, tokens, HV, V, generator=gen).bfloat16()
    b, a = torch.randn(tokens, 2 * HV, generator=gen).bfloat16().chunk(2, dim=-1)
    assert not a.is_contiguous()
    stash.keep(1, q, k, v, a, b)
    n = min(tokens, 64)
    for kept, source in ((stash.q, q[0]), (stash.k, k[0]), (stash.v, v[0]), (stash.a, a), (stash.b, b)):
        assert torch.equal(kept[1, :n], source[:n])
        assert not kept[1, n:].any() and not kept[0].any()


def one_block_per_request(s):
    """``s`` as vLLM's GDN metadata names state in the replay layout: the request's one block in every spec column."""
    blocks = s["spec_idx"][:, 0]
    return dict(s, spec_idx=blocks[:, None].expand(len(blocks), SPEC + 1).contiguous())


def run_hooks(s, hooks, conv_state, ssm_state):
    conv_out = hooks.conv_update(s["x"], conv_state, s["weight"], s["bias"], "silu",
                                 conv_state_indices=s["spec_idx"][:, 0].contiguous(), num_accepted_tokens=s["num_acc"],
                                 query_start_loc=s["qsl"], max_query_len=s["max_len"], validate_data=False)
    o, _ = hooks.recurrent_update(A_log=s["A_log"], a=s["a"], b=s["b"], dt_bias=s["dt_bias"], q=s["q"][None],
                                  k=s["k"][None], v=s["v"][None], initial_state=ssm_state, inplace_final_state=True,
                                  cu_seqlens=s["qsl"], ssm_state_indices=s["spec_idx"],
                                  num_accepted_tokens=s["num_acc"], use_qk_l2norm_in_kernel=True)
    return conv_out, o


def test_hooks_without_trees_compute_what_vllm_computes():
    """A step whose rows verify no tree (tree_rows -1) is a chain: outputs and conv state equal vLLM's; the forward
    writes no recurrent state block (the relayout does, after the walk)."""
    s = one_block_per_request(make_step(5))  # branching trees in the buffers, but no row verifies one
    hooks, _, _ = make_hooks(s, torch.full((len(s["parents"]),), -1, dtype=torch.int32))
    conv_v, ssm_v = s["conv_state"].clone(), s["ssm_state"].clone()
    conv_out_v, o_v = vllm_chain_step(s, conv_v, ssm_v, s["x"], s["q"], s["k"], s["v"], s["a"], s["b"], s["qsl"],
                                      s["num_acc"], s["max_len"])
    conv_h, ssm_h = s["conv_state"].clone(), s["ssm_state"].clone()
    conv_out_h, o_h = run_hooks(s, hooks, conv_h, ssm_h)
    torch.testing.assert_close(conv_out_h, conv_out_v, rtol=0, atol=1e-6)
    torch.testing.assert_close(conv_h, conv_v, rtol=0, atol=0)
    torch.testing.assert_close(o_h, o_v, rtol=0, atol=1e-6)
    assert torch.equal(ssm_h, s["ssm_state"])


# ---------------------------------------------------------------- (6) a step's relayout over every GDN layer


def test_step_relayout_moves_live_rows_only_even_when_padding_rows_name_their_blocks():
    """HybridTreeTarget replays its relayout for a padded row count; padding rows keep stale block tables, which
    may name blocks that live requests own now, and must move nothing."""


    gen = torch.Generator().manual_seed(5)
    budget, depth, rows, live = 6, 4, 4, 2
    slots = 1 + rows * (budget + 1)
    table = torch.zeros(8, 16, dtype=torch.int32)
    table[:live, : budget + 1] = (1 + torch.randperm(slots - 1, generator=gen)[: live * (budget + 1)]).view(live, -1)
    table[live:rows, : budget + 1] = table[:live, : budget + 1].flip(0)  # stale rows: the live rows' blocks
    accepted = torch.full((8, depth + 1), -1, dtype=torch.int32)
    accepted[:rows, :3] = torch.tensor([[0, 2, 5], [0, 1, 3], [0, 4, 6], [0, 3, 5]], dtype=torch.int32)
    num_accepted = torch.full((8,), 2, dtype=torch.int32)
    layers = [(0, torch.randn(slots, 8, W - 1 + budget, generator=gen), torch.randn(slots, 2, 4, 4, generator=gen), W,
               None) for _ in range(2)]
    expected = []
    for _, conv, ssm, _, _ in layers:
        conv_e, ssm_e = conv.clone(), ssm.clone()
        live_slots = table[:live, : budget + 1]
        relayout_accepted_path(conv_e, ssm_e, live_slots[:, 0], live_slots, accepted[:live], num_accepted[:live] + 1,
                               W, ssm_e, live_slots.reshape(-1), torch.arange(live + 1) * (budget + 1))
        expected.append((conv_e, ssm_e))

    target = step_target(budget, table, layers, accepted, num_accepted, live)
    target._relayout_rows(rows)  # what a graph captured for 4 rows replays with 2 live requests
    for (_, conv, ssm, _, _), (conv_e, ssm_e) in zip(layers, expected):
        torch.testing.assert_close(conv, conv_e, rtol=0, atol=0)
        torch.testing.assert_close(ssm, ssm_e, rtol=0, atol=0)


def step_target(budget, table, layers, accepted, num_accepted, live, replay=None):
    """A HybridTreeTarget past its first relayout (layers found, the walk's buffers bound), on the CPU."""
    from types import SimpleNamespace

    from vllm_ddtree.hybrid.target import HybridTreeTarget

    target = HybridTreeTarget.__new__(HybridTreeTarget)
    target.verifier = SimpleNamespace(budget=budget, cuda_graphs=False)
    target.device = torch.device("cpu")
    target.replay = replay
    target.runner = SimpleNamespace(input_batch=SimpleNamespace(
        block_table=[SimpleNamespace(get_device_tensor=lambda n: table[:n])]))
    target._layers = layers
    target._accepted, target._num_accepted = accepted, num_accepted
    target._num_live = torch.tensor(live)
    return target


# ---------------------------------------------------------------- (7) the replay layout: one state block per request


def test_replay_layout_leaves_each_block_as_a_chain_verify_of_the_accepted_path_would():
    """One verify step in the replay layout, through the hooks and the target's relayout. Batch rows 0, 2, 3, 4 verify
    trees (spec sequences 0..3), row 1 prefills in the same step, row 5 is graph padding whose stale block table names
    a live block. The forward writes no state block; afterwards each verified request's one block holds its accepted
    path's last node state (bit for bit the tree kernel's) and its conv row is the persistent layout's relayout; the
    prefill row's and the padding row's blocks are untouched."""
    from ddtree_testkit.sync_audit import SyncAudit

    gen = torch.Generator().manual_seed(13)
    s = make_step(9)
    n = len(s["parents"])
    spec_rows, prefill_row, rows = [0, 2, 3, 4], 1, 6
    masks = torch.zeros(rows - 1, dtype=torch.bool)
    masks[spec_rows] = True
    hooks, stash, layer = make_hooks(s, torch.arange(rows, dtype=torch.int32), masks, spec_rows)
    blocks = s["spec_idx"][:, 0]
    one_block = one_block_per_request(s)  # vLLM's graph-path metadata
    conv_h, ssm_h = s["conv_state"].clone(), s["ssm_state"].clone()
    syncs: list[dict] = []
    with SyncAudit(syncs):
        conv_out_h, o_h = run_hooks(one_block, hooks, conv_h, ssm_h)
    assert torch.equal(ssm_h, s["ssm_state"]), "the verify forward wrote a state block"
    conv_t = s["conv_state"].clone()
    torch.testing.assert_close(conv_out_h, run_tree_conv(s, conv_t), rtol=0, atol=0)  # the tree conv, via the hooks
    torch.testing.assert_close(conv_h, conv_t, rtol=0, atol=0)
    o_t, states_t = tree_fused_sigmoid_gating_delta_rule_update(
        s["A_log"], s["a"], s["b"], s["dt_bias"], s["q"][None], s["k"][None], s["v"][None], s["flat_parents"],
        initial_state=s["ssm_state"], cu_seqlens=s["qsl"], ssm_state_indices=blocks[:, None],
        use_qk_l2norm_in_kernel=True)  # every node's state, from the block
    torch.testing.assert_close(o_h, o_t, rtol=0, atol=0)

    acc, num = random_accepted(s, gen)
    accepted = torch.zeros(8, SPEC + 1, dtype=torch.int32)
    num_accepted = torch.zeros(8, dtype=torch.int32)
    accepted[spec_rows], num_accepted[spec_rows] = acc, num - 1
    accepted[prefill_row, :3] = torch.tensor([0, 3, 5], dtype=torch.int32)  # whatever the walk left there
    num_accepted[prefill_row] = 2
    free = sorted(set(range(1, s["ssm_state"].shape[0])) - set(blocks.tolist()))
    table = torch.zeros(8, 1, dtype=torch.int32)
    table[spec_rows, 0] = blocks
    table[prefill_row, 0] = free[0]
    table[5, 0] = blocks[1]  # padding row: a stale table naming a live block
    conv_e = conv_h.clone()
    relayout_accepted_path(conv_e, ssm_h.clone(), blocks, blocks[:, None], acc, num, W, None, None, s["qsl"])
    target = step_target(SPEC, table, [(0, conv_h, ssm_h, W, layer)], accepted, num_accepted, rows - 1, stash)
    with SyncAudit(syncs):
        target._relayout_rows(rows)
    # Both run inside CUDA graphs on a GPU: no value read, no data-dependent shape (an H200 refused to capture
    # a boolean-mask index here on 2026-12-03).
    assert not syncs, syncs
    for i in range(n):
        last = int(s["qsl"][i]) + int(acc[i, int(num[i]) - 1])
        torch.testing.assert_close(ssm_h[int(blocks[i])], states_t[last], rtol=0, atol=0)
    torch.testing.assert_close(conv_h, conv_e, rtol=0, atol=0)
    untouched = [j for j in range(s["ssm_state"].shape[0]) if j not in set(blocks.tolist())]
    torch.testing.assert_close(ssm_h[untouched], s["ssm_state"][untouched], rtol=0, atol=0)
    assert bool((stash.row_start == -1).all()), "the stash's rows must not outlive their step"


def test_one_state_block_keeps_vllm_shapes_and_drops_the_spec_blocks():
    from dataclasses import dataclass
    from types import SimpleNamespace

    from vllm_ddtree.hybrid.replay_layout import one_state_block

    @dataclass(frozen=True)
    class Spec:
        shapes: tuple
        num_speculative_blocks: int

    layer = SimpleNamespace(get_kv_cache_spec=lambda spec_tokens: Spec(((8, 3 + spec_tokens), (2, 4, 4)), spec_tokens))
    one_state_block(layer)
    assert layer.get_kv_cache_spec(12) == Spec(((8, 15), (2, 4, 4)), 0)
