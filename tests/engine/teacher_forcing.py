"""Teacher forcing and logits recording inside an engine process (the hybrid lossless test, test_hybrid_engine.py).

Installed before vLLM starts by teacher_site/sitecustomize.py when ``$VLLM_DDTREE_TEST_TEACHER`` names a JSON file:
``{"teacher": [[prompt, continuation], ...], "record": path, "vocab_subset": n, "reference": bool, "fault": ...}``.

Forcing: every logits row the runner samples from (``GPUModelRunner._sample``: no-spec's sampler, the chain's
rejection sampler and DDTree's tree walk alike) has its teacher token raised far above the rest. A row whose input
token sits at position p of a request with teacher sequence s (prompt + continuation) predicts s[p + 1]. DDTree has
already rewritten tree rows to depth positions, so a node's row is forced to the teacher token after its depth:
the walk, which only moves to a child whose token the row above chose, accepts exactly the longest teacher prefix in
the tree. Which tokens are committed and which nodes are accepted then depends on the teacher and the trees (the
oracle drafter's, seeded) only, never on the model's own argmax, so bf16 near-ties cannot change the run.

Recording, per sampled row and before forcing: the request's prompt, the row's position (M-RoPE: all three rows),
input token, index among the request's rows (0: the root, or the one row of a no-spec step), parent row (tree rows:
the tree's; otherwise the row before), the full-vocabulary argmax and the logits on a fixed vocabulary subset. The
recording is written (torch.save) when the process exits. With ``"reference"``, every prompt token's logits are
recorded too, keyed by the prompt prefix they end: one plain prefill of a sequence gives the reference of each of
its prefixes.

Faults, to show the lossless test catching them (``"fault"``): ``"chain_parents"`` (the GDN layers continue each
spec token from the one before it, as vLLM's chain does), ``"no_relayout"`` (the accepted path stays where the
tree put it).
"""

from __future__ import annotations

import atexit
import json

import numpy as np
import torch

TEACHER_ENV = "VLLM_DDTREE_TEST_TEACHER"
FORCE_MARGIN = 1.0e4  # above any logit of the tiny targets, by far


def vocab_subset(vocab_size: int, size: int) -> torch.Tensor:
    """The fixed vocabulary columns recorded (the same for every run of a test: seeded, sorted)."""
    gen = torch.Generator().manual_seed(20)
    return torch.randperm(vocab_size, generator=gen)[: min(size, vocab_size)].sort().values


