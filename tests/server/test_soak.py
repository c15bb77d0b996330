"""Runs tools/soak-server briefly: mixed, cancelled and malformed requests from 8 workers must
leave the server alive, idle, with every KV block free and its RSS flat."""

import json
import subprocess
import sys

from conftest import REPO


def test_soak_short(server_bin, tmp_path):
    summary_path = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "tools" / "soak-server"), "--server", server_bin,
           "--model", "tiny-random", "--requests", "300", "--concurrency", "8", "--seed", "1",
           "--max-seconds", "240", "--json", str(summary_path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"soak-server failed:\n{r.stdout}\n{r.stderr}"
    summary = json.loads(summary_path.read_text())
    assert summary["passed"] and not summary["failures"]
    assert summary["requests_done"] == 300
    assert summary["cancelled"] > 0 and summary["malformed_rejected"] > 0
    assert summary["outcomes"].get("ok", 0) > 200
    assert summary["server_exit_code"] == 0
