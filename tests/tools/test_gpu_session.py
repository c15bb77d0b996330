"""tools/gpu-session and tools/prepare-gpu-session on a machine without a GPU (what CI has).

Proves, without a GPU:
  - a dry run ends in seconds with a valid, complete summary.json whose stage 0 says no GPU;
  - the bundle built from this build fits the device tool's 64 MiB with the tree, and every binary in
    it starts with the carried libraries alone (tools/check-gpu-session-bundle, system copies hidden);
  - a hung test (KVFLOW_GPU_SESSION_HANG) is cut at its cap and the later tests and stages still run;
  - a hang longer than the whole deadline is cut by the deadline, the stages after it are recorded as
    skipped, and summary.json is complete before the deadline.

ctest registers this as tools.gpu_session (KVFLOW_BUILD_DIR: a build with CUDA, so the
kvflow_gpu_* binaries exist; they skip themselves without a GPU).
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SESSION = REPO / "tools" / "gpu-session"
PREPARE = REPO / "tools" / "prepare-gpu-session"
BUILD = Path(os.environ.get("KVFLOW_BUILD_DIR", REPO / "build"))

if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
    pytest.skip("a GPU is visible here: these are the no-GPU dry-run checks", allow_module_level=True)


def run_session(tmp, *args, env=None, timeout=300):
    out = tmp / "out"
    t = time.monotonic()
    p = subprocess.run([sys.executable, str(SESSION), "--out", str(out), "--work", str(tmp / "work"), *args],
                       capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout, cwd=REPO)
    secs = time.monotonic() - t
    summary = json.loads((out / "summary.json").read_text())
    return p, summary, secs, out


def stage(summary, name):
    (s,) = [s for s in summary["stages"] if s["name"] == name]
    return s


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    if not list(BUILD.glob("tests/cuda/kvflow_gpu_*")):
        pytest.skip(f"no kvflow_gpu_* binaries in {BUILD} (a build without CUDA)")
    d = tmp_path_factory.mktemp("bundle") / "gpu-session"
    p = subprocess.run(["bash", str(PREPARE), "--no-build", "--no-wheels", "--build-dir", str(BUILD), "--out", str(d),
                        "--jobs", "2", "--fast-xz"],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    print(p.stdout[-3000:], p.stderr[-3000:])
    assert p.returncode == 0, p.stderr
    return d, p.stdout


def test_dry_run_without_gpu_ends_in_seconds(tmp_path):
    p, summary, secs, out = run_session(tmp_path, "--bundle", str(tmp_path / "none"), "--build-dir",
                                        str(tmp_path / "none"), "--deadline", "60")
    assert p.returncode == 0, p.stdout + p.stderr
    assert secs < 30
    assert summary["complete"] is True and summary["result"] == "no_gpu"
    assert [s["name"] for s in summary["stages"]] == ["smoke", "build", "kernels", "backend", "bench", "sanitizer"]
    smoke = stage(summary, "smoke")
    assert smoke["status"] == "no_gpu"
    assert smoke["figures"]["gpu"] is None
    assert smoke["figures"]["versions"]["glibc"]
    for s in summary["stages"][1:]:
        assert s["status"] == "skipped" and s["reason"]
    assert (out / "log.txt").read_text().count("== stage") >= 6
    assert (out / "details.tar.gz").stat().st_size > 0
    assert len(list(out.iterdir())) <= 8  # the device tool brings back at most 8 files


def test_bundle_fits_and_starts_with_carried_libraries(bundle):
    d, stdout = bundle
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["binaries"] and any(b.startswith("kvflow_gpu_") for b in manifest["binaries"])
    assert any(lib.startswith("libcudart.so") for lib in manifest["system_cuda_libs"])
    assert manifest["glibcxx_needed"].startswith("GLIBCXX_3.4")
    # "together N MiB of 64 MiB" and "K of K binaries start with the carried libraries"
    line = [l for l in stdout.split("\n") if "together" in l][0]
    together = float(line.split("together ")[1].split(" MiB")[0])
    assert together < 64
    (started,) = [l for l in stdout.split("\n") if "binaries start with the carried libraries" in l]
    k, _, n = started.split(": ")[1].split(" binaries")[0].partition(" of ")
    assert int(k) == int(n) == len(manifest["binaries"])
    if os.geteuid() == 0:
        assert "system copies of carried libraries hidden" in stdout


def test_hung_test_is_cut_at_its_cap_and_the_rest_runs(tmp_path, bundle):
    d, _ = bundle
    p, summary, secs, out = run_session(tmp_path, "--force", "--bundle", str(d), "--deadline", "200",
                                        "--cap", "kernel_test=6", "--stages", "smoke,kernels,backend,bench,sanitizer",
                                        env={"KVFLOW_GPU_SESSION_HANG": "fill"})
    assert summary["complete"] is True
    kernels = stage(summary, "kernels")
    fams = kernels["figures"]["families"]
    assert fams["fill"]["status"] == "timeout"
    assert 5 <= fams["fill"]["seconds"] < 20
    others = [f for f in fams if f != "fill"]
    assert len(others) >= 5
    for f in others:  # without a GPU every test skips itself, but it ran and wrote its JSON
        assert fams[f]["status"] in ("skipped", "ok"), (f, fams[f])
        assert fams[f].get("tests", 0) > 0, (f, fams[f])
    assert kernels["status"] == "failed" and "fill" in kernels["reason"]
    for name in ("backend", "bench", "sanitizer"):
        assert stage(summary, name)["status"] != "running"
    assert secs < 200
    assert summary["result"] == "failed" and p.returncode == 1


def test_hang_past_the_deadline_leaves_a_complete_summary(tmp_path, bundle):
    d, _ = bundle
    deadline = 25
    p, summary, secs, out = run_session(tmp_path, "--force", "--bundle", str(d), "--deadline", str(deadline),
                                        "--cap", "kernel_test=1000", "--cap", "kernels=1000",
                                        env={"KVFLOW_GPU_SESSION_HANG": "activation"})
    assert secs < deadline + 5
    assert summary["complete"] is True
    fams = stage(summary, "kernels")["figures"]["families"]
    assert fams["activation"]["status"] == "timeout"
    later = [s for s in summary["stages"] if s["stage"] > 2]
    assert later and all(s["status"] == "skipped" for s in later)
    assert all("deadline" in s["reason"] or "cap" in s["reason"] for s in later)
