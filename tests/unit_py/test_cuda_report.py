"""Tests for bench/cuda_report.py (plots kvflow_bench_cuda's measured JSON)."""
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "cuda_report.py"


def _load():
    spec = importlib.util.spec_from_file_location("cuda_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


M = _load()

RESULT = {
    "device": "test GPU",
    "copy_bandwidth_gbs": 4000.0,
    "cublas_fp16_gemm_tflops": 700.0,
    "decode_attention": [
        {"heads": 32, "kv_heads": 8, "head_dim": 128, "batch": 1, "context": 2048, "kv_read_mib": 8.0,
         "achieved_gbs": 800.0},
        {"heads": 32, "kv_heads": 8, "head_dim": 128, "batch": 1, "context": 512, "kv_read_mib": 2.0,
         "achieved_gbs": 250.0},
        {"heads": 32, "kv_heads": 32, "head_dim": 128, "batch": 256, "context": 32768, "kv_read_mib": 131072.0,
         "skipped": "KV does not fit the GPU"},
    ],
    "end_to_end": [
        {"shape": "llama-3.1-8b", "cuda_graphs": True, "batch": 16, "tokens_per_s": 2800.0, "roofline_ms": 4.0},
        {"shape": "llama-3.1-8b", "cuda_graphs": True, "batch": 1, "tokens_per_s": 200.0, "roofline_ms": 3.5},
        {"shape": "llama-3.1-8b", "cuda_graphs": False, "batch": 1, "tokens_per_s": 190.0, "roofline_ms": 3.5},
        {"shape": "llama-2-7b", "cuda_graphs": True, "batch": 256, "skipped": "needs 149 GiB"},
    ],
}


def test_decode_series_sorted_by_kv_and_skips_unmeasured():
    s = M.decode_series(RESULT)
    assert s == {(32, 8, 128, 1): [(2.0, 250.0), (8.0, 800.0)]}


def test_e2e_series_picks_graph_mode_and_computes_roofline_tokens():
    s = M.e2e_series(RESULT, graphs=True)
    assert list(s) == ["llama-3.1-8b"]
    (b1, t1, r1), (b16, t16, r16) = s["llama-3.1-8b"]
    assert (b1, t1, b16, t16) == (1, 200.0, 16, 2800.0)
    assert abs(r1 - 1 / 3.5e-3) < 1e-6 and abs(r16 - 16 / 4e-3) < 1e-6
    assert M.e2e_series(RESULT, graphs=False)["llama-3.1-8b"] == [(1, 190.0, 1 / 3.5e-3)]


def test_main_rejects_other_json(tmp_path):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"rows": []}))
    assert M.main([str(bad)]) == 2
    assert M.main([str(tmp_path / "missing.json")]) == 2


def test_main_plots_or_says_matplotlib_is_missing(tmp_path):
    src = tmp_path / "cuda_test.json"
    src.write_text(json.dumps(RESULT))
    rc = M.main([str(src)])
    png = tmp_path / "cuda_test.png"
    assert (rc == 0 and png.stat().st_size > 1000) or (rc == 77 and not png.exists())
