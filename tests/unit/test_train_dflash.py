"""The DFlash trainer (ddtree_testkit.train_dflash, tools/train_dflash.py) on the CPU: data step, training forward,
checkpoint format, determinism, resume.

The target is the random tiny Llama (8 layers, vocab 49152) with a handful of prompts; everything runs on one CPU
thread (two threads on a loaded 2-core box are several times slower). The engine-level check (the trained drafter
in vLLM, draft logits equal to vLLM's) is tests/engine/test_train_dflash_engine.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ddtree_testkit import train_dflash as td
from ddtree_testkit.corpora import gsm8k_cases, stdlib_functions
from ddtree_testkit.dflash_checkpoint import choose_mask_token_id, dflash_draft_config, dflash_weight_shapes
from ddtree_testkit.tiny_targets import tiny_target_dir

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "import numpy as np\n",
    "The quick brown fox",
]
FAST = dict(warmup=3, lr=3e-3, log_every=1000, progress=False, ckpt_every=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def target() -> Path:
    return tiny_target_dir("llama")


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    train = [{"source": "unit", "id": str(i), "ids": tok(t).input_ids} for i, t in enumerate(TEXTS)]
    heldout = [{"source": "unit", "id": "h0", "ids": tok("Q: What is 12 * 7?\nA:").input_ids}]
    opts = td.DataOptions(max_new_tokens=24, gen_batch_size=8, greedy=1, sampled=1)
    path = tmp_path_factory.mktemp("dflash_data") / "data"
    out = td.prepare_data(target, path, opts=opts, train_prompts=train, heldout_prompts=heldout, device="cpu")
    assert td.prepare_data(target, path, opts=opts, train_prompts=train, heldout_prompts=heldout) == out  # cached
    return out


def _tensors(out_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out_dir / "model.safetensors"))


def test_data_cache_layout(data_dir, target):
    meta, train, heldout = td.load_data(data_dir)
    assert meta["layer_ids"] == [1, 2, 3, 4, 5]
    assert len(train) == 2 * len(TEXTS) and len(heldout) == 1
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    assert train.feats.shape == (train.ids.numel(), 5 * hidden)
    for i in range(len(train)):
        assert train.prompt_lens[i] < train.seq_len(i)
        assert len(train.anchors(i)) > 0
    # greedy and T=1 continuations of the same prompt differ
    n = len(TEXTS)
    assert any(train.ids[train.offsets[i]: train.offsets[i + 1]].tolist()
               != train.ids[train.offsets[i + n]: train.offsets[i + n + 1]].tolist() for i in range(n))


def test_features_are_layer_outputs_plus_one(target):
    """Feature block j = output of decoder layer ids[j] = HF hidden_states[ids[j] + 1] (vLLM's aux layer id + 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    outs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: outs.__setitem__(k, o[0] if isinstance(o, tuple) else o))
             for k, layer in enumerate(model.model.layers)]
    layer_ids = [1, 3, 5]
    prompts = [tok(TEXTS[1]).input_ids, tok(TEXTS[2]).input_ids]
    try:
        res = td.generate_with_features(model, tok, prompts, layer_ids, max_new_tokens=6, sample=False, seed=0,
                                        batch_size=2, feature_dtype=torch.float32)
        for ids, feats in res:
            with torch.no_grad():
                model(torch.tensor([ids]))
            expect = torch.cat([outs[i][0] for i in layer_ids], dim=-1)
            torch.testing.assert_close(feats[:-1], expect[:-1], atol=2e-4, rtol=1e-4)
            assert feats[-1].abs().max() == 0
    finally:
        for h in hooks:
            h.remove()


