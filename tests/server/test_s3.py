"""kvflow-server with --scheduler s3: requests whose outputs outgrow the predicted bucket are
preempted, doubled and still answered in full; /metrics counts predictions, mispredictions and
reservation preemptions; bad S3 flags stop the server at startup with a clear message."""

import os
import subprocess
import tempfile

from conftest import TINY, REPO


def test_s3_serves_mispredicted_requests_and_exports_the_supervisor(make_server):
    # Untrained predictor over max_model_len 256: buckets of 26 tokens, everything predicted in
    # bucket 0, so 60-token outputs run out of their reservation at least once each.
    srv = make_server("--scheduler", "s3", "--max-model-len", "256", "--num-kv-blocks", "64",
                      "--block-size", "8", "--preemption-mode", "swap")
    paged = make_server("--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "8")
    prompts = ["s3 one", "the second prompt is longer than the first", "3", "four four four"]
    for p in prompts:
        body = {"model": TINY, "prompt": p, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        r, ref = srv.post("/v1/completions", body), paged.post("/v1/completions", body)
        assert r.status == 200, r
        assert r.json()["usage"]["completion_tokens"] == 60
        assert r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    m = srv.wait_idle()
    assert m.get("kvflow:s3_length_predictions_total") == len(prompts)
    assert m.get("kvflow:s3_reservation_preemptions_total") >= len(prompts)
    # Cut at max_tokens in bucket 2, above the predicted bucket 0: certainly under-predicted.
    assert m.get("kvflow:s3_mispredictions_total", direction="under") == len(prompts)
    assert m.get("kvflow:s3_mispredictions_total", direction="over") == 0
    assert m.get("kvflow:num_preemptions_swap_total") >= len(prompts)
    assert m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total")
    assert m.get("kvflow:s3_predictor_seconds_total", phase="predict") > 0
    assert paged.metrics().get("kvflow:s3_length_predictions_total") == 0


def run_server(server_bin, *args):
    return subprocess.run([server_bin, "--model", TINY, "--port", "0", *args], cwd=REPO, capture_output=True,
                          timeout=60, env=dict(os.environ, OMP_WAIT_POLICY="passive"))


def test_bad_s3_flags_fail_at_startup(server_bin):
    r = run_server(server_bin, "--scheduler", "s4")
    assert r.returncode != 0
    assert b"unknown scheduling policy 's4'" in r.stderr, r.stderr[-2000:]
    r = run_server(server_bin, "--scheduler", "s3", "--length-predictor", "/nonexistent/predictor.kvlp")
    assert r.returncode != 0
    assert b"/nonexistent/predictor.kvlp" in r.stderr, r.stderr[-2000:]
    with tempfile.NamedTemporaryFile(suffix=".kvlp") as f:
        f.write(b"KVFLOWLP garbage")
        f.flush()
        r = run_server(server_bin, "--scheduler", "s3", "--length-predictor", f.name)
        assert r.returncode != 0
        assert f.name.encode() in r.stderr, r.stderr[-2000:]
    r = run_server(server_bin, "--scheduler", "s3", "--length-reservation", "lowest")
    assert r.returncode != 0
    assert b"lowest" in r.stderr, r.stderr[-2000:]
