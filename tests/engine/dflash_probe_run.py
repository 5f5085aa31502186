"""engine_run.py's engine with vLLM's own DFlash drafter logits recorded (for tests/engine/test_train_dflash_engine.py).

    python tests/engine/dflash_probe_run.py \
        '{"probe_out": "/tmp/x.pt", "model": ..., "spec": {"method": "dflash", ...}}'

Wraps ``DFlashProposer._sample_draft_tokens`` (the method that turns the drafter's hidden states into draft tokens)
and records, for every request of every draft pass: the prompt, the root position and token, and a compact view
of the ``[K, V]`` draft logits (top-16 ids and values, logsumexp, and the values at fixed probe ids). The records are
saved to ``probe_out``; the engine result is printed exactly as engine_run.py prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ddtree_testkit import engine_run  # noqa: E402  (sets the engine environment defaults)

PROBE_IDS_SEED = 1234
NUM_PROBE_IDS = 64
TOPK = 16


def run_probe(**args) -> dict:
    """Run this script in a fresh process; return the engine result with the records under ``"probe"``."""
    import torch

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, json.dumps(args)], capture_output=True, text=True, timeout=900,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"probe engine run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    out = json.loads(lines[-1][len("ENGINE_RESULT "):])
    out["probe"] = torch.load(args["probe_out"], weights_only=False)
    return out


def install_probe(records: list) -> None:
    import torch
    from vllm.v1.spec_decode.dflash import DFlashProposer

    orig_init = DFlashProposer.__init__
    orig_sample = DFlashProposer._sample_draft_tokens

    def init(self, vllm_config, device, runner=None):
        orig_init(self, vllm_config, device, runner)
        self._probe_runner = runner

    def sample(self, hidden_states, sampling_metadata):
        logits = self.model.compute_logits(hidden_states).float().cpu()
        k = self.num_speculative_tokens
        num_reqs = logits.shape[0] // k
        logits = logits.view(num_reqs, k, -1)
        query = (1 + k) * num_reqs
        positions = self.positions[:query].view(num_reqs, 1 + k).cpu()
        input_ids = self.input_ids[:query].view(num_reqs, 1 + k).cpu()
        probe_ids = torch.randperm(logits.shape[-1], generator=torch.Generator().manual_seed(PROBE_IDS_SEED))
        probe_ids = probe_ids[:NUM_PROBE_IDS]
        runner = self._probe_runner
        for r, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            top = logits[r].topk(TOPK, dim=-1)
            records.append({
                "prompt": list(runner.requests[req_id].prompt_token_ids),
                "positions": positions[r].tolist(),
                "input_ids": input_ids[r].tolist(),
                "top_ids": top.indices,
                "top_vals": top.values,
                "lse": logits[r].logsumexp(-1),
                "probe_ids": probe_ids,
                "probe_vals": logits[r][:, probe_ids],
            })
        return orig_sample(self, hidden_states, sampling_metadata)

    DFlashProposer.__init__ = init
    DFlashProposer._sample_draft_tokens = sample


def main() -> None:
    import torch

    args = json.loads(sys.argv[1])
    records: list = []
    install_probe(records)
    engine_run.main()
    torch.save(records, args["probe_out"])


if __name__ == "__main__":
    main()
