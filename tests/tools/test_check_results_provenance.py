"""tools/check-results-provenance on folders made here: it fails listing each file without the four
keys, passes when all have them, and --recover adds one marked as recovered without touching a figure.
ctest runs the checker itself on bench/results (tools.results_provenance)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tools" / "check-results-provenance"
GOOD = {"command": "bench/x.py --out y", "commit": "abc1234", "date": "2026-01-01T00:00:00Z",
        "machine": {"cpu": "c", "cores": 2, "memory_gib": 4.0, "gpu": None}}


def check(d, *extra):
    return subprocess.run([sys.executable, str(CHECK), "--dir", str(d), *extra], capture_output=True, text=True)


def test_fails_listing_every_file_without_provenance(tmp_path):
    (tmp_path / "ok.json").write_text(json.dumps({"provenance": GOOD, "rows": [1]}))
    (tmp_path / "none.json").write_text(json.dumps({"rows": [1]}))
    (tmp_path / "partial.json").write_text(json.dumps({"provenance": {**GOOD, "commit": ""}}))
    (tmp_path / "list.json").write_text(json.dumps([{"a": 1}]))
    r = check(tmp_path)
    assert r.returncode == 1
    assert "none.json: provenance lacks command, commit, date, machine" in r.stderr
    assert "partial.json: provenance lacks commit" in r.stderr
    assert "list.json: a list without a provenance file beside it (list.provenance.json)" in r.stderr
    assert "ok.json" not in r.stderr
    assert "3 of 4 results files" in r.stderr


def test_passes_when_every_file_has_the_four_keys(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"provenance": GOOD}))
    r = check(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "all 1 results files carry provenance" in r.stdout


def test_recover_marks_the_provenance_and_keeps_the_figures(tmp_path):
    doc = {"command": "build/bench/b --json x.json", "cpu": "AMD EPYC", "rows": [{"tok_s": 81.5}]}
    (tmp_path / "old.json").write_text(json.dumps(doc))
    r = check(tmp_path, "--recover")
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "old.json").read_text())
    p = out["provenance"]
    assert p["source"] == "recovered from git history, not re-run"
    assert p["command"] == doc["command"]
    assert p["machine"] == {"cpu": "AMD EPYC"}
    assert p["commit"].startswith("not recorded")  # a temporary folder is not in git history
    assert p["date"] == "not recorded" and p["per_run_figures"] == "not recorded"
    assert {k: v for k, v in out.items() if k != "provenance"} == doc
    assert check(tmp_path).returncode == 0
