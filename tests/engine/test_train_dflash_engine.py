"""A drafter trained by ddtree_testkit.train_dflash (tools/train_dflash.py) inside the real vLLM engine (CPU, float32).

The drafter is trained briefly on the tiny Llama target's own continuations of the engine prompts, then:

* as ``{"method": "dflash"}`` its greedy output equals no-spec, vLLM accepts most drafts, and **vLLM's draft logits
  equal the training forward's** for the same weights and inputs: every draft pass of every request is recorded
  inside the engine (dflash_probe_run.py) and recomputed from HF target features of the same tokens. This pins
  the whole training layout to vLLM's: target layer ids + 1, fc + hidden_norm, context K/V, RoPE positions, the
  block [root, MASK...], non-causal attention, final norm, the target's lm_head;
* as ``{"method": "ddtree"}`` (B = 8) its greedy output equals no-spec and trees accept.

For speed the test drafter is trained with ``loss_vocab="data"`` (softmax over the ~400 token ids of its data).
Its argmax is right, so the chain accepts most drafts, but its full-vocab probabilities are not calibrated (top-1
probability ~0.01: the never-seen ids are never pushed down), and DDTree's best-first tree then spends its budget
on depth-1 siblings. That is why the ddtree case only asserts that trees accept, not a chain-like τ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash_probe_run import run_probe

from ddtree_testkit import train_dflash as td
from ddtree_testkit.engine_run import run_engine

MAX_TOKENS = 48  # the conftest ``reference`` fixture's length (the training data's continuation length)
RUN_PROMPTS, RUN_TOKENS = 4, 32  # engine runs: a prefix of the reference (greedy, so prefixes agree)


@pytest.fixture(scope="module")
def trained_drafter(tiny_llama_dir, prompt_ids, tmp_path_factory) -> Path:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("trained_dflash")
        prompts = [{"source": "engine", "id": str(i), "ids": ids} for i, ids in enumerate(prompt_ids)]
        data = td.prepare_data(tiny_llama_dir, root / "data", train_prompts=prompts, heldout_prompts=prompts[:2],
                               opts=td.DataOptions(max_new_tokens=MAX_TOKENS, greedy=1, sampled=1), device="cpu")
        opts = td.TrainOptions(steps=60, batch_size=8, anchors_per_seq=16, lr=3e-3, warmup=5, loss_vocab="data",
                               ckpt_every=0, progress=False, log_every=1000)
        log = td.train(tiny_llama_dir, root / "drafter", data, opts, device="cpu")
        assert log["final_eval"]["top1_per_depth"][0] > 0.5, log["final_eval"]
        return root / "drafter"
    finally:
        torch.set_num_threads(old)


@torch.no_grad()
def _training_logits(model, target, seq: list[int], anchors: list[int], roots: list[int]) -> torch.Tensor:
    """[len(anchors), bs-1, V] draft logits of the training forward: blocks [root, MASK...] at the anchors, context
    from HF float32 target features of ``seq`` (an anchor may be len(seq): the root is then a token past the end)."""
    layer_ids = model.cfg["dflash_config"]["target_layer_ids"]
    hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)  # [1, len, n*H]
    block_ids = torch.full((1, len(anchors), model.block_size), model.mask_token_id)
    block_ids[0, :, 0] = torch.tensor(roots)
    hidden = model(feats[:, : max(anchors)], block_ids, torch.tensor([anchors]))
    return model.logits(hidden)[0, :, 1:]


def test_trained_drafter_in_vllm_dflash_matches_training_forward(tiny_llama_dir, trained_drafter, prompt_ids,
                                                                reference, tmp_path):
    k = 7  # block_size - 1: every slot the drafter predicts
    # the 48-token reference also covers tokens a final step accepts past max_tokens (the engine cuts them off)
    prompt_ids, full_reference = prompt_ids[:RUN_PROMPTS], reference[:RUN_PROMPTS]
    reference = [r[:RUN_TOKENS] for r in full_reference]
    result = run_probe(probe_out=str(tmp_path / "probe.pt"), model=str(tiny_llama_dir), prompt_token_ids=prompt_ids,
                       max_tokens=RUN_TOKENS, ignore_eos=True,
                       spec={"method": "dflash", "model": str(trained_drafter), "num_speculative_tokens": k})
    assert result["token_ids"] == reference
    stats = result["spec_decode"]
    drafts, accepted = stats["vllm:spec_decode_num_drafts"], stats["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and accepted > 2 * drafts, stats  # τ > 3: the trained drafter is really accepted

    from transformers import AutoModelForCausalLM

    records = result["probe"]
    model = td.load_drafter(trained_drafter, tiny_llama_dir)
    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    mask_id = model.mask_token_id
    by_prompt: dict[int, list[dict]] = {}
    for rec in records:
        by_prompt.setdefault(prompt_ids.index(rec["prompt"]), []).append(rec)
    assert len(by_prompt) == len(prompt_ids)
    checked = 0
    for i, recs in by_prompt.items():
        seq = prompt_ids[i] + full_reference[i]
        anchors = [rec["positions"][0] for rec in recs]
        ours = _training_logits(model, target, seq, anchors, [rec["input_ids"][0] for rec in recs])
        for rec, mine in zip(recs, ours):
            p = rec["positions"][0]
            assert rec["positions"] == list(range(p, p + k + 1))
            assert rec["input_ids"][1:] == [mask_id] * k
            assert len(prompt_ids[i]) <= p <= len(seq)
            if p < len(seq):  # root = the last committed token
                assert rec["input_ids"][0] == seq[p]
            torch.testing.assert_close(mine.gather(-1, rec["top_ids"]), rec["top_vals"], atol=2e-3, rtol=1e-3)
            torch.testing.assert_close(mine.logsumexp(-1), rec["lse"], atol=2e-3, rtol=1e-3)
            torch.testing.assert_close(mine[:, rec["probe_ids"]], rec["probe_vals"], atol=2e-3, rtol=1e-3)
            clear = rec["top_vals"][:, 0] - rec["top_vals"][:, 1] > 1e-2  # argmax agrees unless a near-tie
            assert torch.equal(mine.argmax(-1)[clear], rec["top_ids"][clear, 0])
            checked += 1
    # every verified draft was recorded (a finishing request may draft once more without a verify)
    assert checked == len(records) >= drafts


def test_trained_drafter_in_vllm_ddtree_is_lossless(tiny_llama_dir, trained_drafter, prompt_ids, reference):
    result = run_engine(model=str(tiny_llama_dir), prompt_token_ids=prompt_ids[:RUN_PROMPTS], max_tokens=RUN_TOKENS,
                        ignore_eos=True,
                        spec={"method": "ddtree", "model": str(trained_drafter), "num_speculative_tokens": 8})
    assert result["token_ids"] == [r[:RUN_TOKENS] for r in reference[:RUN_PROMPTS]]
    stats = result["spec_decode"]
    assert stats["vllm:spec_decode_num_drafts"] > 0
    assert stats["vllm:spec_decode_num_accepted_tokens"] > stats["vllm:spec_decode_num_drafts"] // 4, stats


def test_vllm_generator_matches_hf_generator(tiny_llama_dir, prompt_ids, tmp_path):
    """``generator="vllm"`` (vLLM's offline LLM in a subprocess, then one teacher-forced HF forward per batch): the
    greedy continuations equal transformers' greedy ones (float32), their features equal the generation pass's, and
    the seeded T=1 samples differ from each other."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [{"source": "engine", "id": str(i), "ids": ids} for i, ids in enumerate(prompt_ids[:3])]
        built = {}
        for gen in ("hf", "vllm"):
            opts = td.DataOptions(max_new_tokens=16, greedy=1, sampled=2 if gen == "vllm" else 0, generator=gen,
                                  feature_dtype="float32")
            data = td.prepare_data(tiny_llama_dir, tmp_path / gen, train_prompts=prompts, heldout_prompts=prompts[:1],
                                   opts=opts, device="cpu")
            built[gen] = td.load_data(data)
    finally:
        torch.set_num_threads(old)
    (_, hf, _), (meta, vl, vl_held) = built["hf"], built["vllm"]
    assert meta["generator"] == "vllm" and len(vl) == 9 and len(vl_held) == 1

    def seq(split, i):
        return split.ids[split.offsets[i]: split.offsets[i + 1]].tolist()

    for i in range(3):
        assert seq(vl, i) == seq(hf, i)  # greedy
        o, n = vl.offsets[i], vl.seq_len(i)
        torch.testing.assert_close(vl.feats[o: o + n], hf.feats[o: o + n], atol=3e-4, rtol=1e-4)
        assert vl.feats[o + n - 1].abs().max() == 0
        assert seq(vl, 3 + i) != seq(vl, 6 + i)  # two T=1 samples of one prompt (child seeds seed + index)
        assert vl.prompt_lens[3 + i] == vl.prompt_lens[6 + i] == len(prompt_ids[i])
