"""kvflow-server under mpirun with --tensor-parallel-size 2 and with --pipeline-parallel-size 2:
rank 0 serves HTTP, schedules and samples; rank 1 runs its share of every step (its heads, or the
second half of the layers). Completions (greedy, seeded sampling, n=2, and under pipeline
parallelism concurrent requests, whose steps overlap as batches in flight) equal a single-process
server's, /metrics shows the ranks' communication and each rank's own time, and SIGTERM to mpirun stops the job with the
worker told to stop."""

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MPI_ENV, MPIRUN, TINY, start_server

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (tools/install-deps installs Open MPI)")

COMMON = ["--block-size", "16", "--max-model-len", "512", "--threads", "1"]
PROMPT = "Tensor parallelism splits each layer's heads across the ranks. "


def completion(srv, prompt, **extra):
    body = dict({"model": TINY, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}, **extra)
    r = srv.post("/v1/completions", body)
    assert r.status == 200, r
    return r.json()


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_split_server_equals_one_process(server_bin, make_server, split):
    flag = f"--{split}-parallel-size"
    srv = start_server(server_bin, ["--model", TINY, *COMMON, flag, "2"], env=MPI_ENV,
                       name=f"mpirun kvflow-server {flag} 2", launcher=[MPIRUN, "-np", "2", "--oversubscribe"])
    try:
        assert any(f"{split} parallel 2 over 2 ranks" in line for line in srv.lines), srv.log()
        ref = make_server(*COMMON)
        for prompt in (PROMPT, PROMPT * 3, "short"):
            assert completion(srv, prompt)["choices"][0]["text"] == completion(ref, prompt)["choices"][0]["text"]
        sampled = dict(temperature=0.8, top_p=0.95, seed=7, n=2)
        ours = [c["text"] for c in completion(srv, PROMPT, **sampled)["choices"]]
        assert ours == [c["text"] for c in completion(ref, PROMPT, **sampled)["choices"]]
        if split == "pipeline":
            # Concurrent requests: rank 0 starts the next step on the others while one is in flight.
            prompts = [PROMPT * (1 + i % 3) + str(i) for i in range(6)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                texts = list(pool.map(lambda p: completion(srv, p)["choices"][0]["text"], prompts))
            assert texts == [completion(ref, p)["choices"][0]["text"] for p in prompts]
        m = srv.wait_idle()
        assert m.get("kvflow:model_parallel_steps_total") > 0
        assert m.get("kvflow:model_parallel_step_seconds_total") > 0
        if split == "tensor":
            assert m.get("kvflow:tensor_parallel_ranks") == 2 and m.get("kvflow:pipeline_parallel_stages") == 1
            assert m.get("kvflow:tensor_parallel_all_reduce_seconds_total") > 0
        else:
            assert m.get("kvflow:pipeline_parallel_stages") == 2 and m.get("kvflow:tensor_parallel_ranks") == 1
            assert m.get("kvflow:pipeline_parallel_residual_bytes_total") > 0
            # Two batches in flight (one a stage), a micro-batch a step; the concurrent requests' steps overlapped.
            assert m.get("kvflow:pipeline_parallel_batches_in_flight") == 2
            assert m.get("kvflow:pipeline_parallel_microbatches_total") == m.get("kvflow:model_parallel_steps_total")
            assert m.get("kvflow:pipeline_parallel_overlapped_steps_total") > 0
        # Each rank's own time, labelled by its place in the grid (rank 1: tensor rank 1 of stage 0, or stage 1).
        where = {"tensor": dict(stage="0", tensor_rank="1"), "pipeline": dict(stage="1", tensor_rank="0")}[split]
        for rank, labels in (("0", dict(stage="0", tensor_rank="0")), ("1", where)):
            assert m.get("kvflow:model_parallel_rank_microbatches_total", rank=rank, **labels) > 0, m
            assert m.get("kvflow:model_parallel_rank_forward_seconds_total", rank=rank, **labels) > 0
        if split == "tensor":
            assert m.get("kvflow:model_parallel_rank_all_reduce_seconds_total", rank="1", **where) > 0
        else:
            assert m.get("kvflow:model_parallel_rank_residual_wait_seconds_total", rank="1", **where) > 0
        srv.stop(signal.SIGTERM, timeout=40)
        log = srv.log(400)
        assert "model parallel worker" in log and "stopped after" in log, log  # rank 1 was told to stop
        assert "] stopped:" in log, log  # rank 0 shut down as usual
    finally:
        srv.close()


def test_refuses_a_split_the_model_cannot_take(server_bin):
    # tiny-random has 2 attention heads: 3 ranks cannot split them; the whole job ends with the reason.
    with pytest.raises(RuntimeError, match="does not divide the model's 2 attention heads"):
        start_server(server_bin, ["--model", TINY, *COMMON, "--tensor-parallel-size", "3"], env=MPI_ENV,
                     name="mpirun kvflow-server --tp 3", launcher=[MPIRUN, "-np", "3", "--oversubscribe"])
    # A job of another size than tp x pp.
    with pytest.raises(RuntimeError, match="needs a job of 4 ranks"):
        start_server(server_bin, ["--model", TINY, *COMMON, "--tp", "2", "--pp", "2"], env=MPI_ENV,
                     name="mpirun -np 2 kvflow-server --tp 2 --pp 2", launcher=[MPIRUN, "-np", "2", "--oversubscribe"])
