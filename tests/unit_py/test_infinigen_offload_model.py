"""Tests for bench/infinigen_offload_model.py (a modeled, not measured, offload latency).

Run: .venv/bin/python -m pytest tests/unit_py -q   (ctest registers it as unit_py.pytest)
Needs only the standard library and pytest; the plot is skipped without matplotlib.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "infinigen_offload_model.py"


def _load():
    spec = importlib.util.spec_from_file_location("infinigen_offload_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


M = _load()


def params(f=0.1, r=0.3, h=0.2):
    return {"selection_fraction": f, "partial_ratio": r, "h2o_budget": h, "source": "test", "origin": "test"}


LINKS = [M.PCIE[k]["effective_bw"] for k in M.PCIE]


@pytest.mark.parametrize("model", sorted(M.MODELS))
@pytest.mark.parametrize("bw", LINKS)
def test_full_offload_grows_linearly_with_context(model, bw):
    m = M.MODELS[model]
    ns = [1024, 2048, 3072, 4096, 8192]
    steps = [M.decode_step(m, "flexgen", 20, n, bw, params()) for n in ns]
    # bytes moved: exactly proportional to the context
    per_token = steps[0]["kv_h2d_bytes"] / ns[0]
    assert per_token == pytest.approx(m["layers"] * 2 * m["kv_heads"] * m["head_dim"] * 2 * 20)
    for n, st in zip(ns, steps):
        assert st["kv_h2d_bytes"] == pytest.approx(per_token * n, rel=1e-12)
    # time: affine in n (transfer bound here), i.e. constant slope
    slopes = [(b["time_s"] - a["time_s"]) / (nb - na) for a, b, na, nb in zip(steps, steps[1:], ns, ns[1:])]
    for s in slopes:
        assert s > 0
        assert s == pytest.approx(slopes[0], rel=1e-6)


@pytest.mark.parametrize("model", sorted(M.MODELS))
@pytest.mark.parametrize("bw", LINKS)
@pytest.mark.parametrize("batch", [1, 8, 20])
def test_infinigen_at_full_fraction_is_never_faster_than_full_offload(model, bw, batch):
    m = M.MODELS[model]
    for n in [128, 512, 2048, 8192]:
        ig = M.decode_step(m, "infinigen", batch, n, bw, params(f=1.0))
        fg = M.decode_step(m, "flexgen", batch, n, bw, params())
        assert ig["time_s"] >= fg["time_s"]
        assert ig["kv_h2d_bytes"] == pytest.approx(fg["kv_h2d_bytes"])
    ig = M.end_to_end(m, "infinigen", batch, 1920, 128, bw, params(f=1.0))
    fg = M.end_to_end(m, "flexgen", batch, 1920, 128, bw, params())
    assert ig["e2e_s"] >= fg["e2e_s"]


@pytest.mark.parametrize("model", sorted(M.MODELS))
def test_infinigen_moves_the_fraction_plus_layer_zero(model):
    m = M.MODELS[model]
    L = m["layers"]
    for n in [512, 2048]:
        ig = M.decode_step(m, "infinigen", 20, n, LINKS[0], params(f=0.1))
        fg = M.decode_step(m, "flexgen", 20, n, LINKS[0], params())
        ratio = ig["kv_h2d_bytes"] / fg["kv_h2d_bytes"]
        assert ratio == pytest.approx((1 + 0.1 * (L - 1)) / L, rel=1e-12)
        assert 0.1 < ratio < 0.1 + 1.0 / L + 1e-12


def test_time_is_monotone_in_fraction_and_h2o_gpu_moves_nothing():
    m = M.MODELS["opt-13b"]
    ts = [M.decode_step(m, "infinigen", 20, 2048, LINKS[0], params(f=f))["time_s"]
          for f in [0.01, 0.05, 0.1, 0.2, 0.5, 1.0]]
    assert ts == sorted(ts)
    assert M.decode_step(m, "h2o_gpu", 20, 2048, LINKS[0], params())["h2d_bytes"] == 0


def test_weights_fit_on_the_paper_gpu_and_int4_bytes():
    for m in M.MODELS.values():
        assert M.weight_offload_fraction(m, "flexgen", 20, 2048, params()) == 0.0
    assert M.total_params(M.MODELS["opt-13b"]) == pytest.approx(12.85e9, rel=0.01)
    assert M.total_params(M.MODELS["llama-2-7b"]) == pytest.approx(6.74e9, rel=0.01)
    assert M.INT4_BYTES_PER_ELEM == pytest.approx(0.5625)


def _run_cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _check_outputs(prefix):
    doc = json.loads(Path(str(prefix) + ".json").read_text())
    for k in ["modeled", "note", "inputs", "assumptions", "constants", "paper", "results", "seq_sweep",
              "fraction_sweep", "paper_fig16a_check"]:
        assert k in doc, k
    assert doc["modeled"] is True and doc["paper"]["modeled"] is False
    for k in ["selection_fraction", "partial_ratio", "h2o_budget_fraction", "source", "batch", "prompt", "gen"]:
        assert k in doc["inputs"], k
    assert {a["quantity"] for a in doc["assumptions"]} >= {"GPU", "PCIe 3.0 x16", "PCIe 4.0 x16", "UVM", "INT4"}
    assert {(r["model"], r["link"]) for r in doc["results"]} == {(m, l) for m in M.MODELS for l in M.PCIE}
    for r in doc["results"]:
        assert r["modeled"] is True
        assert set(r["schemes"]) == set(M.SCHEMES)
        for s in r["schemes"].values():
            assert s["modeled"] is True
            for k in ["decode_ms_per_step_mean", "e2e_s", "prefill_s", "infinigen_speedup_e2e", "fits_gpu"]:
                assert k in s, k
            assert math.isfinite(s["e2e_s"]) and s["e2e_s"] > 0
    for e in doc["seq_sweep"] + doc["fraction_sweep"]:
        assert e["modeled"] is True
    md = Path(str(prefix) + ".md").read_text()
    assert "MODELED" in md and "**paper**" in md and "InfiniGen speed-up" in md
    return doc, md


def test_cli_writes_documented_outputs(tmp_path):
    p = _run_cli("--fraction", "0.1", "--no-plot", "--out-prefix", str(tmp_path / "m"))
    assert p.returncode == 0, p.stderr
    doc, md = _check_outputs(tmp_path / "m")
    assert doc["inputs"]["selection_fraction"] == 0.1
    assert "placeholder" in doc["inputs"]["source"]
    assert "| OPT-13B | PCIe 3.0 x16 | InfiniGen |" in p.stdout


def test_cli_reads_a_fractions_file(tmp_path):
    f = tmp_path / "fr.json"
    f.write_text(json.dumps({"selection_fraction": 0.07, "partial_ratio": 0.25, "h2o_budget_fraction": 0.1,
                             "source": "unit test", "extra": [1, 2]}))
    p = _run_cli("--fractions", str(f), "--sweep-fractions", "--no-plot", "--out-prefix", str(tmp_path / "m"))
    assert p.returncode == 0, p.stderr
    doc, md = _check_outputs(tmp_path / "m")
    inp = doc["inputs"]
    assert (inp["selection_fraction"], inp["partial_ratio"], inp["h2o_budget_fraction"]) == (0.07, 0.25, 0.1)
    assert inp["source"] == "unit test" and inp["fractions_file_raw"]["extra"] == [1, 2]
    assert "vs selection fraction" in md


@pytest.mark.parametrize("content", [
    {"selection_fraction": 0.0}, {"selection_fraction": 1.5}, {"selection_fraction": -0.1},
    {"selection_fraction": "0.1"}, {"selection_fraction": True}, {"partial_ratio": 0.3},
    {"selection_fraction": 0.1, "partial_ratio": 0}, {"selection_fraction": 0.1, "h2o_budget_fraction": 2},
    {"selection_fraction": 0.1, "source": 3}, [0.1], "not json",
])
def test_bad_fractions_file_is_a_clear_error(tmp_path, content):
    f = tmp_path / "fr.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    p = _run_cli("--fractions", str(f), "--no-plot", "--out-prefix", str(tmp_path / "m"))
    assert p.returncode == 2
    assert "error:" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("args", [
    ["--fractions", "/nonexistent/fractions.json"],
    ["--fraction", "0"], ["--fraction", "1.01"], ["--fraction", "nan"], ["--fraction", "-1"],
    ["--fraction", "0.1", "--partial-ratio", "1.5"], ["--fraction", "0.1", "--h2o-budget", "0"],
    ["--fraction", "0.1", "--gen", "1"],
    [],
])
def test_bad_arguments_are_a_clear_error(tmp_path, args):
    p = _run_cli(*args, "--no-plot", "--out-prefix", str(tmp_path / "m"))
    assert p.returncode == 2
    assert "error" in p.stderr and "Traceback" not in p.stderr


def test_plot_is_skipped_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    doc = {"seq_sweep": [], "fraction_sweep": [], "inputs": {}}
    assert M.plot(doc, str(tmp_path / "x.png")) is None
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
