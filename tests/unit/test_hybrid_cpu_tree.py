"""vllm_ddtree.hybrid.cpu_tree against vLLM's own CPU GatedDeltaNet spec-decode step (``_spec_forward``), bitwise.

(a) a chain-shaped tree is vLLM's chain step; (b) every node of a random tree gets what vLLM's step gives a chain
that starts with the node's root path; (c) after ``relayout_accepted_path`` vLLM's next step continues exactly as
if the accepted path had been verified as a chain.
"""

from types import MethodType, SimpleNamespace

import pytest
import torch

gdn_cpu = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")
if not hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_spec_cpu"):
    pytest.skip("vLLM's CPU GDN ops are not built in this environment", allow_module_level=True)

from tree_shapes import path_to, random_parents  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402

from vllm_ddtree.hybrid.cpu_tree import tree_spec_forward_cpu  # noqa: E402
from vllm_ddtree.hybrid.reference import conv_roll_reference  # noqa: E402

H, HV, K, V, W = 2, 4, 16, 16, 4
DIM = 2 * H * K + HV * V
SPEC = 8  # num_speculative_tokens: a full draft has SPEC + 1 tokens
STATE_LEN = W - 1 + SPEC
BF16 = torch.bfloat16


def path_then_rest(parents: list[int], node: int) -> list[int]:
    """A chain order starting with node's root path: the path, then the other nodes in pop order."""
    path = path_to(parents, node)
    return path + [i for i in range(len(parents)) if i not in path]


def make_layer(gen: torch.Generator) -> SimpleNamespace:
    layer = SimpleNamespace(
        conv1d=SimpleNamespace(weight=(torch.randn(DIM, 1, W, generator=gen) * 0.5).to(BF16), bias=None),
        activation="silu",
        A_log=torch.rand(HV, generator=gen) - 0.5,
        dt_bias=(torch.rand(HV, generator=gen) * 0.2).to(BF16),
        key_dim=H * K,
        value_dim=HV * V,
        head_k_dim=K,
        head_v_dim=V,
        num_v_heads=HV,
        tp_size=1,
    )
    layer.rearrange_mixed_qkv = MethodType(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    return layer


def metadata(qsl: list[int], spec_idx: torch.Tensor, num_acc: torch.Tensor) -> GDNAttentionMetadata:
    t = qsl[-1]
    return GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=len(qsl) - 1,
        num_spec_decode_tokens=t,
        num_actual_tokens=t,
        spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        spec_state_indices_tensor=spec_idx,
        num_accepted_tokens=num_acc.to(torch.int32),
    )


def inputs(t: int, gen: torch.Generator):
    """mixed_qkv ``[T, DIM]``, b, a ``[T, HV]`` in bf16, as the CPU GDN layer requires."""
    return (
        torch.randn(t, DIM, generator=gen).to(BF16),
        torch.randn(t, HV, generator=gen).to(BF16),
        torch.randn(t, HV, generator=gen).to(BF16),
    )


def make_step(seed: int, sizes, chain: bool = False, num_acc=None):
    """A batch of trees plus vLLM CPU caches (kernel views): conv (slots, DIM, STATE_LEN) bf16, ssm float32."""
    gen = torch.Generator().manual_seed(seed)
    n = len(sizes)
    parents = [random_parents(s, gen, chain) for s in sizes]
    slots = 1 + n * (SPEC + 1)
    spec_idx = (1 + torch.randperm(slots - 1, generator=gen)).view(n, SPEC + 1).int()
    if num_acc is None:  # vLLM's CPU conv roll needs num_accepted <= the request's token count
        num_acc = [int(torch.randint(1, s + 1, (), generator=gen)) for s in sizes]
    qsl = [0]
    for s in sizes:
        qsl.append(qsl[-1] + s)
    x, b, a = inputs(qsl[-1], gen)
    return dict(
        layer=make_layer(gen),
        parents=parents,
        qsl=qsl,
        spec_idx=spec_idx,
        num_acc=torch.tensor(num_acc),
        conv=torch.randn(slots, DIM, STATE_LEN, generator=gen).to(BF16),
        ssm=torch.randn(slots, HV, K, V, generator=gen) * 0.3,
        flat_parents=torch.tensor([p for ps in parents for p in ps], dtype=torch.int32),
        x=x,
        b=b,
        a=a,
    )


def vllm_spec_forward(s, conv, ssm, x, b, a, qsl, spec_idx, num_acc):
    md = metadata(qsl, spec_idx, num_acc)
    return gdn_cpu._spec_forward(s["layer"], md, x, b, a, conv, ssm, W, STATE_LEN)


def tree_forward(s, conv, ssm):
    md = metadata(s["qsl"], s["spec_idx"], s["num_acc"])
    return tree_spec_forward_cpu(s["layer"], md, s["x"], s["b"], s["a"], conv, ssm, W, STATE_LEN, s["flat_parents"])


