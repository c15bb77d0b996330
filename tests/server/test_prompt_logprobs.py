"""Prompt logprobs on kvflow-server: `echo` with `logprobs` and `max_tokens: 0` on /v1/completions
(OpenAI's legacy API), and vLLM's `prompt_logprobs` field, checked against the engine's own
numbers (generation, the `kvflow perplexity` CLI) and against each other.

tiny-random's tokenizer is one token per byte (ids 0..255) plus specials; a string prompt gets a
BOS (not part of the echoed text), so most tests send token ids to know every prompt token."""

import http.client
import json
import math
import os
import subprocess

import openai
import pytest

from conftest import REPO, OMP_ENV, TINY, iter_sse

IDS = list(b"Score this prompt, token by token.")
TOL = 1e-4


def post(srv, path, **body):
    r = srv.post(path, {"model": TINY, **body})
    assert r.status == 200, r
    return r.json()


def complete(srv, prompt, **kw):
    return post(srv, "/v1/completions", prompt=prompt, **kw)


def stream_chunks(srv, path, body):
    """The JSON chunks of a streamed response (without [DONE], which must end it)."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps({"model": TINY, "stream": True, **body}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        payloads = list(iter_sse(resp))
    finally:
        conn.close()
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]


def actual(entry, token):
    """The logprob of `token` in a vLLM prompt_logprobs entry, which must list it first."""
    assert next(iter(entry)) == str(token), f"the prompt token {token} is not first in {entry}"
    return entry[str(token)]["logprob"]


def alternatives(entry, k):
    """The top-k alternatives of a prompt_logprobs entry: all of it when the prompt token is one
    of them, else all but the prompt token (first)."""
    values = list(entry.values())
    return values if len(values) == max(k, 1) and k > 0 else values[1:]


def check_prompt_logprobs(pl, ids, k):
    """vLLM's shape: null, then per token a dict of the token plus up to k alternatives."""
    assert isinstance(pl, list) and len(pl) == len(ids), (len(pl), len(ids))
    assert pl[0] is None
    for entry, token in zip(pl[1:], ids[1:]):
        assert isinstance(entry, dict)
        assert max(k, 1) <= len(entry) <= k + 1, f"{entry} for k={k}"
        for key, v in entry.items():
            assert key.isdigit(), key
            assert set(v) == {"logprob", "decoded_token"}, v
            assert isinstance(v["decoded_token"], str)
            assert v["logprob"] <= 1e-6 and math.isfinite(v["logprob"])
        lp = actual(entry, token)
        if k > 0:
            top = [a["logprob"] for a in alternatives(entry, k)]
            assert len(top) == k and top == sorted(top, reverse=True), entry
            assert lp <= top[0] + TOL
        if 32 <= token < 127:
            assert entry[str(token)]["decoded_token"] == chr(token)


def check_echo_logprobs(lp, ids, text, k):
    """The prompt's part of an echo + logprobs object: null first, then the prompt tokens."""
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 1e-6 for x in lp["token_logprobs"][1:n])
    for top in lp["top_logprobs"][1:n]:
        assert isinstance(top, dict) and len(top) <= k and (k == 0 or len(top) >= 1), top
        assert all(v <= 1e-6 for v in top.values())
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert all(a <= b for a, b in zip(offsets, offsets[1:])), offsets
    assert all(o <= len(text.encode()) for o in offsets)


# ---------------------------------------------------------------------------------------------
# echo + logprobs