def _reference_block_logits(model, feats, ids, anchor):
    """One block by the formulas of vLLM's qwen3_dflash.py, with vLLM's own RMSNorm and RoPE modules."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    cfg = model.cfg
    hd, nq, nkv, eps = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    bs = model.block_size
    vllm_config = VllmConfig()
    with set_current_vllm_config(vllm_config):
        rope = get_rope(hd, max_position=cfg["max_position_embeddings"], rope_parameters=cfg["rope_parameters"])

    norms: dict[int, RMSNorm] = {}

    def norm(w):
        if id(w) not in norms:
            with set_current_vllm_config(vllm_config):
                norms[id(w)] = RMSNorm(w.numel(), eps=eps)
            norms[id(w)].weight.data.copy_(w.detach())
        return norms[id(w)]

    def heads_norm(w, x):  # per-head RMSNorm, like DFlashQwen3Attention
        return norm(w).forward_native(x.view(x.shape[0], -1, hd)).reshape(x.shape[0], -1)

    ctx = norm(model.hidden_norm.weight).forward_native(feats[:anchor] @ model.fc.weight.T)
    block = torch.tensor([ids[anchor]] + [model.mask_token_id] * (bs - 1))
    x = model.embed[block]
    q_pos = torch.arange(anchor, anchor + bs)
    c_pos = torch.arange(anchor)
    residual = None
    for layer in model.layers:
        a = layer.self_attn
        if residual is None:
            residual, h = x, norm(layer.input_layernorm.weight).forward_native(x)
        else:
            h, residual = norm(layer.input_layernorm.weight).forward_native(x, residual)
        q = heads_norm(a.q_norm.weight, h @ a.q_proj.weight.T)
        k = heads_norm(a.k_norm.weight, h @ a.k_proj.weight.T)
        v = h @ a.v_proj.weight.T
        q, k = rope.forward_native(q_pos, q, k)
        ck = heads_norm(a.k_norm.weight, ctx @ a.k_proj.weight.T)
        cv = ctx @ a.v_proj.weight.T
        _, ck = rope.forward_native(c_pos, torch.zeros(anchor, nq * hd), ck)
        K = torch.cat([ck, k]).view(-1, nkv, hd)
        V = torch.cat([cv, v]).view(-1, nkv, hd)
        Q = q.view(bs, nq, hd)
        out = []
        for head in range(nq):  # GQA: q head h reads kv head h // (nq / nkv); no mask (non-causal block)
            kv = head // (nq // nkv)
            p = torch.softmax(Q[:, head] @ K[:, kv].T * hd ** -0.5, dim=-1)
            out.append(p @ V[:, kv])
        attn = torch.cat(out, dim=-1) @ a.o_proj.weight.T
        h, residual = norm(layer.post_attention_layernorm.weight).forward_native(attn, residual)
        m = layer.mlp
        x = (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    x, _ = norm(model.norm.weight).forward_native(x, residual)
    return (x @ model.lm_head.T)[1:]


@torch.no_grad()
def test_batched_forward_matches_vllm_formulas(data_dir, target):
    """The batched, masked training forward (several sequences, padding blocks, ragged contexts) equals a per-block
    transcription of vLLM's drafter math (2 layers, random weights, norms not all ones)."""
    meta, train, _ = td.load_data(data_dir)
    cfg = dflash_draft_config(target, block_size=6, num_layers=2, target_layer_ids=meta["layer_ids"])
    model = td.build_drafter(cfg, target, torch.device("cpu"), seed=3)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    seqs = [0, 3, 7]
    anchor_lists = [list(train.anchors(0))[:3], list(train.anchors(3))[-2:], [train.anchors(7)[0]]]
    feats, block_ids, anchors, labels = td.make_batch(train, seqs, anchor_lists, model.block_size,
                                                      model.mask_token_id)
    logits = model.logits(model(feats.float(), block_ids, anchors))[:, :, 1:]
    checked = 0
    for b, (i, alist) in enumerate(zip(seqs, anchor_lists)):
        o, n = train.offsets[i], train.seq_len(i)
        f, ids = train.feats[o: o + n].float(), train.ids[o: o + n].tolist()
        for k, a in enumerate(alist):
            ref = _reference_block_logits(model, f, ids, a)
            torch.testing.assert_close(logits[b, k], ref, atol=2e-4, rtol=2e-4)
            valid = labels[b, k] != td.IGNORE
            assert labels[b, k][valid].tolist() == ids[a + 1: a + model.block_size][: int(valid.sum())]
            checked += 1
    assert checked == 6


def test_training_reduces_loss_and_checkpoint_round_trips(data_dir, target, tmp_path):
    out = tmp_path / "drafter"
    opts = td.TrainOptions(steps=30, batch_size=4, anchors_per_seq=8, loss_vocab="data", **FAST)
    log = td.train(target, out, data_dir, opts, device="cpu")
    losses = [v for _, v in log["loss"]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert len(log["final_eval"]["top1_per_depth"]) == 7

    cfg = json.loads((out / "config.json").read_text())
    meta = json.loads((data_dir / "meta.json").read_text())
    expect_cfg = dflash_draft_config(target, block_size=8, num_layers=1, target_layer_ids=meta["layer_ids"])
    assert cfg == dict(expect_cfg, dtype="bfloat16")
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    mask_id = choose_mask_token_id(target)
    assert cfg["dflash_config"] == {"mask_token_id": mask_id, "target_layer_ids": [1, 2, 3, 4, 5]}
    tensors = _tensors(out)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == dflash_weight_shapes(cfg)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((out / "train_log.json").read_text())["steps_done"] == 30

    loaded = td.load_drafter(out, target)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, tensors[name].float()), name
    assert td.state_path_for(out.resolve()).is_file()


