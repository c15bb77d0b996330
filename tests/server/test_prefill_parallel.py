"""kvflow-server under mpirun with --prefill-parallel (KV-Runahead): the last rank serves HTTP and
decodes, the other rank is a prefill worker. Long prompts are prefilled across both ranks and then
served from the last rank's prefix cache: completions (greedy and seeded sampling) equal a
single-process server that prefills in the same chunks, short prompts stay local, a client that
disconnects mid-stream costs nothing, and SIGTERM to mpirun shuts the whole job down cleanly."""

import signal

import pytest

from conftest import MPI_ENV, MPIRUN, TINY, start_server

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (tools/install-deps installs Open MPI)")

COMMON = ["--block-size", "16", "--max-model-len", "512", "--threads", "1"]
LONG = "KV-Runahead fills the KV cache ahead: each rank passes its KV on to the next. " * 4
SHORT = "a short prompt"


@pytest.fixture
def mpi_server(server_bin):
    """Starts `mpirun -np 2 kvflow-server ...`; at teardown SIGTERM to mpirun must end the job with
    both ranks stopping cleanly. (mpirun itself reports exit code 1 whenever it was signalled, even
    when every rank exited 0, so the ranks' logs are what is checked.)"""
    started = []

    def make(*args):
        srv = start_server(server_bin, ["--model", TINY, *args], env=MPI_ENV, name="mpirun kvflow-server",
                           launcher=[MPIRUN, "-np", "2", "--oversubscribe"])
        started.append(srv)
        return srv

    yield make
    for srv in started:
        try:
            srv.stop(signal.SIGTERM, timeout=40)
            log = srv.log(400)
            assert "stopped by rank 1" in log, log  # the worker was told to stop
            assert "] stopped:" in log, log          # the last rank shut down as usual
        finally:
            srv.close()


def completion(srv, prompt, **extra):
    body = dict({"model": TINY, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}, **extra)
    r = srv.post("/v1/completions", body)
    assert r.status == 200, r
    return r.json()


def test_long_prompts_prefilled_across_ranks_equal_one_process(mpi_server, make_server):
    srv = mpi_server(*COMMON, "--prefill-parallel", "kv-runahead", "--prefill-parallel-min-tokens", "64")
    assert any("kv-runahead prefill across 2 ranks" in line for line in srv.lines), srv.log()
    first = completion(srv, LONG)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 64
    # The ranks prefill the prompt's whole blocks short of its last token, split evenly.
    prefilled = (prompt_tokens - 1) // 16 * 16
    ref = make_server(*COMMON, "--enable-prefix-caching", "--max-num-batched-tokens", str(prefilled // 2))
    assert first["choices"][0]["text"] == completion(ref, LONG)["choices"][0]["text"]
    for seed in (1, 2):
        sampled = dict(temperature=0.8, top_p=0.95, seed=seed)
        assert completion(srv, str(seed) + LONG, **sampled)["choices"][0]["text"] == \
            completion(ref, str(seed) + LONG, **sampled)["choices"][0]["text"]
    m = srv.wait_idle()
    assert m.get("kvflow:prefix_cache_hit_rate") > 0
    # Short prompts never leave the last rank; they are served as usual.
    assert completion(srv, SHORT)["choices"][0]["text"] == completion(ref, SHORT)["choices"][0]["text"]


def test_cancelled_stream_and_shutdown(mpi_server):
    srv = mpi_server(*COMMON, "--prefill-parallel", "tsp", "--prefill-parallel-min-tokens", "64")
    conn = srv.connect()
    body = ('{"model": "%s", "prompt": "%s", "max_tokens": 400, "stream": true, "ignore_eos": true}'
            % (TINY, LONG)).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert conn.recv(4096)  # the stream started
    conn.close()  # the client goes away mid-stream
    assert completion(srv, LONG)["choices"][0]["text"]
    m = srv.wait_idle(timeout=20)
    assert m.get("kvflow:num_requests_running") == 0
    # Teardown: SIGTERM to mpirun; the last rank shuts down and tells its worker to stop.
