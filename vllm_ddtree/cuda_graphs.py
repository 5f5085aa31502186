"""CUDA-graph replay of our per-step tensor work (tree build, tree walk), captured lazily per padded row count.

The tree build is ~100 small kernels and the walk ~30: launched eagerly they cost 2.8 ms and 0.7 ms per step on an
H200 at batch 1, replayed from a graph 0.4 ms and 0.08 ms (benchmarks/bench_tree_core.py, 2026-11-29). vLLM's own
graphs cover the model forward only, so these run outside them; ``GraphedStep`` gives them their own.

The captured function must read and write only tensors at fixed addresses (the caller copies dynamic inputs into
static buffers first) and must handle ``rows`` rows, where rows past the live batch hold stale but valid data whose
results nobody reads. Buckets are powers of two up to ``max_rows``; larger batches run eagerly (there the launch
cost is amortised: build 3.2 ms eager vs 3.3 ms replayed at 64 rows). On CPU, while another graph is being
captured (vLLM's capture runs), or when the engine runs eagerly (``enforce_eager``), the function simply runs
eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from vllm_ddtree import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


def graphs_enabled(vllm_config, device: torch.device) -> bool:
    """DDTree's own graphs follow the engine's: on CUDA unless ``enforce_eager``."""
    return device.type == "cuda" and not vllm_config.model_config.enforce_eager


def row_bucket(rows: int) -> int:
    """The padded row count a graph is captured for: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def largest_bucket(max_reqs: int, cap: int = 8) -> int:
    """The largest bucket that fits buffers of ``max_reqs`` rows, at most ``cap`` (beyond it eager is as fast)."""
    return 1 << (min(max_reqs, cap).bit_length() - 1)


