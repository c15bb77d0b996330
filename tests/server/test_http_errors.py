"""kvflow-server over raw HTTP (http.client and sockets, no openai client): every error of the
spec with its status and OpenAI error JSON, hostile and broken clients, cancellation on
disconnect, /metrics, and graceful shutdown."""

import http.client
import json
import signal
import socket
import struct
import threading
import time

import pytest

from conftest import TINY, Response, iter_sse, start_server, stop_server

COMPLETION = {"model": TINY, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SOCKET_TIMEOUT = 20.0


def with_(base, **kw):
    body = dict(base)
    body.update(kw)
    return body


def assert_error(resp, status, type_=None, code=None, message_contains=None):
    """The status and the OpenAI error shape {"error": {"message", "type", "param", "code"}}."""
    assert resp.status == status, f"expected {status}, got {resp}"
    ctype = resp.headers.get("content-type", "")
    assert ctype.startswith("application/json"), f"error Content-Type {ctype!r} for {resp}"
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), resp
    err = body["error"]
    for key in ("message", "type", "param", "code"):
        assert key in err, f"error object lacks {key!r}: {err}"
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if type_ is not None:
        assert err["type"] == type_, err
    if code is not None:
        assert err["code"] == code, err
    if message_contains is not None:
        assert message_contains in err["message"], err
    return err


def send_raw(srv, data, timeout=SOCKET_TIMEOUT):
    """Sends raw bytes on a fresh connection and reads one response. Returns (status, headers,
    body) or None when the server closed the connection without answering."""
    sock = srv.connect(timeout)
    try:
        sock.sendall(data)
        return read_response(sock)
    finally:
        sock.close()