def test_seeded_training_is_deterministic_and_resumes_exactly(data_dir, target, tmp_path):
    opts = dict(steps=6, batch_size=2, anchors_per_seq=4, **FAST)  # full-vocab softmax
    td.train(target, tmp_path / "a", data_dir, td.TrainOptions(seed=0, **opts), device="cpu")
    td.train(target, tmp_path / "b", data_dir, td.TrainOptions(seed=0, **opts), device="cpu")
    td.train(target, tmp_path / "c", data_dir, td.TrainOptions(seed=1, **opts), device="cpu")
    a, b, c = _tensors(tmp_path / "a"), _tensors(tmp_path / "b"), _tensors(tmp_path / "c")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)

    # interrupted after 4 steps (state saved), then resumed to 6: same weights as the uninterrupted run
    td.train(target, tmp_path / "r", data_dir, td.TrainOptions(seed=0, stop_after=4, **opts), device="cpu")
    log = td.train(target, tmp_path / "r", data_dir, td.TrainOptions(seed=0, **opts), device="cpu")
    assert log["steps_done"] == 6 and [s for s, _ in log["loss"]] == list(range(1, 7))
    r = _tensors(tmp_path / "r")
    assert all(torch.equal(a[n], r[n]) for n in a)


def test_batches_depend_only_on_seed_and_step(data_dir):
    _, train, _ = td.load_data(data_dir)
    x = td.train_batch(train, 5, 0, 4, 8, 8, 16)
    y = td.train_batch(train, 5, 0, 4, 8, 8, 16)
    z = td.train_batch(train, 6, 0, 4, 8, 8, 16)
    assert all(torch.equal(p, q) for p, q in zip(x, y))
    assert not all(p.shape == q.shape and torch.equal(p, q) for p, q in zip(x, z))
    # every anchor is a target-generated token with at least its first label inside the sequence
    feats, block_ids, anchors, labels = x
    real = labels[:, :, 0] != td.IGNORE
    assert real.sum() >= 4 * 4
    for b in range(anchors.shape[0]):
        assert (anchors[b][real[b]] <= feats.shape[1]).all()