def test_chain_shaped_tree_is_vllm_spec_forward():
    s = make_step(0, sizes=(SPEC + 1, SPEC + 1), chain=True, num_acc=[4, 1])
    conv_v, ssm_v = s["conv"].clone(), s["ssm"].clone()
    out_v = vllm_spec_forward(s, conv_v, ssm_v, s["x"], s["b"], s["a"], s["qsl"], s["spec_idx"], s["num_acc"])
    conv_t, ssm_t = s["conv"].clone(), s["ssm"].clone()
    out_t = tree_forward(s, conv_t, ssm_t)
    assert not torch.equal(ssm_v, s["ssm"]) and not torch.equal(conv_v, s["conv"])
    assert torch.equal(out_t, out_v)
    assert torch.equal(conv_t, conv_v)
    assert torch.equal(ssm_t, ssm_v)


@pytest.mark.parametrize("seed", [1, 2])
def test_every_node_equals_vllm_chain_over_its_root_path(seed):
    s = make_step(seed, sizes=(SPEC + 1, 5, 1, 7))
    conv_t, ssm_t = s["conv"].clone(), s["ssm"].clone()
    out_t = tree_forward(s, conv_t, ssm_t)
    written = set()
    for r, ps in enumerate(s["parents"]):
        lo, size = s["qsl"][r], len(ps)
        x, b, a = (z[lo : lo + size] for z in (s["x"], s["b"], s["a"]))
        spec_row, num_acc = s["spec_idx"][r : r + 1], s["num_acc"][r : r + 1]
        for node in range(size):
            order = path_then_rest(ps, node)
            depth = len(path_to(ps, node)) - 1
            conv_c, ssm_c = s["conv"].clone(), s["ssm"].clone()
            out_c = vllm_spec_forward(s, conv_c, ssm_c, x[order], b[order], a[order], [0, size], spec_row, num_acc)
            assert torch.equal(out_t[lo + node], out_c[depth]), (r, node)
            slot = int(s["spec_idx"][r, node])
            assert torch.equal(ssm_t[slot], ssm_c[int(s["spec_idx"][r, depth])]), (r, node)
            written.add(slot)
        slot = int(s["spec_idx"][r, 0])
        rolled = conv_roll_reference(s["conv"][slot], x, int(s["num_acc"][r]), W)
        assert torch.equal(conv_t[slot], rolled), r
    others = [i for i in range(s["ssm"].shape[0]) if i not in written]
    assert torch.equal(ssm_t[others], s["ssm"][others])


@pytest.mark.parametrize("seed", [3, 4])
def test_relayout_then_vllm_next_step_continues_as_after_a_chain(seed):
    from vllm_ddtree.hybrid.relayout import relayout_accepted_path

    gen = torch.Generator().manual_seed(100 + seed)
    s = make_step(seed, sizes=(SPEC + 1,) * 3)
    n, size = 3, SPEC + 1
    conv_t, ssm_t = s["conv"].clone(), s["ssm"].clone()
    tree_forward(s, conv_t, ssm_t)

    acc = torch.full((n, size), -1, dtype=torch.int32)
    num = torch.zeros(n, dtype=torch.int32)
    orders = []
    for r, ps in enumerate(s["parents"]):
        off_chain = [i for i in range(size) if path_to(ps, i) != list(range(len(path_to(ps, i))))]
        candidates = off_chain if r > 0 and off_chain else list(range(size))  # request 0: any node
        leafish = candidates[int(torch.randint(0, len(candidates), (), generator=gen))]
        path = path_to(ps, leafish)
        acc[r, : len(path)] = torch.tensor(path)
        num[r] = len(path)
        orders += [s["qsl"][r] + i for i in path_then_rest(ps, leafish)]
    assert any(acc[r, i] != i for r in range(n) for i in range(int(num[r]))), "no accepted path leaves the chain"
    node_slots = s["spec_idx"].reshape(-1)  # default placement: node i of request r at spec slot column i
    relayout_accepted_path(
        conv_t,
        ssm_t,
        s["spec_idx"][:, 0],
        s["spec_idx"],
        acc,
        num,
        W,
        ssm_t,
        node_slots,
        torch.tensor(s["qsl"], dtype=torch.int32),
    )

    # The alternative history: vLLM verified a chain starting with the accepted path, from the same caches.
    conv_c, ssm_c = s["conv"].clone(), s["ssm"].clone()
    vllm_spec_forward(
        s, conv_c, ssm_c, s["x"][orders], s["b"][orders], s["a"][orders], s["qsl"], s["spec_idx"], s["num_acc"]
    )
    for r in range(n):
        slot, last = int(s["spec_idx"][r, 0]), int(num[r]) - 1
        assert torch.equal(conv_t[slot, :, : W - 1 + last], conv_c[slot, :, : W - 1 + last])
        assert torch.equal(ssm_t[int(s["spec_idx"][r, last])], ssm_c[int(s["spec_idx"][r, last])])

    # Next step: vLLM's own chain step with num_accepted_tokens = len(path) on both histories.
    x, b, a = inputs(n * size, gen)
    out_t = vllm_spec_forward(s, conv_t, ssm_t, x, b, a, s["qsl"], s["spec_idx"], num)
    out_c = vllm_spec_forward(s, conv_c, ssm_c, x, b, a, s["qsl"], s["spec_idx"], num)
    assert torch.equal(out_t, out_c)
    assert torch.equal(conv_t, conv_c)  # every column the next step keeps, and the rest untouched on both sides
    assert torch.equal(ssm_t, ssm_c)  # the next step rewrote every spec slot column
