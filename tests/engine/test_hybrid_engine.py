"""DDTree on hybrid (GatedDeltaNet) targets in the real engine: teacher-forced losslessness, M-RoPE depth positions,
refused configurations.

The target is the tiny random ``Qwen3_5ForConditionalGeneration`` (how vLLM serves Qwen3.5/3.6 dense models: GDN
layers with attention every fourth layer, dense MLPs, interleaved M-RoPE, a vision tower in the checkpoint that these
text-only runs leave unbuilt: ``limit_mm_per_prompt`` 0); the
refusal runs on the tiny Qwen3-Next (see ``HYBRIDS`` for why it is not checked on logits). vLLM runs GDN layers in
bfloat16 only (CPU; on GPU its FLA prefill refuses float32), where no speculative method follows no-spec token for
token, so losslessness is checked on logits, teacher-forced (lossless_check.py): every tree node's logits equal
those of its context and root path fed plainly to the target, within a tolerance measured on vLLM's own DFlash
chain. Greedy agreement with no-spec is printed, not asserted. On GPU the same tests run in bf16 with CUDA graphs
(tools/gpu_session.sh phase ``hybrid``).
"""

from __future__ import annotations

from dataclasses import dataclass

import lossless_check as lc
import pytest
import torch

from ddtree_testkit import qwen3_5_models
from ddtree_testkit.engine_run import run_engine
from ddtree_testkit.random_dflash import random_dflash_dir

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14], [20, 21]]
# Fewer sequences at once than prompts: the last prompt prefills in a step where others verify trees.
MAX_NUM_SEQS = 3
MAX_TOKENS = 24
BUDGET = 8
ORACLE_SEED = 1
TEACHER_SEED = 2
CONCURRENT_GPU_ENV = {"VLLM_DISABLE_COMPILE_CACHE": "1"} if torch.cuda.is_available() else {}


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(smollm2_dir):
    return qwen3_5_models.tiny_qwen3_5_dir()


@pytest.fixture(scope="session")
def tiny_qwen3_5_dflash_dir(tiny_qwen3_5_dir):
    return random_dflash_dir(tiny_qwen3_5_dir, block_size=8)


# Targets of the teacher-forced check. Not the tiny Qwen3-Next: its MoE router flips experts on bf16 noise, so vLLM's
# own chain leaves the references by half of what one token of context moves them (worst 4.3 against 8.1), too
# loose to tell a wrong state (the check's own guard refuses it). Its GDN layers run the same hooks as Qwen3.5's.
HYBRIDS = {"qwen3_5": ("tiny_qwen3_5_dir", "tiny_qwen3_5_dflash_dir")}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
    """(name, target, drafter)."""
    target, drafter = HYBRIDS[request.param]
    return request.param, request.getfixturevalue(target), request.getfixturevalue(drafter)


def ddtree_spec(drafter) -> dict:
    return {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}


@dataclass
class LosslessRuns:
    """The runs of lossless_check's recipe for one target (see there)."""

    args: dict
    teacher: dict[lc.Tokens, list[int]]
    oracle: dict
    drafter: object
    tree_result: dict
    tree: lc.Recording
    chain: lc.Recording
    reference: dict[lc.Tokens, torch.Tensor]

    @property
    def tolerance(self) -> float:
        return lc.TOLERANCE_FACTOR * self.report(self.chain).worst

    def report(self, recording: lc.Recording) -> lc.DeviationReport:
        return lc.deviation_report(recording, recording.path_keys(self.teacher), self.reference)

    def faulty_trees(self, faults: list[str]) -> dict[str, lc.Recording]:
        """The DDTree run with each fault injected (side by side on a GPU, as the main runs)."""
        envs = [{}] + [CONCURRENT_GPU_ENV] * (len(faults) - 1)  # one compile-cache writer
        runs = lc.concurrently(*[
            lambda fault=fault, env=env: lc.teacher_run(self.args, self.teacher, spec=ddtree_spec(self.drafter),
                                                        oracle=self.oracle, fault=fault, env=env)
            for fault, env in zip(faults, envs)
        ])
        recordings = dict(zip(faults, (recording for _, recording in runs)))
        missing = {k for r in recordings.values() for k in r.path_keys(self.teacher) if k is not None}
        missing -= self.reference.keys()
        if missing:  # (the trees and contexts are the same as the fault-free run's, so this stays empty)
            self.reference.update(lc.reference_logits(self.args, missing))
        return recordings


@pytest.fixture(scope="module")
def lossless(hybrid) -> LosslessRuns:
    _, target, drafter = hybrid
    args = lc.hybrid_args(target, prompt_token_ids=PROMPTS, max_tokens=MAX_TOKENS, max_num_seqs=MAX_NUM_SEQS)
    teacher = lc.seeded_teacher(PROMPTS, MAX_TOKENS, TEACHER_SEED)
    continuations = [s[len(p):] for p, s in teacher.items()]
    oracle = {"prompt_token_ids": PROMPTS, "continuations": continuations, "seed": ORACLE_SEED}
    chain_spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": BUDGET - 1}
    # Side by side on a GPU, the chain without vLLM's compile cache (two processes would write the same entries).
    (tree_result, tree), (_, chain) = lc.concurrently(
        lambda: lc.teacher_run(args, teacher, spec=ddtree_spec(drafter), oracle=oracle),
        lambda: lc.teacher_run(args, teacher, spec=chain_spec, env=CONCURRENT_GPU_ENV),
    )
    keys = {k for rec in (tree, chain) for k in rec.path_keys(teacher) if k is not None}
    reference = lc.reference_logits(args, keys)
    return LosslessRuns(args, teacher, oracle, drafter, tree_result, tree, chain, reference)