@pytest.mark.parametrize("sample", [False, True])
def test_teacher_forced_features_equal_generation_pass(target, sample):
    """generator="vllm" takes features from one teacher-forced forward per batch of whole sequences (ragged, right
    padded); for the same token sequences they equal the HF generation pass's features (float32), last row zero."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    layer_ids = [1, 2, 3, 4, 5]
    prompts = [tok(t).input_ids for t in TEXTS[:4]]
    gen = td.generate_with_features(model, tok, prompts, layer_ids, max_new_tokens=10, sample=sample, seed=1,
                                    batch_size=4, feature_dtype=torch.float32)
    # a small token budget forces several batches with different widths
    tf = td.teacher_forced_features(model, [ids for ids, _ in gen], layer_ids, batch_tokens=40,
                                    feature_dtype=torch.float32)
    for (ids, fg), ft in zip(gen, tf):
        assert ft.shape == fg.shape == (len(ids), 5 * model.config.hidden_size)
        torch.testing.assert_close(ft, fg, atol=3e-4, rtol=1e-4)  # decode-step vs full-forward matmul order
        assert ft[-1].abs().max() == 0


def test_online_features_equal_stored(data_dir, target):
    """features="online": make_batch recomputes the context rows with the target; they equal the stored ones."""
    meta, train, _ = td.load_data(data_dir)
    _, online, _ = td.load_data(data_dir)
    online.feats = None
    td.attach_online_features([online], target, meta["layer_ids"], torch.device("cpu"))
    seqs = [0, 5, 9]
    anchor_lists = [list(train.anchors(0))[:3], list(train.anchors(5))[-2:], [train.anchors(9)[0]]]
    a = td.make_batch(train, seqs, anchor_lists, 8, 16)
    b = td.make_batch(online, seqs, anchor_lists, 8, 16)
    for x, y in zip(a[1:], b[1:]):
        assert torch.equal(x, y)
    # stored features are bf16 (the data fixture's default): compare at bf16 resolution
    torch.testing.assert_close(b[0].to(torch.bfloat16).float(), a[0].float(), atol=0.02, rtol=0.01)


def test_data_online_features_store_ids_only(target, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = [{"source": "unit", "id": str(i), "ids": tok(t).input_ids} for i, t in enumerate(TEXTS[:2])]
    opts = td.DataOptions(max_new_tokens=8, greedy=1, sampled=0, features="online")
    out = td.prepare_data(target, tmp_path / "d", opts=opts, train_prompts=prompts, heldout_prompts=prompts[:1],
                          device="cpu")
    with safe_open(str(out / "train.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == {"ids", "offsets", "prompt_lens"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["features"] == "online" and meta["recipe"]["options"]["features"] == "online"
    # the late options stay out of the cache key at their defaults (caches built before them stay valid)
    assert "features" not in td.data_recipe(target, [1], td.DataOptions())["options"]


def test_prompt_sources_are_seeded_and_disjoint_from_heldout():
    from transformers import AutoTokenizer

    a, b = td.math_word_problems(300, seed=0), td.math_word_problems(300, seed=0)
    assert a == b and len(set(a)) == 300 and a != td.math_word_problems(300, seed=1)
    gsm = {c["prompt"] for c in gsm8k_cases()}
    assert not gsm & set(a)
    fns = stdlib_functions(20, seed=0)
    assert len(fns) == 20 and all(f.startswith(("def ", "@")) for f in fns)
    assert all('"""' in f or "'''" in f for f in fns)
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir("llama")))
    train, heldout = td.build_prompts(tok, humaneval=200, mtbench=80, stdlib=2, heldout_gsm8k=4,
                                      heldout_humaneval=8, seed=0, max_prompt_tokens=10_000, mtbench_turns=2,
                                      math=5, code_tasks=3, truthfulqa=4, hellaswag=4)
    sources = [p["source"] for p in train]
    assert sources.count("humaneval") == 164 - 8 and sources.count("mtbench") == sources.count("mtbench2") == 80
    assert {s: sources.count(s) for s in ("stdlib", "stdlib_fn", "math", "truthfulqa", "hellaswag")} == {
        "stdlib": 2, "stdlib_fn": 3, "math": 5, "truthfulqa": 4, "hellaswag": 4}
    held = {tuple(p["ids"]) for p in heldout}
    assert len(heldout) == 12 and not held & {tuple(p["ids"]) for p in train}


def test_lr_schedule_follows_time_budget():
    o = td.TrainOptions(steps=1000, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert td.lr_at(5, o, time_frac=0.9) == pytest.approx(0.6)  # warm-up is by steps
    assert td.lr_at(100, o) > 0.9
    assert td.lr_at(100, o, time_frac=1.0) == pytest.approx(0.1)  # budget spent: at the floor
    assert td.lr_at(100, o, time_frac=0.5) == pytest.approx(0.55)
    assert td.lr_at(900, o, time_frac=0.0) == td.lr_at(900, o)  # steps ahead of time: steps rule


def test_epochs_dropout_and_keep_best(data_dir, target, tmp_path):
    _, train, _ = td.load_data(data_dir)
    opts = td.TrainOptions(epochs=0.5, batch_size=2, anchors_per_seq=4, dropout=0.1, eval_every=2, eval_anchors=4,
                           keep_best=True, **FAST)
    log = td.train(target, tmp_path / "k", data_dir, opts, device="cpu")
    steps = math.ceil(0.5 * train.num_anchors() / (2 * 4))
    assert log["steps_done"] == steps
    subset = [e for e in log["evals"] if e["subset"]]
    assert len(subset) == (steps - 1) // 2 + 1  # periodic evals + the last step's
    best = max(subset, key=lambda e: (e["tau_chain_est"], -e["ce"]))
    assert log["exported_step"] == best["step"]
    # same seed, same dropout masks: reproducible
    log2 = td.train(target, tmp_path / "k2", data_dir, opts, device="cpu")
    assert log2["loss"] == log["loss"]
    assert all(torch.equal(x, y) for x, y in zip(_tensors(tmp_path / "k").values(), _tensors(tmp_path / "k2").values()))
