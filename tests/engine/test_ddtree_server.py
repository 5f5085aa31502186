"""`vllm serve` with ddtree on loopback: OpenAI completions and chat, plain and streaming, answer correctly."""

from __future__ import annotations

import urllib.error

import pytest

from ddtree_testkit.loopback_server import http_error, post, serve


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_llama_dflash_dir):
    spec = {"method": "ddtree", "model": str(tiny_llama_dflash_dir), "num_speculative_tokens": 8}
    args = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "1024"]
    with serve(tiny_llama_dir, spec=spec, args=args) as srv:
        yield srv.base


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


@pytest.mark.parametrize(
    "endpoint, setting, message",
    [
        ("completions", {"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported with ddtree"),
        ("completions", {"repetition_penalty": 1.2}, "repetition_penalty=1.2 is not supported with ddtree"),
        ("completions", {"min_tokens": 2}, "min_tokens=2 is not supported with ddtree"),
        ("completions", {"bad_words": ["the"]}, "bad_words is not supported with ddtree"),
        ("completions", {"structured_outputs": {"choice": ["yes", "no"]}}, "structured outputs are not supported"),
        ("completions", {"response_format": {"type": "json_object"}}, "structured outputs are not supported"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
         "structured outputs are not supported"),
    ],
)
def test_each_unsupported_setting_is_a_400_naming_it(server, tiny_llama_dir, endpoint, setting, message):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if endpoint.startswith("chat") else {"prompt": "Hi"}
    code, text = http_error(f"{server}/v1/{endpoint}", {"model": str(tiny_llama_dir), **prompt, "max_tokens": 4,
                                                        **setting})
    assert code == 400 and message in text
    assert post(server + "/v1/completions", {"model": str(tiny_llama_dir), "prompt": "Hi", "max_tokens": 2})


def test_supported_request_settings_work(server, tiny_llama_dir, prompt_ids, reference):
    """n > 1, best_of, logprobs, prompt logprobs and allowed_token_ids pass the ddtree checks and answer correctly."""
    base = {"model": str(tiny_llama_dir), "prompt": prompt_ids[0], "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True}
    sampled = post(server + "/v1/completions", {**base, "n": 2, "best_of": 2, "temperature": 0.8, "seed": 1})
    assert len(sampled["choices"]) == 2 and all(len(c["token_ids"]) == 8 for c in sampled["choices"])
    greedy = post(server + "/v1/completions", {**base, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1})
    choice = greedy["choices"][0]
    assert choice["token_ids"] == reference[0][:8]
    assert len(choice["logprobs"]["top_logprobs"]) == 8 and all(len(t) >= 2 for t in choice["logprobs"]["top_logprobs"])
    assert len(choice["prompt_logprobs"]) == len(prompt_ids[0])
    allowed = [reference[0][0], 100, 200]
    masked = post(server + "/v1/completions", {**base, "temperature": 0, "allowed_token_ids": allowed})
    assert set(masked["choices"][0]["token_ids"]) <= set(allowed)
