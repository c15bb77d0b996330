"""kvflow-server with --speculative-method triforce: completions equal plain decoding's (greedy,
lossless), a request opts out with "speculative": false, /metrics counts the middle level, and bad
TriForce flags stop the server at startup with a clear message."""

import os
import subprocess

from conftest import TINY, REPO

# Blocks of 8 tokens and a 16-token retrieval cache, drafting from the start: the tiny model's
# short prompts already run through every level.
TRIFORCE = ["--speculative-method", "triforce", "--triforce-budget", "16", "--triforce-min-context", "0",
            "--block-size", "8", "--max-model-len", "256", "--max-num-seqs", "8"]


def test_triforce_completions_equal_plain_and_export_the_middle_level(make_server):
    srv = make_server(*TRIFORCE)
    plain = make_server("--block-size", "8", "--max-model-len", "256")
    prompts = ["the quick brown fox jumps over the lazy dog " * 4, "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17",
               "TriForce drafts with a retrieval cache of its own KV, then verifies with the full cache."]
    for p in prompts:
        body = {"model": TINY, "prompt": p, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        r, ref = srv.post("/v1/completions", body), plain.post("/v1/completions", body)
        assert r.status == 200, r
        assert r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    m = srv.wait_idle()
    passes = m.get("kvflow:triforce_middle_passes_total")
    assert passes > 0
    assert m.get("kvflow:triforce_retrieval_builds_total") >= len(prompts)
    assert m.get("kvflow:spec_decode_num_draft_tokens_total") > 0
    assert m.get("kvflow:triforce_retrieval_caches") == 0
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total")
    # Opted out: plain decoding, no middle pass.
    body = {"model": TINY, "prompt": prompts[0], "max_tokens": 24, "temperature": 0, "speculative": False}
    r = srv.post("/v1/completions", body)
    assert r.status == 200, r
    assert srv.wait_idle().get("kvflow:triforce_middle_passes_total") == passes
    r = srv.post("/v1/completions", dict(body, speculative="yes"))
    assert r.status == 400, r


def run_server(server_bin, *args):
    return subprocess.run([server_bin, "--model", TINY, "--port", "0", *args], cwd=REPO, capture_output=True,
                          timeout=60, env=dict(os.environ, OMP_WAIT_POLICY="passive"))


def test_bad_triforce_flags_fail_at_startup(server_bin):
    r = run_server(server_bin, "--speculative-method", "triforce", "--triforce-draft", "medusa")
    assert r.returncode != 0
    assert b"medusa" in r.stderr, r.stderr[-2000:]
    r = run_server(server_bin, "--speculative-method", "triforce", "--triforce-draft", "draft_model")
    assert r.returncode != 0
    assert b"speculative_model" in r.stderr, r.stderr[-2000:]
    r = run_server(server_bin, "--speculative-method", "triforce", "--triforce-rebuild-acceptance", "2")
    assert r.returncode != 0
    assert b"triforce_rebuild_acceptance" in r.stderr, r.stderr[-2000:]