def mixed_steps(recording: lc.Recording) -> int:
    """Steps that verified trees and sampled a row without one (a prefill's last row) together. On a GPU such a step
    is where vLLM's GDN metadata skips its full-CUDA-graph buffers (the tree conv once rolled a truncated slot
    there: the replay layout's block table then gives max_query_len 1)."""
    kinds: dict[int, set[bool]] = {}
    for step, in_tree in zip(recording.rows["step"], recording.rows["tree"]):
        kinds.setdefault(step, set()).add(bool(in_tree))
    return sum(kind == {True, False} for kind in kinds.values())


def branch_acceptances(runs: LosslessRuns) -> int:
    """Accepted tree nodes (on the teacher path) whose parent is not the node before them: where a chain's state
    would be the wrong one, and where the relayout has to move the path."""
    tree, count = runs.tree, 0
    for i, key in enumerate(tree.path_keys(runs.teacher)):
        sequence = runs.teacher[tree.prompts[tree.rows["prompt"][i]]]
        on_path = key is not None and tuple(sequence[: len(key)]) == key
        count += on_path and tree.rows["tree"][i] and tree.rows["parent"][i] not in (-1, tree.rows["row"][i] - 1)
    return count


def test_ddtree_on_a_hybrid_target_is_lossless_teacher_forced(hybrid, lossless):
    """Every verified tree node's logits are its context's and root path's, as closely as vLLM's own chain verify
    gets to the same reference (bf16 noise), on both targets. Greedy agreement is reported, not asserted."""
    name = hybrid[0]
    assert lossless.tree_result["token_ids"] == [s[len(p):] for p, s in lossless.teacher.items()], "teacher forcing"
    per_depth = lossless.tree_result["spec_decode"]["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_depth[1] > 0, "the oracle drafter should get paths of two nodes or more accepted"
    assert branch_acceptances(lossless) > 0, "no accepted node off the pop-order chain: parents and relayout untested"
    assert mixed_steps(lossless.tree) > 0, "no prefill batched with tree verification (MAX_NUM_SEQS < prompts)"
    tree, chain = lossless.report(lossless.tree), lossless.report(lossless.chain)
    hits, total = lc.greedy_agreement(lossless.tree, lossless.tree.path_keys(lossless.teacher), lossless.reference)
    chain_hits, chain_total = lc.greedy_agreement(lossless.chain, lossless.chain.path_keys(lossless.teacher),
                                                  lossless.reference)
    print(f"\n[{name}] tree rows {len(tree.rows)}: worst deviation {tree.worst:.4f}; chain rows {len(chain.rows)}: "
          f"worst {chain.worst:.4f}; tolerance {lossless.tolerance:.4f}; one token of context moves logits by "
          f"{tree.separation:.3f} (median); greedy agreement with no-spec at the same contexts: DDTree "
          f"{hits}/{total}, chain {chain_hits}/{chain_total}; accepted branch nodes {branch_acceptances(lossless)}; "
          f"steps with a prefill beside trees {mixed_steps(lossless.tree)}")
    assert lossless.tolerance < tree.separation / 2, "bf16 noise too large to tell a wrong state from a right one"
    worst_rows = sorted(zip(tree.deviations.tolist(), tree.rows), reverse=True)[:5]
    assert tree.worst <= lossless.tolerance, f"tree rows off their reference (deviation, row): {worst_rows}"


FAULTS = ["chain_parents", "no_relayout"]


@pytest.fixture(scope="module")
def faulty(lossless) -> dict[str, lc.Recording]:
    return lossless.faulty_trees(FAULTS)


@pytest.mark.parametrize("fault", FAULTS)
def test_the_lossless_check_fails_on_a_wrong_parent_state_or_a_missing_relayout(lossless, faulty, fault):
    """The check above is not vacuous: with the GDN layers continuing each node from the node before it (vLLM's
    chain parents), or the accepted path left where the tree put it, most tree rows leave their reference by far
    more than the tolerance."""
    report = lossless.report(faulty[fault])
    flagged = int((report.deviations > lossless.tolerance).sum())
    print(f"\n[{fault}] {flagged}/{len(report.rows)} tree rows beyond the tolerance {lossless.tolerance:.4f}, "
          f"worst {report.worst:.3f}")
    assert flagged > len(report.rows) // 2


def test_tree_rows_carry_depth_positions_on_all_three_mrope_rows(lossless):
    """Qwen3.5 text prompts run with M-RoPE (three equal position rows): every tree row's three rows are its root's
    position plus its depth (verify_rows.prepare_rows shifts all three)."""
    tree = lossless.tree
    depths = tree.depths()
    mismatches = []
    for i in range(len(tree)):
        root_position = tree.rows["position"][i - tree.rows["row"][i]]
        expected = [root_position + depths[i]] * 3
        if tree.rows["mrope"][i] != expected:
            mismatches.append((i, tree.rows["mrope"][i], expected))
    assert sum(tree.rows["tree"]) > 0 and max(depths) >= 2
    assert mismatches == []


def test_ddtree_on_a_hybrid_target_refuses_recurrent_prefix_caching(tiny_hybrid_dir, tiny_hybrid_dflash_dir):
    with pytest.raises(AssertionError, match="--no-enable-prefix-caching"):
        run_engine(model=str(tiny_hybrid_dir), prompt_token_ids=[[1, 2, 3]], max_tokens=2, dtype="bfloat16",
                   mamba_ssm_cache_dtype="float32", enable_prefix_caching=True,
                   spec=ddtree_spec(tiny_hybrid_dflash_dir))