def test_echo_logprobs_cover_prompt_then_completion(server):
    k = 2
    kw = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=k)
    plain = complete(server, IDS, **kw)["choices"][0]
    r = complete(server, IDS, echo=True, **kw)
    c = r["choices"][0]
    prompt = bytes(IDS).decode()
    assert c["text"] == prompt + plain["text"]
    assert c["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(IDS), "completion_tokens": 6, "total_tokens": len(IDS) + 6}
    lp = c["logprobs"]
    n = len(IDS)
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(v) == n + 6 for v in lp.values()), {key: len(v) for key, v in lp.items()}
    check_echo_logprobs(lp, IDS, c["text"], k)
    assert lp["tokens"][:n] == [chr(t) for t in IDS]
    assert lp["text_offset"][:n] == list(range(n)), "one byte per prompt token"
    # The completion's part is what the same request without echo returns, shifted by the prompt.
    want = plain["logprobs"]
    assert lp["tokens"][n:] == want["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(want["token_logprobs"], abs=1e-5)
    for got, top in zip(lp["top_logprobs"][n:], want["top_logprobs"]):
        assert list(got) == list(top)
        assert list(got.values()) == pytest.approx(list(top.values()), abs=1e-5)
    assert lp["text_offset"][n:] == [o + len(prompt.encode()) for o in want["text_offset"]]


def test_echo_logprobs_of_a_string_prompt_start_with_bos(server):
    r = complete(server, "Hi there", echo=True, logprobs=1, max_tokens=2, temperature=0)
    c = r["choices"][0]
    lp = c["logprobs"]
    n = r["usage"]["prompt_tokens"]
    assert n == len("Hi there") + 1
    assert len(lp["tokens"]) == n + r["usage"]["completion_tokens"]
    assert c["text"].startswith("Hi there")
    check_echo_logprobs(lp, [None] * n, c["text"], 1)
    # The BOS is the first token; it is not in the text and takes no room in it.
    assert "".join(lp["tokens"][1:n]) == "Hi there"
    assert lp["text_offset"][:n] == [0] + list(range(n - 1))


def test_echo_logprobs_agree_with_prompt_logprobs(server):
    k = 3
    both = complete(server, IDS, echo=True, logprobs=k, prompt_logprobs=k, max_tokens=1, temperature=0)
    c = both["choices"][0]
    check_prompt_logprobs(c["prompt_logprobs"], IDS, k)
    lp = c["logprobs"]
    for i in range(1, len(IDS)):
        entry = c["prompt_logprobs"][i]
        assert lp["token_logprobs"][i] == pytest.approx(actual(entry, IDS[i]), abs=1e-6)
        # The top k alternatives have the same logprobs (every byte token has its own label).
        assert sorted(lp["top_logprobs"][i].values()) == pytest.approx(
            sorted(v["logprob"] for v in alternatives(entry, k)), abs=1e-6)
    # Each field alone, in its own request, gives the same numbers.
    field_only = complete(server, IDS, prompt_logprobs=k, max_tokens=1, temperature=0)["choices"][0]
    assert "logprobs" in field_only and field_only["logprobs"] is None
    for a, b in zip(field_only["prompt_logprobs"][1:], c["prompt_logprobs"][1:]):
        assert list(a) == list(b)
        assert [v["logprob"] for v in a.values()] == pytest.approx([v["logprob"] for v in b.values()], abs=1e-5)
    echo_only = complete(server, IDS, echo=True, logprobs=k, max_tokens=1, temperature=0)["choices"][0]
    assert "prompt_logprobs" not in echo_only
    assert echo_only["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)


def test_prompt_logprobs_match_generation(server):
    """The alternatives scored for the last prompt token are those generation reports for the
    token after the rest of the prompt (the same logits, once from a prefill, once from a sample)."""
    k = 5
    gen = complete(server, IDS[:-1], max_tokens=1, temperature=0, logprobs=k, ignore_eos=True)["choices"][0]
    scored = complete(server, IDS, max_tokens=0, prompt_logprobs=k)
    assert scored["usage"]["completion_tokens"] == 0
    last = scored["choices"][0]["prompt_logprobs"][-1]
    top = [a["logprob"] for a in alternatives(last, k)]
    assert top == pytest.approx(sorted(gen["logprobs"]["top_logprobs"][0].values(), reverse=True), abs=1e-4)
    assert gen["logprobs"]["token_logprobs"][0] == pytest.approx(top[0], abs=1e-4), "greedy takes the top one"


def test_prompt_logprobs_match_perplexity_cli(server, cli_bin, tmp_path):
    """`kvflow perplexity` scores windows with the engine's prompt logprobs; the server's for the
    same tokens sum to the window's NLL."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs.\n")
    out = tmp_path / "ppl.json"
    cmd = [cli_bin, "perplexity", "--model", TINY, "-f", str(text), "--ctx", "40", "--json", str(out),
           "--dump-tokens"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=120, env={**os.environ, **OMP_ENV})
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    ppl = json.loads(out.read_text())
    window = ppl["tokens"][:40]
    pl = complete(server, window, max_tokens=0, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    check_prompt_logprobs(pl, window, 0)
    nll = -sum(actual(e, t) for e, t in zip(pl[1:], window[1:]))
    assert nll == pytest.approx(ppl["window_nll"][0], rel=1e-4)


def test_echo_logprobs_with_n_and_several_prompts(server):
    prompts = [IDS[:10], IDS[10:25]]
    r = complete(server, prompts, n=2, echo=True, logprobs=1, prompt_logprobs=1, max_tokens=3,
                 temperature=1.0, seed=5, ignore_eos=True)
    assert len(r["choices"]) == 4
    for c in r["choices"]:
        ids = prompts[c["index"] // 2]
        n = len(ids)
        assert c["text"].startswith(bytes(ids).decode())
        assert len(c["logprobs"]["tokens"]) == n + 3
        check_echo_logprobs(c["logprobs"], ids, c["text"], 1)
        check_prompt_logprobs(c["prompt_logprobs"], ids, 1)
        same = r["choices"][c["index"] ^ 1]
        assert c["logprobs"]["token_logprobs"][:n] == same["logprobs"]["token_logprobs"][:n]


# ---------------------------------------------------------------------------------------------
# Streaming


def test_echo_logprobs_stream_equals_non_stream(server):
    body = dict(prompt=IDS, echo=True, logprobs=2, prompt_logprobs=2, max_tokens=5, temperature=0,
                ignore_eos=True)
    full = complete(server, **body)["choices"][0]
    chunks = stream_chunks(server, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    # The echo comes first, with the prompt's logprobs, before any generated text.
    assert first["text"] == bytes(IDS).decode()
    assert first["finish_reason"] is None
    assert first["logprobs"]["tokens"] == full["logprobs"]["tokens"][:len(IDS)]
    assert first["logprobs"]["text_offset"] == full["logprobs"]["text_offset"][:len(IDS)]
    assert first["prompt_logprobs"] == full["prompt_logprobs"]
    assert all("prompt_logprobs" not in ch["choices"][0] for ch in chunks[1:])
    text, tokens, token_logprobs = "", [], []
    for ch in chunks:
        c = ch["choices"][0]
        text += c["text"]
        tokens += c["logprobs"]["tokens"]
        token_logprobs += c["logprobs"]["token_logprobs"]
    assert text == full["text"]
    assert tokens == full["logprobs"]["tokens"]
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(full["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_logprobs_stream_without_echo(server):
    body = dict(prompt=IDS, prompt_logprobs=0, max_tokens=3, temperature=0, ignore_eos=True)
    chunks = stream_chunks(server, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert first["text"] == ""
    check_prompt_logprobs(first["prompt_logprobs"], IDS, 0)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == complete(server, **body)["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------
# max_tokens: 0


def test_max_tokens_zero_returns_only_the_prompt(server):
    prompt = bytes(IDS).decode()
    r = complete(server, prompt, echo=True, max_tokens=0)
    c = r["choices"][0]
    assert c["text"] == prompt
    assert c["finish_reason"] == "length"
    assert c["logprobs"] is None
    assert r["usage"]["completion_tokens"] == 0
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] == len(IDS) + 1

    r = complete(server, IDS, echo=True, logprobs=1, max_tokens=0)
    c = r["choices"][0]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(IDS)
    check_echo_logprobs(c["logprobs"], IDS, c["text"], 1)

    r = complete(server, IDS, prompt_logprobs=2, max_tokens=0)
    c = r["choices"][0]
    assert c["text"] == "" and c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    check_prompt_logprobs(c["prompt_logprobs"], IDS, 2)


def test_max_tokens_zero_stream(server):
    chunks = stream_chunks(server, "/v1/completions", dict(prompt=IDS, echo=True, logprobs=0, max_tokens=0,
                                                           stream_options={"include_usage": True}))
    texts = [c["text"] for ch in chunks for c in ch["choices"]]
    assert "".join(texts) == bytes(IDS).decode()
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == len(IDS)


def test_max_tokens_zero_may_fill_the_context(server):
    """The shared server's max_model_len is 512: a prompt of 512 tokens can be scored, not continued."""
    ids = (IDS * 20)[:512]
    r = complete(server, ids, echo=True, logprobs=0, max_tokens=0)
    assert len(r["choices"][0]["logprobs"]["tokens"]) == 512
    assert r["usage"]["prompt_tokens"] == 512
    for body in (dict(prompt=ids, echo=True, max_tokens=1), dict(prompt=ids + [65], prompt_logprobs=0, max_tokens=0)):
        resp = server.post("/v1/completions", {"model": TINY, **body})
        assert resp.status == 400, resp
        assert "maximum context length" in resp.json()["error"]["message"]


def test_openai_client_echo_logprobs_max_tokens_zero(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)
    prompt = "Only the prompt"
    r = client.completions.create(model=TINY, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    c = r.choices[0]
    assert c.text == prompt
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    n = r.usage.prompt_tokens
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 1e-6 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # vLLM's field comes through as an extra of the choice.
    r = client.completions.create(model=TINY, prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 1})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == n and pl[0] is None
    prompt_token_logprobs = [next(iter(e.values()))["logprob"] for e in pl[1:]]  # the prompt token is first
    assert prompt_token_logprobs == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


# ---------------------------------------------------------------------------------------------
# Chat


def test_chat_prompt_logprobs(server):
    body = dict(messages=[{"role": "user", "content": "score me"}], prompt_logprobs=1, max_tokens=2,
                temperature=0, ignore_eos=True)
    r = post(server, "/v1/chat/completions", **body)
    pl = r["prompt_logprobs"]
    assert len(pl) == r["usage"]["prompt_tokens"] and pl[0] is None
    assert all(1 <= len(e) <= 2 for e in pl[1:])
    assert "prompt_logprobs" not in r["choices"][0]
    chunks = stream_chunks(server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["prompt_logprobs"] == pl
    assert all("prompt_logprobs" not in ch for ch in chunks[1:])
    # max_tokens 0 scores the conversation only.
    r = post(server, "/v1/chat/completions", **{**body, "max_tokens": 0})
    assert r["choices"][0]["message"]["content"] == "" and r["choices"][0]["finish_reason"] == "length"
    assert len(r["prompt_logprobs"]) == len(pl)


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("path,base", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("value", [21, -1, 100, "2", True, 1.5, [1]])
def test_bad_prompt_logprobs_400(server, path, base, value):
    r = server.post(path, {"model": TINY, **base, "prompt_logprobs": value})
    assert r.status == 400, r
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "prompt_logprobs", err
    assert "prompt_logprobs" in err["message"]


@pytest.mark.parametrize("body", [
    dict(prompt="hi", max_tokens=0),
    dict(prompt="hi", max_tokens=0, logprobs=1),
    dict(prompt="hi", max_tokens=0, echo=True, n=2),
    dict(prompt="hi", max_tokens=-1, echo=True),
    dict(messages=[{"role": "user", "content": "hi"}], max_tokens=0),
], ids=["plain", "logprobs without echo", "n 2", "negative", "chat"])
def test_max_tokens_zero_needs_echo_or_prompt_logprobs(server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = server.post(path, {"model": TINY, **body})
    assert r.status == 400, r
    err = r.json()["error"]
    assert err["param"] == "max_tokens", err
    if body.get("max_tokens") == 0 and "n" not in body:
        assert "prompt_logprobs" in err["message"], err
