"""/tokenize and /detokenize in vLLM's and llama.cpp's shapes: text and chat messages, special tokens
by each server's default, llama.cpp's pieces, round trips, agreement with what the generation
endpoints count, and every bad request a 400 (or 404/405) that names what is wrong."""

import pytest

from conftest import SMOLLM2, TINY
from test_http_errors import assert_error

TEXT = "Hello world! Tokenizers split text like this: naïve café, 1234, \u4e16\u754c."


def tokenize(srv, **body):
    r = srv.post("/tokenize", body)
    assert r.status == 200, r
    return r.json()


def detokenize(srv, tokens, **body):
    r = srv.post("/detokenize", dict(body, tokens=tokens))
    assert r.status == 200, r
    return r.json()


def test_text_round_trip_in_both_shapes(smollm2_server):
    srv = smollm2_server
    vllm = tokenize(srv, model=SMOLLM2, prompt=TEXT)
    assert vllm["count"] == len(vllm["tokens"]) > 5
    assert vllm["max_model_len"] == 1024
    assert all(isinstance(t, int) for t in vllm["tokens"])
    llama = tokenize(srv, content=TEXT)
    # SmolLM2's tokenizer adds no BOS, so both defaults give the same ids.
    assert llama["tokens"] == vllm["tokens"]
    back = detokenize(srv, vllm["tokens"])
    assert back["prompt"] == TEXT and back["content"] == TEXT


def test_pieces_concatenate_to_the_text(smollm2_server):
    out = tokenize(smollm2_server, content=TEXT, with_pieces=True)
    pieces = out["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)
    text = b""
    for p in pieces:
        # A piece is its text, or its bytes where they are not valid UTF-8 on their own.
        text += p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
    assert text.decode() == TEXT
    assert [p["id"] for p in pieces] == tokenize(smollm2_server, content=TEXT)["tokens"]


def test_chat_messages_count_as_the_chat_endpoint_does(smollm2_server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    out = tokenize(smollm2_server, messages=messages)
    text = detokenize(smollm2_server, out["tokens"])["prompt"]
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.")
    assert text.endswith("<|im_start|>assistant\n"), text
    r = smollm2_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0})
    assert r.status == 200, r
    assert r.json()["usage"]["prompt_tokens"] == out["count"]


def test_special_tokens_by_each_servers_default(server):
    # tiny-random's tokenizer adds a BOS: vLLM's prompt gets it by default, llama.cpp's content not.
    with_bos = tokenize(server, prompt="abc")["tokens"]
    without = tokenize(server, content="abc")["tokens"]
    assert with_bos[1:] == without and len(with_bos) == len(without) + 1
    assert tokenize(server, prompt="abc", add_special_tokens=False)["tokens"] == without
    assert tokenize(server, content="abc", add_special=True)["tokens"] == with_bos
    # The chat endpoint's prompt: the template has its own markers, no extra BOS by default.
    chat = tokenize(server, messages=[{"role": "user", "content": "abc"}])["tokens"]
    assert chat[0] != with_bos[0], chat
    assert tokenize(server, messages=[{"role": "user", "content": "abc"}], add_special_tokens=True)["tokens"] == \
        [with_bos[0]] + chat
    assert detokenize(server, [])["prompt"] == ""


@pytest.mark.parametrize("body, message", [
    ({}, "'prompt' (or 'content')"),
    ({"prompt": "a", "content": "b"}, "one of 'prompt' and 'content'"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "or chat 'messages'"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"prompt": "a", "tools": []}, "go with chat 'messages'"),
    ({"messages": []}, "must not be empty"),
    ({"prompt": "a", "temperature": 0}, "Unrecognized request argument supplied: temperature"),
])
def test_bad_tokenize_400(server, body, message):
    assert_error(server.post("/tokenize", body), 400, message_contains=message)


@pytest.mark.parametrize("body, message", [
    ({}, "'tokens' is required"),
    ({"tokens": "1 2"}, "tokens"),
    ({"tokens": [1, 2.5]}, "tokens"),
    ({"tokens": [1, 10 ** 12]}, "out of range"),
    ({"tokens": [1, -3]}, "tokens[1] = -3 is not a token id"),
    ({"tokens": [1, 999999]}, "tokens[1] = 999999 is not a token id"),
])
def test_bad_detokenize_400(server, body, message):
    assert_error(server.post("/detokenize", body), 400, message_contains=message)


def test_wrong_model_and_method(server):
    assert_error(server.post("/tokenize", {"model": "nope", "prompt": "a"}), 404, code="model_not_found")
    assert_error(server.post("/detokenize", {"model": "nope", "tokens": [1]}), 404, code="model_not_found")
    r = server.get("/tokenize")
    assert r.status == 405 and r.headers.get("allow") == "POST", r
    # The server still serves after them.
    assert tokenize(server, model=TINY, prompt="still here")["count"] > 0