class Recorder:
    """Rows seen by ``GPUModelRunner._sample``, forced to the teacher; see the module docstring."""

    def __init__(self, teacher: dict[tuple[int, ...], list[int]], subset_size: int):
        self.teacher = teacher  # prompt -> prompt + continuation
        self.subset_size = subset_size
        self.subset: torch.Tensor | None = None
        self.rows: dict[str, list] = {k: [] for k in ("prompt", "position", "mrope", "token", "row", "parent",
                                                      "tree", "step", "argmax")}
        self.logits: list[torch.Tensor] = []
        self.prompts: list[tuple[int, ...]] = []
        self._prompt_ids: dict[tuple[int, ...], int] = {}
        self.steps = 0
        self.reference: dict[tuple[int, ...], torch.Tensor] = {}

    def prompt_id(self, prompt: tuple[int, ...]) -> int:
        if prompt not in self._prompt_ids:
            self._prompt_ids[prompt] = len(self.prompts)
            self.prompts.append(prompt)
        return self._prompt_ids[prompt]

    def sample(self, runner, logits: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Record the step's rows and return the logits with every row forced to its teacher token."""
        num_reqs = runner.input_batch.num_reqs
        idx = logits_indices.to("cpu", torch.int64).numpy()
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        request = np.searchsorted(qsl[1:], idx, side="right")
        first = np.r_[True, request[1:] != request[:-1]]
        row = np.arange(len(idx)) - np.maximum.accumulate(np.where(first, np.arange(len(idx)), 0))
        rows_t = torch.from_numpy(idx).to(logits.device)
        positions = runner.positions[rows_t].to("cpu", torch.int64)
        mrope = runner.mrope_positions.gpu[:, rows_t].to("cpu", torch.int64) if runner.uses_mrope else None
        tokens = runner.input_ids.gpu[rows_t].to("cpu", torch.int64)
        core = getattr(runner.drafter, "core", None) if runner.speculative_config is not None else None
        step = core.step if core is not None else None  # the verify step in flight (ddtree), None for the chain
        tree_parents = core.verify_trees.parents[:num_reqs].to("cpu", torch.int64) if step is not None else None
        has_tree = step.prepared.has_tree.tolist() if step is not None else None

        if self.subset is None:
            self.subset = vocab_subset(logits.shape[-1], self.subset_size)
        self.logits.append(logits[:, self.subset.to(logits.device)].to("cpu", torch.float32))
        forced_rows, forced_tokens = [], []
        for i in range(len(idx)):
            r = int(request[i])
            prompt = tuple(runner.requests[runner.input_batch.req_ids[r]].prompt_token_ids)
            in_tree = step is not None and bool(has_tree[r])
            pos = int(mrope[0, i] if mrope is not None else positions[i])
            self.rows["prompt"].append(self.prompt_id(prompt))
            self.rows["position"].append(int(positions[i]))
            self.rows["mrope"].append(mrope[:, i].tolist() if mrope is not None else None)
            self.rows["token"].append(int(tokens[i]))
            self.rows["row"].append(int(row[i]))
            self.rows["parent"].append(int(tree_parents[r, row[i]]) if in_tree else int(row[i]) - 1)
            self.rows["tree"].append(in_tree)
            self.rows["step"].append(self.steps)
            sequence = self.teacher.get(prompt)
            if sequence is not None and pos + 1 < len(sequence):
                forced_rows.append(i)
                forced_tokens.append(sequence[pos + 1])
        self.rows["argmax"] += logits.argmax(dim=-1).tolist()
        self.steps += 1
        if not forced_rows:
            return logits
        forced = logits.clone()
        rows_f = torch.tensor(forced_rows, device=logits.device)
        forced[rows_f, torch.tensor(forced_tokens, device=logits.device)] = FORCE_MARGIN
        return forced

    def forward(self, runner, hidden_states: torch.Tensor) -> None:
        """Reference mode: the logits of every prompt token of this forward, by the prompt prefix it ends."""
        num_reqs = runner.input_batch.num_reqs
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        positions = runner.positions[: qsl[-1]].to("cpu", torch.int64).tolist()
        for r in range(num_reqs):
            prompt = tuple(runner.requests[runner.input_batch.req_ids[r]].prompt_token_ids)
            rows = [t for t in range(qsl[r], qsl[r + 1]) if positions[t] < len(prompt)]
            if not rows:
                continue
            logits = runner.model.compute_logits(hidden_states[rows[0] : rows[-1] + 1])
            if self.subset is None:
                self.subset = vocab_subset(logits.shape[-1], self.subset_size)
            logits = logits[:, self.subset.to(logits.device)].to("cpu", torch.float32)
            for i, t in enumerate(rows):
                self.reference[prompt[: positions[t] + 1]] = logits[i]

    def save(self, path: str) -> None:
        torch.save({"rows": self.rows, "prompts": self.prompts, "subset": self.subset,
                    "logits": torch.cat(self.logits) if self.logits else torch.empty(0),
                    "reference": self.reference}, path)


def install(config: dict) -> Recorder:
    """Wrap the runner's input preparation (to learn each step's logits rows) and its sampling step."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    teacher = {tuple(prompt): list(prompt) + list(continuation) for prompt, continuation in config["teacher"]}
    recorder = Recorder(teacher, config.get("vocab_subset", 2048))
    prepare_inputs, sample = GPUModelRunner._prepare_inputs, GPUModelRunner._sample

    def _prepare_inputs(self, *args, **kwargs):
        out = prepare_inputs(self, *args, **kwargs)
        self._teacher_logits_indices = out[0]
        return out

    def _sample(self, logits, spec_decode_metadata):
        if logits is not None:
            logits = recorder.sample(self, logits, self._teacher_logits_indices)
        return sample(self, logits, spec_decode_metadata)

    GPUModelRunner._prepare_inputs, GPUModelRunner._sample = _prepare_inputs, _sample
    if config.get("reference"):
        model_forward = GPUModelRunner._model_forward

        def _model_forward(self, *args, **kwargs):
            out = model_forward(self, *args, **kwargs)
            recorder.forward(self, out)
            return out

        GPUModelRunner._model_forward = _model_forward
    atexit.register(recorder.save, config["record"])
    return recorder


def install_fault(fault: str) -> None:
    """Break the hybrid tree path on purpose (see the module docstring)."""
    from vllm_ddtree.hybrid import gdn_hooks, target

    if fault == "chain_parents":
        original = target.spec_token_parents

        def chain_parents(masks, query_start_loc, tree_parents, tree_rows, out):
            return original(masks, query_start_loc, tree_parents, torch.full_like(tree_rows, -1), out)

        target.spec_token_parents = gdn_hooks.spec_token_parents = chain_parents
    elif fault == "no_relayout":
        target.HybridTreeTarget.relayout = lambda self, *args, **kwargs: None
    else:
        raise ValueError(f"unknown fault {fault!r}")


def install_from_file(path: str) -> None:
    """What teacher_site/sitecustomize.py runs: the fault (if any), then the teacher."""
    with open(path) as f:
        config = json.load(f)
    if config.get("fault"):
        install_fault(config["fault"])
    install(config)
