"""`vllm serve` on 127.0.0.1 for engine tests and benchmarks: start one, wait until healthy, post, scrape /metrics.

Shared by tests/engine/test_*.py and benchmarks/{quality_regression,load_test}.py, so every server run starts the
same way. The server's log goes to a file, not a pipe: nobody reads a pipe while a test runs, and a full pipe stalls
the server under load.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, stream: bool = False, timeout: float = 300):
    """POST JSON; return the parsed body, or with ``stream`` the list of SSE ``data:`` events."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=timeout)
    if not stream:
        return json.loads(response.read())
    events = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets} (e.g. ``vllm:num_preemptions_total``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Server:
    base: str  # http://127.0.0.1:PORT
    model: str  # the name requests use (--served-model-name)
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(urllib.request.urlopen(self.base + "/metrics", timeout=30).read().decode())

    def alive(self) -> bool:
        return self.proc.poll() is None


@contextlib.contextmanager
def serve(
    model: str | Path,
    *,
    spec: dict | None = None,
    dtype: str = "float32",
    args: list[str] | tuple[str, ...] = (),
    served_model_name: str | None = None,
    startup_timeout: float = 420,
    env: dict[str, str] | None = None,
    eager: bool | None = None,
) -> Iterator[Server]:
    """Run ``python -m vllm.entrypoints.openai.api_server`` (no metadata shim needed) until the block exits.

    ``args`` are extra CLI flags (e.g. ``--max-model-len``); ``spec`` becomes ``--speculative-config``. ``eager``
    defaults to True on the CPU engine (compiling costs more than the tests run) and False on GPU, where a server
    is measured as users run it, with CUDA graphs."""
    if eager is None:
        import torch

        eager = not torch.cuda.is_available()
    port = free_port()
    name = served_model_name or str(model)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, *(["--enforce-eager"] if eager else []), *args,
    ]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    full_env.pop("TRITON_INTERPRET", None)  # kernel-test setting; must never reach an engine process
    with tempfile.NamedTemporaryFile("w", prefix="vllm-serve-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)
    server = Server(f"http://127.0.0.1:{port}", name, proc, log_path)
    deadline = time.time() + startup_timeout
    keep_log = False
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited ({proc.returncode}):\n{server.log_tail()}")
            try:
                if urllib.request.urlopen(server.base + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise AssertionError(f"server did not become healthy in {startup_timeout} s:\n{server.log_tail()}")
            time.sleep(1)
        yield server
    except BaseException:
        keep_log = True  # the caller's failure may be the server's: leave its log for a look
        print(f"vllm serve log kept at {log_path}", file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not keep_log:
            log_path.unlink(missing_ok=True)


def http_error(url: str, body: dict) -> tuple[int, str]:
    """POST a request expected to fail; return (HTTP status, body text). Raises if it succeeds."""
    try:
        post(url, body)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    raise AssertionError(f"expected an HTTP error for {body}")