def read_response(sock, method="POST"):
    resp = http.client.HTTPResponse(sock, method=method)
    try:
        resp.begin()
    except (http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine):
        return None
    try:
        body = resp.read()
    except ConnectionResetError:
        raise AssertionError(f"connection reset while reading the body of a {resp.status} response: the "
                             f"server closed with unread request bytes (RST) instead of a lingering close")
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def post_headers(path, length, extra=""):
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def connection_closed(sock, timeout=5.0):
    """True when the peer closes the connection (EOF or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def completion_works(srv):
    r = srv.post("/v1/completions", with_(COMPLETION, temperature=0, ignore_eos=True))
    assert r.status == 200, r
    assert r.json()["usage"]["completion_tokens"] == 4
    return True


@pytest.fixture(autouse=True)
def shared_server_still_healthy(server):
    yield
    r = server.get("/health", timeout=10)
    assert r.status == 200, f"the shared server stopped answering /health: {r}"


@pytest.fixture(scope="module")
def long_server(server_bin):
    """tiny-random at its full context (4096), for long requests."""
    srv = start_server(server_bin, ["--model", TINY], name="tiny-random server (4096)")
    yield srv
    stop_server(srv)


# ---------------------------------------------------------------------------------------------
# 400 invalid_request_error

BAD_COMPLETIONS = {
    "malformed json": b'{"model": "tiny-random", "prompt": "hi"',
    "empty body": b"",
    "json array": b"[1, 2]",
    "json string": b'"hello"',
    "json null": b"null",
    "json number": b"42",
    "trailing garbage": b'{"model": "tiny-random", "prompt": "hi"} x',
    "invalid utf-8": b'{"model": "tiny-random", "prompt": "\xff\xfe"}',
    "deep nesting": b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}",
    "max_tokens string": with_(COMPLETION, max_tokens="ten"),
    "max_tokens float": with_(COMPLETION, max_tokens=2.5),
    "temperature string": with_(COMPLETION, temperature="hot"),
    "stop int": with_(COMPLETION, stop=5),
    "stop list of ints": with_(COMPLETION, stop=[1, 2]),
    "prompt int": with_(COMPLETION, prompt=3),
    "prompt null": with_(COMPLETION, prompt=None),
    "prompt floats": with_(COMPLETION, prompt=[1.5, 2.5]),
    "prompt mixed list": with_(COMPLETION, prompt=["a", 1]),
    "prompt token out of vocab": with_(COMPLETION, prompt=[1, 2, 300]),
    "prompt negative token": with_(COMPLETION, prompt=[-1]),
    "n string": with_(COMPLETION, n="2"),
    "stream string": with_(COMPLETION, stream="yes"),
    "seed string": with_(COMPLETION, seed="x"),
    "unknown field": with_(COMPLETION, foo=1),
    "max_tokens 0": with_(COMPLETION, max_tokens=0),
    "max_tokens -1": with_(COMPLETION, max_tokens=-1),
    "prompt longer than context": with_(COMPLETION, prompt="a" * 600),
    "prompt + max_tokens over context": with_(COMPLETION, prompt="a" * 300, max_tokens=300),
    "n over max_num_seqs": with_(COMPLETION, n=65),
    "best_of over max_num_seqs": with_(COMPLETION, best_of=65),
    "n > best_of": with_(COMPLETION, n=3, best_of=2),
    "n 0": with_(COMPLETION, n=0),
    "empty prompt": with_(COMPLETION, prompt=""),
    "empty prompt list": with_(COMPLETION, prompt=[]),
    "empty token list": with_(COMPLETION, prompt=[[]]),
    "temperature -1": with_(COMPLETION, temperature=-1),
    "top_p 0": with_(COMPLETION, top_p=0),
    "top_p 1.5": with_(COMPLETION, top_p=1.5),
    "logprobs 21": with_(COMPLETION, logprobs=21),
    "logprobs -1": with_(COMPLETION, logprobs=-1),
    "stream with best_of > n": with_(COMPLETION, stream=True, n=1, best_of=2),
    "max_tokens 0 with logprobs": with_(COMPLETION, max_tokens=0, logprobs=1),
    "prompt_logprobs 21": with_(COMPLETION, prompt_logprobs=21),
    "prompt_logprobs -1": with_(COMPLETION, prompt_logprobs=-1),
    "prompt filling the context, max_tokens 1": with_(COMPLETION, prompt=[65] * 512, echo=True, max_tokens=1),
    "suffix": with_(COMPLETION, suffix="tail"),
    "logit_bias out of range": with_(COMPLETION, logit_bias={"1": 500}),
    "logit_bias key not a token id": with_(COMPLETION, logit_bias={"one": 5}),
    "logit_bias token outside the vocabulary": with_(COMPLETION, logit_bias={"99999999": 5}),
    "stream_options unknown key": with_(COMPLETION, stream=True, stream_options={"bogus": True}),
    "logprobs bool": with_(COMPLETION, logprobs=True),
    "presence_penalty 5": with_(COMPLETION, presence_penalty=5),
    "frequency_penalty -3": with_(COMPLETION, frequency_penalty=-3),
    "repetition_penalty 0": with_(COMPLETION, repetition_penalty=0),
    "stream with beam search": with_(COMPLETION, stream=True, use_beam_search=True, best_of=2),
}

BAD_CHATS = {
    "messages string": with_(CHAT, messages="hi"),
    "messages empty": with_(CHAT, messages=[]),
    "message not object": with_(CHAT, messages=["hi"]),
    "unknown role": with_(CHAT, messages=[{"role": "robot", "content": "hi"}]),
    "content int": with_(CHAT, messages=[{"role": "user", "content": 5}]),
    "content part not text": with_(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
    "tools not a list": with_(CHAT, tools={"type": "function", "function": {"name": "f"}}),
    "tool without a name": with_(CHAT, tools=[{"type": "function", "function": {"parameters": {}}}]),
    "tool type": with_(CHAT, tools=[{"type": "retrieval", "function": {"name": "f"}}]),
    "tool message on a user": with_(CHAT, messages=[{"role": "user", "content": "x", "tool_call_id": "a"}]),
    "functions": with_(CHAT, functions=[{"name": "f", "parameters": {}}]),
    "response_format xml": with_(CHAT, response_format={"type": "xml"}),
    "response_format schema not an object": with_(CHAT, response_format={"type": "json_schema", "json_schema": 5}),
    "top_logprobs 21": with_(CHAT, logprobs=True, top_logprobs=21),
    "logprobs int": with_(CHAT, logprobs=3),
    "max_completion_tokens 0": {k: v for k, v in with_(CHAT, max_completion_tokens=0).items() if k != "max_tokens"},
    "max_tokens 0": with_(CHAT, max_tokens=0),
    "temperature -1": with_(CHAT, temperature=-1),
    "unknown field": with_(CHAT, bar=True),
    "prompt longer than context": with_(CHAT, messages=[{"role": "user", "content": "a" * 600}]),
    "n > best_of": with_(CHAT, n=2, best_of=1),
    "stream with best_of > n": with_(CHAT, stream=True, best_of=2),
    "top_logprobs without logprobs": with_(CHAT, top_logprobs=2),
    "prompt_logprobs 21": with_(CHAT, prompt_logprobs=21),
    "content null": with_(CHAT, messages=[{"role": "user", "content": None}]),
}


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
def test_null_fields_mean_defaults(server, path, base):
    """OpenAI clients (and LangChain & co.) send null for unset optional fields."""
    nullable = ["temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
                "stream", "stream_options", "user", "logit_bias", "best_of", "prompt_logprobs"]
    nullable += ["logprobs", "echo", "suffix"] if "prompt" in base else ["logprobs", "top_logprobs",
                                                                          "response_format", "tools"]
    for field in nullable:
        r = server.post(path, with_(base, **{field: None}))
        assert r.status == 200, f"{field}: null -> {r}"
    r = server.post(path, with_(base, max_tokens=None, ignore_eos=True, temperature=0)
                    if "prompt" in base else with_(base, max_tokens=3, user="someone", logit_bias={}))
    assert r.status == 200, r
    if "prompt" in base:
        assert r.json()["usage"]["completion_tokens"] == 16, "max_tokens null is not the default 16"


@pytest.mark.parametrize("name", list(BAD_COMPLETIONS))
def test_bad_completion_request_400(server, name):
    body = BAD_COMPLETIONS[name]
    headers = {"Content-Type": "application/json"} if isinstance(body, bytes) else None
    r = server.post("/v1/completions", body, headers=headers)
    err = assert_error(r, 400, type_="invalid_request_error")
    if name == "unknown field":
        assert "Unrecognized request argument supplied: foo" in err["message"], err
    if "context" in name:
        assert "maximum context length" in err["message"], err


@pytest.mark.parametrize("name", list(BAD_CHATS))
def test_bad_chat_request_400(server, name):
    r = server.post("/v1/chat/completions", BAD_CHATS[name])
    err = assert_error(r, 400, type_="invalid_request_error")
    if name == "unknown field":
        assert "Unrecognized request argument supplied: bar" in err["message"], err
    if "context" in name:
        assert "maximum context length" in err["message"], err


def test_unknown_model_404(server):
    err = assert_error(server.post("/v1/completions", with_(COMPLETION, model="gpt-4")), 404,
                       code="model_not_found")
    assert "gpt-4" in err["message"]
    assert_error(server.post("/v1/chat/completions", with_(CHAT, model="gpt-4")), 404, code="model_not_found")


@pytest.mark.parametrize("method,path", [("GET", "/nope"), ("POST", "/v1/nothing"), ("GET", "/v1"),
                                         ("GET", "/v1/completions/x")])
def test_unknown_path_404(server, method, path):
    assert_error(server.request(method, path, b"{}" if method == "POST" else None), 404)


@pytest.mark.parametrize("method,path", [("GET", "/v1/completions"), ("GET", "/v1/chat/completions"),
                                         ("PUT", "/v1/completions"), ("POST", "/health"),
                                         ("DELETE", "/v1/models")])
def test_wrong_method_405(server, method, path):
    assert_error(server.request(method, path, b"{}" if method in ("POST", "PUT") else None), 405)


# ---------------------------------------------------------------------------------------------
# Auth, body size, queue full: servers of their own


def test_api_key(make_server):
    srv = make_server("--api-key", "sekrit")
    body = with_(COMPLETION, temperature=0)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                    {"Authorization": "Basic c2Vrcml0"}):
        for path, b in (("/v1/completions", body), ("/v1/chat/completions", CHAT)):
            assert_error(srv.post(path, b, headers=headers), 401, type_="authentication_error",
                         code="invalid_api_key")
    assert_error(srv.get("/v1/models"), 401, code="invalid_api_key")
    good = {"Authorization": "Bearer sekrit"}
    assert srv.post("/v1/completions", body, headers=good).status == 200
    assert srv.post("/v1/chat/completions", CHAT, headers=good).status == 200
    assert srv.get("/v1/models", headers=good).status == 200
    assert srv.get("/health").status == 200
    assert srv.get("/metrics").status == 200


def test_api_key_from_env(make_server):
    srv = make_server(env={"KVFLOW_API_KEY": "envkey"})
    assert_error(srv.post("/v1/completions", COMPLETION), 401, code="invalid_api_key")
    assert srv.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer envkey"}).status == 200
    # SIGINT stops the server as SIGTERM does.
    assert srv.stop(signal.SIGINT) == 0, srv.log()


def test_body_too_large_413(make_server):
    srv = make_server("--max-request-body-bytes", "1024")
    # Under the limit: served.
    small = json.dumps(with_(COMPLETION, prompt="x" * 900)).encode()
    assert len(small) < 1024
    assert srv.post("/v1/completions", small, headers={"Content-Type": "application/json"}).status == 200

    # Over the limit, headers only: the 413 must come without the body being read, then a close.
    sock = srv.connect(SOCKET_TIMEOUT)
    try:
        sock.sendall(post_headers("/v1/completions", 4096))
        got = read_response(sock)
        assert got is not None, "no response to a 4096-byte Content-Length over a 1024 limit"
        status, headers, body = got
        assert status == 413, got
        assert_error(_as_response(got), 413)
        assert connection_closed(sock), "the connection stayed open after 413"
    finally:
        sock.close()

    # Over the limit with Expect: 100-continue: the 413 comes instead of the 100.
    sock = srv.connect(SOCKET_TIMEOUT)
    try:
        sock.sendall(post_headers("/v1/completions", 4096, "Expect: 100-continue\r\n"))
        got = read_response(sock)
        assert got is not None and got[0] == 413, got
    finally:
        sock.close()

    # Over the limit with the whole body sent (4 KiB, and 64 KiB: more than the server reads
    # with the head): still a readable 413.
    for size in (4096, 65536):
        big = json.dumps(with_(COMPLETION, prompt="y" * size)).encode()
        got = send_raw(srv, post_headers("/v1/completions", len(big)) + big)
        assert got is not None, f"the server reset the connection before the 413 could be read ({size} B)"
        assert_error(_as_response(got), 413)
    assert srv.get("/health").status == 200
    assert completion_works(srv)


def _as_response(got):
    return Response(*got)


def test_queue_full_503(make_server):
    srv = make_server("--max-num-seqs", "1", "--max-queue-len", "1")
    body = with_(COMPLETION, prompt="queue", max_tokens=400, ignore_eos=True, temperature=0)
    barrier = threading.Barrier(5)
    results = [None] * 6

    def worker(i, wait):
        if wait:
            barrier.wait(10)
        try:
            results[i] = srv.post("/v1/completions", body, timeout=120)
        except Exception as e:  # reported below
            results[i] = e

    # The first request runs before the rest arrive: six at once could all find the queue holding
    # one not yet admitted, and then only one of them succeeds.
    threads = [threading.Thread(target=worker, args=(0, False))]
    threads[0].start()
    deadline = time.time() + 10
    while srv.metrics().get("kvflow:num_requests_running") != 1 and time.time() < deadline:
        time.sleep(0.01)
    threads += [threading.Thread(target=worker, args=(i, True)) for i in range(1, 6)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(150)
    assert all(not isinstance(r, Exception) and r is not None for r in results), results
    statuses = sorted(r.status for r in results)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1, f"no 503 with 6 concurrent requests, 1 seq, queue 1: {statuses}"
    assert statuses.count(200) >= 2, f"the running and the queued request must succeed: {statuses}"
    for r in results:
        if r.status == 503:
            assert_error(r, 503, code="queue_full")
            assert r.headers.get("retry-after") == "1", r.headers
        else:
            assert r.json()["usage"]["completion_tokens"] == 400
    m = srv.wait_idle()
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total")
    assert m.get("kvflow:http_requests_total", code="503") == statuses.count(503)


def test_max_connections_503(make_server):
    srv = make_server("--max-connections", "4")
    time.sleep(0.3)  # a closed connection counts until its thread ends: let start-up's go
    idle = [srv.connect(SOCKET_TIMEOUT) for _ in range(4)]
    try:
        time.sleep(0.3)
        # Under load one of the four may itself have been refused (a just-closed connection still
        # counted); then the fifth may be served. Either way one of the five gets the 503.
        refused_idle = []
        for s in idle:
            s.setblocking(False)
            try:
                if s.recv(16, socket.MSG_PEEK):
                    refused_idle.append(s)
            except BlockingIOError:
                pass
            s.settimeout(SOCKET_TIMEOUT)
        got = send_raw(srv, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        if refused_idle:
            got_idle = read_response(refused_idle[0], method="GET")
            assert_error(_as_response(got_idle), 503)
        else:
            assert got is not None, "the fifth connection was closed without a 503"
            assert_error(_as_response(got), 503)
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            if srv.get("/v1/models", timeout=5).status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "connections were not released after the clients left"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# Broken and hostile clients


@pytest.mark.parametrize("junk", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n",
    b"HELLO WORLD\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    b"\x00" * 4096 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    b"GET /health HTTP/1.1\r\nNoColonHeader\r\n\r\n",
])
def test_garbage_gets_400_or_close(server, junk):
    got = send_raw(server, junk)
    if got is not None:
        assert got[0] in (400, 413, 505), got
    assert server.get("/health").status == 200


def test_truncated_body_then_close(server):
    sock = server.connect(SOCKET_TIMEOUT)
    sock.sendall(post_headers("/v1/completions", 100) + b'{"model": ')
    sock.close()
    assert server.get("/health").status == 200
    assert completion_works(server)


def test_stalled_clients_do_not_block_others(server):
    """A client that sent half a body and one that sent half a request line stay open while
    others are served."""
    stalled = [server.connect(SOCKET_TIMEOUT), server.connect(SOCKET_TIMEOUT)]
    try:
        stalled[0].sendall(post_headers("/v1/completions", 100) + b'{"model": ')
        stalled[1].sendall(b"POST /v1/comp")
        time.sleep(0.2)
        assert server.get("/health", timeout=10).status == 200
        assert completion_works(server)
    finally:
        for s in stalled:
            s.close()


def test_header_too_large(server):
    req = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (256 * 1024) + b"\r\n\r\n"
    sock = server.connect(SOCKET_TIMEOUT)
    try:
        try:
            sock.sendall(req)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us mid-send: acceptable
        got = read_response(sock, method="GET")
    finally:
        sock.close()
    if got is not None:
        assert got[0] in (400, 413, 431), got
    assert server.get("/health").status == 200


def test_chunked_request_body_411(server):
    body = json.dumps(COMPLETION).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    got = send_raw(server, req)
    assert got is not None, "no answer to a chunked request body"
    assert_error(_as_response(got), 411)


def test_expect_100_continue(server):
    body = json.dumps(with_(COMPLETION, temperature=0)).encode()
    sock = server.connect(SOCKET_TIMEOUT)
    try:
        sock.sendall(post_headers("/v1/completions", len(body), "Expect: 100-continue\r\n"))
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = sock.recv(4096)
            assert chunk, "connection closed before 100 Continue"
            interim += chunk
        head, _, rest = interim.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 100"), head
        assert rest == b""
        sock.sendall(body)
        got = read_response(sock)
    finally:
        sock.close()
    assert got is not None and got[0] == 200, got
    assert json.loads(got[2])["usage"]["completion_tokens"] == 4


def test_keep_alive(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=SOCKET_TIMEOUT)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        first = conn.sock
        assert first is not None, "the server closed a keep-alive connection after /health"
        body = json.dumps(with_(COMPLETION, temperature=0))
        for _ in range(3):
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200
            json.loads(r.read())
            # An error response must not break the connection either.
            conn.request("POST", "/v1/completions", "{bad", {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 400
            r.read()
        assert conn.sock is first, "the connection was not kept alive"
    finally:
        conn.close()


def test_http_1_0(server):
    sock = server.connect(SOCKET_TIMEOUT)
    try:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        got = read_response(sock, method="GET")
        assert got is not None and got[0] == 200, got
        assert json.loads(got[2])["data"][0]["id"] == TINY
        assert connection_closed(sock), "an HTTP/1.0 request without keep-alive must close"
    finally:
        sock.close()


def test_pipelined_requests(server):
    """Three requests in one write; three responses in order."""
    body = json.dumps(with_(COMPLETION, temperature=0)).encode()
    req = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post_headers("/v1/completions", len(body)) + body
           + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    sock = server.connect(SOCKET_TIMEOUT)
    try:
        sock.sendall(req)
        f = sock.makefile("rb")  # one buffered reader for all three responses
        statuses, bodies = [], []
        for _ in range(3):
            status_line = f.readline()
            assert status_line.startswith(b"HTTP/1.1 "), status_line
            statuses.append(int(status_line.split()[1]))
            length = 0
            while True:
                line = f.readline()
                assert line, "connection closed mid-response"
                if line in (b"\r\n", b"\n"):
                    break
                name, _, value = line.decode().partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            bodies.append(f.read(length))
    finally:
        sock.close()
    assert statuses == [200, 200, 200], statuses
    assert bodies[0] == b""
    assert json.loads(bodies[1])["object"] == "text_completion"
    assert json.loads(bodies[2])["object"] == "list"


# ---------------------------------------------------------------------------------------------
# Cancellation on disconnect


def open_stream(srv, body):
    """Starts a streaming completion on a raw socket; returns (sock, response)."""
    data = json.dumps(body).encode()
    sock = srv.connect(SOCKET_TIMEOUT)
    sock.sendall(post_headers("/v1/completions", len(data)) + data)
    resp = http.client.HTTPResponse(sock, method="POST")
    resp.begin()
    assert resp.status == 200, resp.read()
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    return sock, resp


def abort_socket(sock, rst):
    if rst:  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def assert_idle_after_cancel(srv, before, max_tokens):
    m = srv.wait_idle(timeout=5)
    assert m.get("kvflow:num_requests_running") == 0, m.text
    assert m.get("kvflow:num_requests_waiting") == 0, m.text
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total"), \
        "KV blocks leaked after a client disconnect"
    assert m.get("kvflow:num_requests_in_flight") == 0
    assert m.get("kvflow:request_cancelled_total") == before.get("kvflow:request_cancelled_total") + 1
    success = lambda x: x.get("kvflow:request_success_total", default=0)
    assert success(m) == success(before), "the disconnected request was counted as a success"
    generated = m.get("kvflow:generation_tokens_total") - before.get("kvflow:generation_tokens_total")
    assert generated < max_tokens, "generation went on to the end after the client left"


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
def test_cancel_streaming_on_disconnect(server, rst):
    before = server.wait_idle()
    body = with_(COMPLETION, prompt="cancel me", max_tokens=400, ignore_eos=True, stream=True)
    sock, resp = open_stream(server, body)
    events = iter_sse(resp)
    for _ in range(2):
        payload = next(events)
        assert json.loads(payload)["choices"][0]["finish_reason"] is None
    abort_socket(sock, rst)
    resp.close()
    assert_idle_after_cancel(server, before, 400)


def test_cancel_non_streaming_on_disconnect(long_server):
    srv = long_server
    before = srv.wait_idle()
    data = json.dumps(with_(COMPLETION, prompt="cancel me too", max_tokens=3000, ignore_eos=True)).encode()
    sock = srv.connect(SOCKET_TIMEOUT)
    sock.sendall(post_headers("/v1/completions", len(data)) + data)
    deadline = time.monotonic() + 10
    while srv.metrics().get("kvflow:num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.02)
    time.sleep(0.2)
    sock.close()
    assert_idle_after_cancel(srv, before, 3000)


# ---------------------------------------------------------------------------------------------
# Metrics

GAUGES = ["kvflow:num_requests_running", "kvflow:num_requests_waiting", "kvflow:num_requests_swapped",
          "kvflow:kv_cache_blocks_total", "kvflow:kv_cache_blocks_free", "kvflow:kv_cache_usage_perc",
          "kvflow:host_kv_cache_blocks_total", "kvflow:host_kv_cache_blocks_free",
          "kvflow:prefix_cache_hit_rate", "kvflow:num_requests_in_flight"]
COUNTERS = ["kvflow:prompt_tokens_total", "kvflow:generation_tokens_total", "kvflow:num_preemptions_total",
            "kvflow:request_success_total", "kvflow:request_cancelled_total", "kvflow:request_failure_total",
            "kvflow:http_requests_total"]
HISTOGRAMS = ["kvflow:time_to_first_token_seconds", "kvflow:time_per_output_token_seconds",
              "kvflow:e2e_request_latency_seconds"]


def type_of(m, name):
    return m.types.get(name) or m.types.get(name[:-len("_total")] if name.endswith("_total") else name)


def check_histogram(m, name):
    buckets = [(float(l["le"]), v) for n, l, v in m.samples if n == name + "_bucket"]
    assert buckets, f"{name} has no buckets"
    les = [le for le, _ in buckets]
    assert les == sorted(les) and les[-1] == float("inf"), f"{name} buckets {les}"
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), f"{name} buckets are not cumulative: {counts}"
    assert counts[-1] == m.get(name + "_count"), f"{name}: +Inf bucket != _count"
    assert m.get(name + "_sum") >= 0


def test_metrics(server):
    before = server.wait_idle()
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for prompt, max_tokens in (("metrics one", 5), ("metrics two!", 9), ("3", 2)):
        r = server.post("/v1/completions", with_(COMPLETION, prompt=prompt, max_tokens=max_tokens,
                                                 ignore_eos=True))
        assert r.status == 200, r
        for k in usage:
            usage[k] += r.json()["usage"][k]
    # One streaming chat request, with its usage.
    r = server.post("/v1/chat/completions", with_(CHAT, max_tokens=6, ignore_eos=True, stream=True,
                                                  stream_options={"include_usage": True}))
    assert r.status == 200
    events = [e for e in r.body.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    stream_usage = json.loads(events[-2][len("data: "):])["usage"]
    for k in usage:
        usage[k] += stream_usage[k]
    assert server.post("/v1/completions", b"{bad", headers={"Content-Type": "application/json"}).status == 400

    m = server.wait_idle()
    for name in GAUGES:
        assert m.has(name), f"gauge {name} missing"
        assert type_of(m, name) == "gauge", f"{name} TYPE {type_of(m, name)}"
    for name in COUNTERS:
        assert m.has(name), f"counter {name} missing"
        assert type_of(m, name) == "counter", f"{name} TYPE {type_of(m, name)}"
    for name in HISTOGRAMS:
        assert m.types.get(name) == "histogram", f"{name} TYPE {m.types.get(name)}"
        check_histogram(m, name)
        assert m.get(name + "_count") > 0
    for n, _, _ in m.samples:
        assert m.family(n) in m.types or type_of(m, n), f"sample {n} has no TYPE"

    delta = lambda name, **l: m.get(name, default=0, **l) - before.get(name, default=0, **l)
    assert delta("kvflow:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("kvflow:generation_tokens_total") == usage["completion_tokens"]
    assert delta("kvflow:request_success_total", finished_reason="length") == 4
    assert delta("kvflow:e2e_request_latency_seconds_count") == 4
    assert delta("kvflow:time_to_first_token_seconds_count") == 4
    assert delta("kvflow:http_requests_total", code="200") >= 4
    assert delta("kvflow:http_requests_total", code="400") >= 1
    assert m.get("kvflow:num_requests_running") == 0
    assert m.get("kvflow:num_requests_in_flight") == 0
    assert 0 <= m.get("kvflow:kv_cache_usage_perc") <= 1
    assert 0 <= m.get("kvflow:prefix_cache_hit_rate") <= 1
    assert m.get("kvflow:kv_cache_blocks_total") > 0
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total")
    assert m.get("kvflow:host_kv_cache_blocks_free") == m.get("kvflow:host_kv_cache_blocks_total")


# ---------------------------------------------------------------------------------------------
# Graceful shutdown


def stream_in_thread(srv, body, first_event, out):
    """Runs a streaming completion; records events, the final finish_reason and [DONE]."""
    try:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        out["events"] = []
        for payload in iter_sse(resp):
            if payload == "[DONE]":
                out["done"] = True
                break
            ev = json.loads(payload)
            out["events"].append(ev)
            first_event.set()
            for c in ev.get("choices", []):
                if c.get("finish_reason"):
                    out["finish_reason"] = c["finish_reason"]
            if ev.get("usage"):
                out["usage"] = ev["usage"]
        conn.close()
    except Exception as e:
        out["error"] = repr(e)
    finally:
        first_event.set()


def assert_refused_or_503(srv):
    """Soon after SIGTERM (the signal is handled asynchronously) a new connection is refused or
    /health answers 503."""
    deadline = time.monotonic() + 3
    while True:
        try:
            r = srv.get("/health", timeout=5)
        except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected):
            return
        if r.status == 503:
            return
        assert r.status == 200, r
        assert time.monotonic() < deadline, "/health still answered 200 3 s after SIGTERM"
        time.sleep(0.01)


def test_graceful_shutdown_finishes_in_flight(make_server):
    srv = make_server()
    first, out = threading.Event(), {}
    body = with_(COMPLETION, prompt="drain", max_tokens=200, ignore_eos=True, stream=True,
                 stream_options={"include_usage": True})
    t = threading.Thread(target=stream_in_thread, args=(srv, body, first, out))
    t.start()
    assert first.wait(30), "no first event"
    srv.send_signal(signal.SIGTERM)
    assert_refused_or_503(srv)
    t.join(60)
    assert not t.is_alive()
    assert "error" not in out, out.get("error")
    assert out.get("finish_reason") == "length", out.get("finish_reason")
    assert out.get("done"), "the stream did not end with [DONE]"
    assert out["usage"]["completion_tokens"] == 200
    assert srv.wait(30) == 0, srv.log()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((srv.host, srv.port), timeout=5).close()


def test_graceful_shutdown_timeout_aborts(make_server):
    srv = make_server("--shutdown-timeout", "1")
    first, out = threading.Event(), {}
    body = with_(COMPLETION, prompt="too long", max_tokens=4000, ignore_eos=True, stream=True)
    streamer = threading.Thread(target=stream_in_thread, args=(srv, body, first, out))
    streamer.start()
    plain = {}

    def non_streaming():
        try:
            plain["r"] = srv.post("/v1/completions", with_(body, stream=False), timeout=60)
        except Exception as e:
            plain["r"] = e

    t2 = threading.Thread(target=non_streaming)
    t2.start()
    assert first.wait(30), "no first event"
    deadline = time.monotonic() + 10
    while srv.metrics().get("kvflow:num_requests_running") < 2:
        assert time.monotonic() < deadline, "the two requests never ran together"
        time.sleep(0.02)
    t0 = time.monotonic()
    srv.send_signal(signal.SIGTERM)
    assert_refused_or_503(srv)
    rc = srv.wait(15)
    elapsed = time.monotonic() - t0
    streamer.join(10)
    t2.join(10)
    assert rc == 0, srv.log()
    assert 0.8 <= elapsed <= 6.0, f"exit {elapsed:.2f} s after SIGTERM with --shutdown-timeout 1"
    assert "error" not in out, out.get("error")
    assert out.get("finish_reason") == "abort", out.get("finish_reason")
    assert out.get("done"), "the aborted stream did not end with [DONE]"
    r = plain["r"]
    assert not isinstance(r, Exception), r
    assert_error(r, 503)


def test_second_sigterm_exits_at_once(make_server):
    """A second signal during the drain ends the process without waiting (exit code 1)."""
    srv = make_server()
    first, out = threading.Event(), {}
    body = with_(COMPLETION, prompt="long drain", max_tokens=4000, ignore_eos=True, stream=True)
    t = threading.Thread(target=stream_in_thread, args=(srv, body, first, out))
    t.start()
    assert first.wait(30), "no first event"
    srv.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    t0 = time.monotonic()
    srv.send_signal(signal.SIGTERM)
    rc = srv.wait(10)
    t.join(10)
    assert rc == 1, srv.log()
    assert time.monotonic() - t0 < 3.0
    assert out.get("finish_reason") is None, "the 4000-token stream cannot have finished"


def test_still_serving_after_all(server):
    assert server.get("/health").status == 200
    assert completion_works(server)
    m = server.wait_idle()
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total")
