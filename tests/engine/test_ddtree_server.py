"""`vllm serve` with ddtree on loopback: OpenAI completions and chat, plain and streaming, answer correctly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, stream: bool = False):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=300)
    if not stream:
        return json.loads(response.read())
    events = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_llama_dflash_dir):
    port = free_port()
    spec = {"method": "ddtree", "model": str(tiny_llama_dflash_dir), "num_speculative_tokens": 8}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "1024", "--enforce-eager",
        "--speculative-config", json.dumps(spec),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 420
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited ({proc.returncode}):\n{proc.stdout.read()[-6000:]}")
            try:
                if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise AssertionError("server did not become healthy in time")
            time.sleep(2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_completions_greedy_equal_no_spec(server, tiny_llama_dir, prompt_ids, reference):
    for ids, expected in zip(prompt_ids[:3], reference):
        body = {"model": str(tiny_llama_dir), "prompt": ids, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        choice = post(server + "/v1/completions", body)["choices"][0]
        assert choice["token_ids"] == expected[:16]


def test_streaming_completion_equals_plain(server, tiny_llama_dir, prompt_ids):
    body = {"model": str(tiny_llama_dir), "prompt": prompt_ids[0], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    plain = post(server + "/v1/completions", body)["choices"][0]["text"]
    events = post(server + "/v1/completions", {**body, "stream": True}, stream=True)
    assert len(events) > 1
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == plain


def test_chat_plain_and_streaming(server, tiny_llama_dir):
    body = {"model": str(tiny_llama_dir), "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 12,
            "temperature": 0}
    plain = post(server + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    events = post(server + "/v1/chat/completions", {**body, "stream": True}, stream=True)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert plain and streamed == plain


def test_unsupported_request_gets_a_400_and_the_server_keeps_serving(server, tiny_llama_dir, prompt_ids):
    body = {"model": str(tiny_llama_dir), "prompt": prompt_ids[0], "max_tokens": 4, "presence_penalty": 0.5}
    with pytest.raises(urllib.error.HTTPError) as err:
        post(server + "/v1/completions", body)
    assert err.value.code == 400 and b"presence_penalty" in err.value.read()
    ok = post(server + "/v1/completions", {**body, "presence_penalty": 0.0})
    assert ok["choices"][0]["text"] is not None