class GraphedStep:
    """Calls ``fn(rows)`` through a CUDA graph captured for ``row_bucket(rows)`` on first use."""

    def __init__(self, fn: Callable[[int], None], max_rows: int, device: torch.device, idempotent: bool = True,
                 enabled: bool = True):
        """``idempotent=False`` for a function that updates its buffers in place (running it twice is not running
        it once): the call that captures a bucket then keeps the warm-up run's result instead of replaying.
        ``enabled``: ``graphs_enabled(vllm_config, device)``; off CUDA the function always runs eagerly."""
        self.fn = fn
        self.idempotent = idempotent
        self.max_rows = max_rows
        self.enabled = enabled and device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # one memory pool for all buckets: they never run concurrently

    def replays(self, rows: int) -> bool:
        """Whether a call for ``rows`` goes through a graph (callers fill the static inputs only then)."""
        return self.enabled and row_bucket(rows) <= self.max_rows and not torch.cuda.is_current_stream_capturing()

    def __call__(self, rows: int) -> None:
        if not self.replays(rows):
            self.fn(rows)
            return
        bucket = row_bucket(rows)
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self._capture(bucket)
            if not self.idempotent:
                return  # the warm-up run before the capture made this call's update
        graph.replay()

    def _capture(self, rows: int) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream first (PyTorch's capture recipe): it fills every lazily built constant (build
        # plans, bit tables) and computes this step's result; the capture itself executes nothing, the replay
        # that follows recomputes the same result.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.fn(rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.fn(rows)
        self.pool = graph.pool()
        self.graphs[rows] = graph
        return graph


def capture_size_covering(tokens: int) -> int:
    """The smallest size on vLLM's default capture grid (1, 2, 4, then steps of 8 below 256 and of 16 from 256) that
    holds ``tokens``. A ``max_cudagraph_capture_size`` off that grid is truncated to the grid point below it (vLLM
    0.26.0 ``VllmConfig._set_cudagraph_sizes``): 520 becomes 512, and a 520-token verify step then runs eagerly."""
    if tokens <= 4:
        return next(size for size in (1, 2, 4) if size >= tokens)
    step = 8 if tokens < 256 else 16
    return -(-tokens // step) * step


def warn_if_trees_outgrow_graphs(vllm_config, budget: int) -> None:
    """vLLM captures graphs up to 512 tokens by default; a verify step of more requests x (1 + B) tokens runs
    without them (measured on an H200: B=64 at batch 8, 520 tokens, ran 2.7x slower than at B=16)."""
    compilation = vllm_config.compilation_config
    sizes = compilation.cudagraph_capture_sizes or []
    if vllm_config.model_config.enforce_eager or not sizes:
        return
    per_request = 1 + budget
    graphed = max(sizes) // per_request
    scheduler = vllm_config.scheduler_config
    max_reqs = scheduler.max_num_seqs
    if graphed < max_reqs:
        logger.warning(
            "ddtree: verify steps of more than %d requests (x %d tokens) exceed the largest CUDA graph (%d tokens) "
            "and run without graphs; raise it with --compilation-config '{\"max_cudagraph_capture_size\": %d}' or "
            "lower the budget",
            graphed, per_request, max(sizes),
            capture_size_covering(min(max_reqs * per_request, scheduler.max_num_batched_tokens)),
        )


def warn_if_budget_schedule_drops_full_graphs(vllm_config, device: torch.device) -> None:
    """On the V1 runner vLLM replaces full CUDA graphs by piecewise ones when a budget schedule is set
    (``VllmConfig._maybe_override_dynamic_sd_cudagraph_mode``), so attention and GatedDeltaNet layers run eagerly.
    Hybrid targets run on V1, and there it costs more than the smaller trees save (H200, Qwen3.6-27B's shape,
    2026-12-04: a batch-1 step of the schedule's B=64 took 56.8 ms against 31.2 with a fixed B=64)."""
    if device.type != "cuda" or vllm_config.model_config.enforce_eager:
        return
    if getattr(vllm_config.speculative_config, "num_speculative_tokens_per_batch_size", None) is None:
        return
    logger.warning(
        "ddtree: num_speculative_tokens_per_batch_size on the V1 runner makes vLLM run piecewise CUDA graphs only "
        "(attention and GatedDeltaNet layers eager), which cost a Qwen3.6-27B-shaped target 1.8x its batch-1 step "
        "with full graphs; the adaptive budget keeps full graphs on Model Runner V2 (dense targets). Here, prefer a "
        "fixed num_speculative_tokens"
    )


DRAFTER_CAPTURE_ONCE_ENV = "VLLM_DDTREE_DRAFTER_CAPTURE_ONCE"


def warn_if_tensor_parallel_graphs(vllm_config, device: torch.device) -> None:
    """Say at start-up that DDTree's GPU graphs under tensor parallelism are unproven, and what to try if start-up
    dies (the one H200 run at TP=2 with vLLM's custom all-reduce died while capturing; see DrafterCaptureOnce)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if device.type != "cuda" or tp == 1 or vllm_config.model_config.enforce_eager:
        return
    logger.warning(
        "ddtree: tensor_parallel_size=%d with CUDA graphs has not yet served on a GPU (the one H200 run, Qwen3-8B "
        "shape at TP=2 on the V1 runner, died in vLLM's CUDA-graph capture with an illegal memory access reported by "
        "the custom all-reduce; Model Runner V2 at TP=2 has not run). On the V1 runner the drafter's repeated "
        "capture-time passes run eagerly (%s=1 by default under tensor parallelism) against the suspected cause; if "
        "start-up still dies, try --disable-custom-all-reduce, or --enforce-eager", tp, DRAFTER_CAPTURE_ONCE_ENV,
    )

class DrafterCaptureOnce:
    """While vLLM's V1 runner captures, run the drafter's dummy pass eagerly when its graph for that size was
    captured earlier in the same pass. On by default under tensor parallelism; VLLM_DDTREE_DRAFTER_CAPTURE_ONCE=0
    or 1 overrides.

    DFlash caps its dummy pass at ``max_query_tokens``, so every target size above that runs the drafter at the
    same size, and the second such run replays the graph captured moments before, still inside vLLM's capture
    context. A custom all-reduce captured in that context reads its peers' addresses from a slot that vLLM fills
    only when the context ends (``register_graph_buffers``), so its replay reads an unfilled slot: the suspect in
    the TP=2 start-up crash of 2026-11-30 ("custom_all_reduce.cuh:455 an illegal memory access", in the CUDA-graph
    memory profile, max_num_seqs 8; not confirmed on a GPU since). Eagerly inside the capture context the
    all-reduce launches nothing, and the graph captured once is all the drafter uses later, so the guard costs
    nothing at run time."""

    def __init__(self, tensor_parallel_size: int = 1):
        override = os.environ.get(DRAFTER_CAPTURE_ONCE_ENV)
        self.enabled = tensor_parallel_size > 1 if override is None else override == "1"
        self._captured: set = set()
        self._last_tokens = -1

    def use_graphs(self, key, num_tokens: int) -> bool:
        """Whether the capture-time dummy pass for target size ``num_tokens`` (drafter graph ``key``) may use
        graphs. vLLM captures sizes in descending order, once to profile memory and once for real: a size no
        smaller than the last one starts a new pass."""
        if num_tokens >= self._last_tokens:
            self._captured.clear()
        self._last_tokens = num_tokens
        if key in self._captured:
            return False
        self._captured.add(key)
        return True
