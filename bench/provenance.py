"""Provenance every bench/results/*.json carries: how it was made, from which tree, when, on what.

    from provenance import provenance
    doc["provenance"] = provenance()              # the argv of this process
    doc["provenance"] = provenance(per_run_figures="rows[].runs")  # extra keys pass through

command: the argv as run; commit: `git rev-parse --short HEAD`, "-dirty" when tracked files
differ from it; date: UTC ISO-8601; machine: facts that do not name the host (CPU model, cores,
memory, GPU if any). tools/check-results-provenance checks the four keys.
"""
import datetime
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args):
    try:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit():
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown (no git)"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "")


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


def _memory_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _gpus():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return [l.strip() for l in out.stdout.splitlines() if l.strip()] if out.returncode == 0 else []


def machine():
    gpus = _gpus()
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
            "gpu": ", ".join(gpus) if gpus else None}


def command(argv=None):
    argv = sys.argv if argv is None else argv
    return " ".join(shlex.quote(a) for a in argv)


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance(argv=None, **extra):
    """The provenance object; `extra` (e.g. per_run_figures="...") is added as is."""
    p = {"command": command(argv), "commit": commit(), "date": now_iso(), "machine": machine()}
    p.update(extra)
    return p
