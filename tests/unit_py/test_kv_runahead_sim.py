"""Tests for bench/kv_runahead_sim.py (a modeled, not measured, KV-Runahead prefill TTFT).

Run: .venv/bin/python -m pytest tests/unit_py -q   (ctest registers it as unit_py.pytest)
Needs only the standard library, numpy and pytest.
"""

import importlib.util
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "kv_runahead_sim.py"


def _load():
    spec = importlib.util.spec_from_file_location("kv_runahead_sim", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


M = _load()
MODEL = M.LLAMA_7B
DEVICE = M.Device("test", gemm_flops=170e12, attention_flops=26e12, layer_overhead_s=1e-4)
FAST = M.LINKS["300GB/s"]
SLOW = M.LINKS["10GB/s"]


@pytest.mark.parametrize("c", [1, 512, 4096, 16384])
def test_chain_of_one_rank_is_the_single_device(c):
    assert M.chain_ttft(MODEL, DEVICE, SLOW, [0, c]) == pytest.approx(M.single_ttft(MODEL, DEVICE, c), rel=1e-12)
    assert M.tsp_ttft(MODEL, DEVICE, SLOW, c, 1) == pytest.approx(M.single_ttft(MODEL, DEVICE, c), rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("c", [2048, 8192, 16384])
def test_chain_never_beats_the_lower_bound(p, c):
    single = M.single_ttft(MODEL, DEVICE, c)
    best = M.search_partition(c, p, lambda b: M.chain_ttft(MODEL, DEVICE, M.NO_COMM, b))
    assert best["best_ttft_s"] >= M.lower_bound(single, p)
    # ... and with infinite bandwidth, parallel prefill does beat one device.
    assert best["best_ttft_s"] < single
    # a real link only adds time
    assert M.chain_ttft(MODEL, DEVICE, SLOW, best["best"]) >= best["best_ttft_s"]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_tsp_traffic_is_twice_the_even_chain(p):
    c = 8192
    assert M.tsp_traffic_tokens(c, p) == pytest.approx(2 * M.chain_traffic_tokens(M.even_bounds(c, p)))


def test_batch_and_single_evaluation_agree():
    rows = [[0, 4096, 8192], [0, 5000, 8192], [0, 6000, 8192]]
    batch = M.chain_ttft(MODEL, DEVICE, SLOW, rows)
    for r, t in zip(rows, batch):
        assert M.chain_ttft(MODEL, DEVICE, SLOW, r) == pytest.approx(t, rel=1e-12)


def test_slower_links_and_noise_only_slow_things_down():
    c, p = 8192, 4
    even = M.even_bounds(c, p)
    assert M.chain_ttft(MODEL, DEVICE, SLOW, even) > M.chain_ttft(MODEL, DEVICE, FAST, even)
    assert M.tsp_ttft(MODEL, DEVICE, SLOW, c, p) > M.tsp_ttft(MODEL, DEVICE, FAST, c, p)
    for seed in range(3):
        assert M.chain_ttft(MODEL, DEVICE, SLOW, even, M.Noise(seed)) >= M.chain_ttft(MODEL, DEVICE, SLOW, even)
        assert M.tsp_ttft(MODEL, DEVICE, SLOW, c, p, M.Noise(seed)) >= M.tsp_ttft(MODEL, DEVICE, SLOW, c, p)


def _brute_force(c, p, step, measure):
    best = None
    for inner in itertools.combinations(range(step, c, step), p - 1):
        b = (0, *inner, c)
        t = float(measure(np.array([b]))[0])
        if best is None or t < best[1]:
            best = (b, t)
    return best


@pytest.mark.parametrize("p", [2, 3, 4])
def test_search_finds_the_brute_force_optimum(p):
    c, g = 2048, 64
    def measure(b):
        return M.chain_ttft(MODEL, DEVICE, SLOW, b)

    found = M.search_partition(c, p, measure, granularity=g)
    _, brute_ttft = _brute_force(c, p, g, measure)
    assert found["best_ttft_s"] <= brute_ttft * 1.005
    assert found["measurements"] < math.comb(c // g - 1, p - 1)
    assert found["even_ttft_s"] == pytest.approx(M.chain_ttft(MODEL, DEVICE, SLOW, M.even_bounds(c, p)))
    assert found["best_ttft_s"] <= found["even_ttft_s"]


def test_search_caches_repeated_partitions():
    seen = []

    def measure(b):
        seen.extend(tuple(r) for r in b)
        return M.chain_ttft(MODEL, DEVICE, FAST, b)

    found = M.search_grid(4096, 3, measure, granularity=64)
    assert len(seen) == len(set(seen)) == found["measurements"]


def test_fractions_and_interpolation():
    assert M.bounds_from_fractions([0.350, 0.255, 0.210, 0.185], 10240) == [0, 3584, 6195, 8346, 10240]
    assert M.bounds_from_fractions([0.98, 0.01, 0.01], 10) == [0, 8, 9, 10]
    table = {8192: [0.34, 0.26, 0.22, 0.18], 12288: [0.36, 0.25, 0.20, 0.19]}
    assert M.interpolate_fractions(table, 10240) == pytest.approx([0.35, 0.255, 0.21, 0.185])
    assert M.interpolate_fractions(table, 1024) == table[8192]
    assert M.interpolate_fractions(table, 99999) == table[12288]
    assert M.fractions_of([0, 9728, 16384]) == pytest.approx([9728 / 16384, 6656 / 16384])


def test_fit_recovers_a_known_device():
    runs = [(c, M.single_ttft(MODEL, DEVICE, c)) for c in (1024, 2048, 4096, 8192)]
    dev, residuals = M.fit_device(MODEL, runs, "fitted")
    assert dev.gemm_flops == pytest.approx(DEVICE.gemm_flops, rel=1e-6)
    assert dev.attention_flops == pytest.approx(DEVICE.attention_flops, rel=1e-6)
    assert dev.layer_overhead_s == pytest.approx(DEVICE.layer_overhead_s, rel=1e-6)
    for r in residuals:
        assert r["fitted_s"] == pytest.approx(r["measured_s"], rel=1e-9)


def test_calibration_file_fits_single_rank_and_checks_the_chain(tmp_path):
    tiny = M.ModelShape("tiny", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=1000,
                        bytes_per_element=4)
    cpu = M.Device("cpu", gemm_flops=50e9, attention_flops=10e9, layer_overhead_s=2e-4)
    link = M.Link(5e9, 1e-5)
    bounds = [0, 1200, 2048]
    doc = {"format": "kvflow-kvr-calibration", "version": 1, "device": "test cpu",
           "model": {"name": "tiny", "layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64,
                     "intermediate": 768, "vocab": 1000, "bytes_per_element": 4},
           "link": {"bandwidth_bytes_per_s": 5e9, "latency_s": 1e-5},
           "single_rank": [{"context_len": c, "ttft_s": M.single_ttft(tiny, cpu, c)} for c in (256, 512, 1024, 2048)],
           "chain": [{"num_ranks": 2, "context_len": 2048, "bounds": bounds, "compute_share": 0.5,
                      "ttft_s": M.chain_ttft(tiny, cpu.scaled(0.5), link, bounds)}]}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    loaded, model = M.load_calibration(path)
    assert model == tiny
    fit = M.fit_calibration(loaded, model)
    assert fit["chain_check"][0]["relative_error"] == pytest.approx(0.0, abs=1e-9)

    path.write_text(json.dumps({**doc, "format": "other"}))
    with pytest.raises(ValueError):
        M.load_calibration(path)
