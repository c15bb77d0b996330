"""kvflow-server with --kv-selection: InfiniGen (with a skewing file written by `kvflow skew`) and H2O
serve completions, a request opts out with "kv_selection": false (and then equals the full cache),
/metrics counts what attention read, and a missing or corrupt skewing file stops the server at
startup with a clear message. With --kv-offload the KV pool is in host memory: completions are the
resident pool's, /metrics counts the bytes fetched, and what offload cannot run is refused at startup."""

import os
import subprocess

from conftest import TINY, REPO

COMMON = ["--block-size", "8", "--max-model-len", "256", "--max-num-seqs", "8"]
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 4, "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17",
           "InfiniGen speculates the next layer's attention and fetches only the tokens that matter."]


def write_skew_file(cli_bin, tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text(" ".join(PROMPTS * 20))
    out = tmp_path / "tiny.infinigen"
    r = subprocess.run([cli_bin, "skew", "--model", TINY, "--file", str(sample), "--tokens", "256", "-o", str(out)],
                       cwd=REPO, capture_output=True, timeout=120, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def complete(srv, prompt, **extra):
    body = dict({"model": TINY, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}, **extra)
    r = srv.post("/v1/completions", body)
    assert r.status == 200, r
    return r.json()["choices"][0]["text"]


def test_infinigen_serves_counts_reads_and_requests_opt_out(make_server, cli_bin, tmp_path):
    skew = write_skew_file(cli_bin, tmp_path)
    srv = make_server(*COMMON, "--kv-selection", "infinigen", "--infinigen-skew-file", str(skew),
                      "--infinigen-alpha", "2")
    full = make_server(*COMMON)
    for p in PROMPTS:
        assert complete(srv, p)
    m = srv.wait_idle()
    decoded = m.get("kvflow:kv_selection_decode_tokens_total")
    assert decoded == len(PROMPTS) * 31
    assert 0 < m.get("kvflow:kv_selection_bytes_read_total") < m.get("kvflow:kv_selection_bytes_full_total")
    assert 0 < m.get("kvflow:kv_selection_fraction") <= 1
    assert m.get("kvflow:kv_selection_tokens_evicted_total") == 0  # no cap on the host pool
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total")
    # Opted out: the full cache's completion, nothing counted.
    assert complete(srv, PROMPTS[0], kv_selection=False) == complete(full, PROMPTS[0])
    assert srv.wait_idle().get("kvflow:kv_selection_decode_tokens_total") == decoded
    r = srv.post("/v1/completions", {"model": TINY, "prompt": "x", "kv_selection": "yes"})
    assert r.status == 400, r


def test_infinigen_host_pool_cap_counts_evictions(make_server, cli_bin, tmp_path):
    skew = write_skew_file(cli_bin, tmp_path)
    cap = 16
    srv = make_server(*COMMON, "--kv-selection", "infinigen", "--infinigen-skew-file", str(skew),
                      "--infinigen-host-kv-tokens", str(cap), "--infinigen-eviction", "lru")
    prompt_tokens = 0
    for p in PROMPTS:
        r = srv.post("/v1/completions", {"model": TINY, "prompt": p, "max_tokens": 32, "temperature": 0,
                                         "ignore_eos": True})
        assert r.status == 200, r
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
    m = srv.wait_idle()
    assert m.get("kvflow:kv_selection_decode_tokens_total") == len(PROMPTS) * 31
    # Every prompt is longer than the cap: by the last of its 31 decode steps each of the 4 layers
    # had pooled prompt + 30 tokens and evicted all but the cap.
    assert m.get("kvflow:kv_selection_tokens_evicted_total") == 4 * (prompt_tokens + len(PROMPTS) * (30 - cap))


def test_h2o_serves_with_its_budget(make_server):
    srv = make_server(*COMMON, "--kv-selection", "h2o", "--h2o-budget", "0.25")
    for p in PROMPTS:
        assert complete(srv, p)
    m = srv.wait_idle()
    assert m.get("kvflow:kv_selection_decode_tokens_total") == len(PROMPTS) * 31
    assert 0.2 < m.get("kvflow:kv_selection_fraction") < 0.35


def run_server(server_bin, *args):
    return subprocess.run([server_bin, "--model", TINY, "--port", "0", *args], cwd=REPO, capture_output=True,
                          timeout=60, env=dict(os.environ, OMP_WAIT_POLICY="passive"))


def test_missing_or_corrupt_skew_file_fails_at_startup(server_bin, tmp_path):
    r = run_server(server_bin, "--kv-selection", "infinigen", "--infinigen-skew-file", str(tmp_path / "absent"))
    assert r.returncode != 0
    assert b"kvflow skew" in r.stderr, r.stderr[-2000:]
    bad = tmp_path / "bad.infinigen"
    bad.write_bytes(b"KVFSKEW1" + b"\0" * 64)
    r = run_server(server_bin, "--kv-selection", "infinigen", "--infinigen-skew-file", str(bad))
    assert r.returncode != 0
    assert b"checksum" in r.stderr, r.stderr[-2000:]
    r = run_server(server_bin, "--kv-selection", "quest")
    assert r.returncode != 0
    r = run_server(server_bin, "--kv-selection", "h2o", "--infinigen-host-kv-tokens", "100")
    assert r.returncode != 0
    assert b"kv_selection infinigen" in r.stderr, r.stderr[-2000:]


def test_offloaded_pool_serves_the_same_completions_and_counts_fetches(make_server, cli_bin, tmp_path):
    skew = write_skew_file(cli_bin, tmp_path)
    selection = ["--kv-selection", "infinigen", "--infinigen-skew-file", str(skew), "--infinigen-alpha", "2"]
    resident = make_server(*COMMON, *selection)
    offloaded = make_server(*COMMON, *selection, "--kv-offload")
    for p in PROMPTS:
        assert complete(offloaded, p) == complete(resident, p)
    m = offloaded.wait_idle()
    assert m.get("kvflow:kv_offload_bytes_fetched_total") > 0
    assert m.get("kvflow:kv_offload_bytes_written_total") > 0
    assert m.get("kvflow:kv_offload_prefetches_total") > m.get("kvflow:kv_offload_on_demand_fetches_total") > 0
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total")
    assert resident.wait_idle().get("kvflow:kv_offload_bytes_fetched_total") == 0


def test_offload_refuses_what_it_cannot_run(server_bin):
    r = run_server(server_bin, "--kv-offload", "--preemption-mode", "swap")
    assert r.returncode != 0
    assert b"kv_offload" in r.stderr, r.stderr[-2000:]
    # TriForce runs over it, but not with a bottom that reads the target's recent window (in host memory).
    r = run_server(server_bin, "--kv-offload", "--speculative-method", "triforce", "--triforce-draft", "streaming")
    assert r.returncode != 0
    assert b"kv_offload" in r.stderr, r.stderr[-2000:]
