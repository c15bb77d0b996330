#!/usr/bin/env python3
"""kvflow's CPU backend against llama.cpp on the same GGUF file and thread count, in one run.

llama.cpp is the peer to beat on a CPU. This script fetches a pinned llama.cpp (the source that the
PyPI package llama-cpp-python vendors), builds llama-bench, llama-server and llama-perplexity once
into an ignored cache (.cache/llama-cpp/), then measures both engines back to back:

  decode    decode tok/s of one sequence at KV depth 0, 1K, 4K and ~8K
            llama.cpp: llama-bench -p 0 -n 64 -d DEPTH -r 3; kvflow: kvflow bench -d DEPTH -n 64 -r 3
            (kvflow also in --dtype f32, its exact fp32 mode, at depth 0 as a reference row; and both
            engines on one thread at depth 0, a thread-scaling check: on a busy machine llama.cpp's
            OpenMP barriers can make T threads slower than one)
  prefill   prefill tok/s of a 512- and a 4096-token prompt
            llama-bench -p 512,4096 -n 0; kvflow bench -d 512,4096 -n 0
  ppl       WikiText-2 test perplexity, llama.cpp's way (score the second half of each 512-token chunk)
            llama-perplexity -c 512 --chunks N; kvflow perplexity --method second-half --ctx 512 --max-windows N
  greedy    the same prompts through both servers at temperature 0 (up to 32 tokens, one at a time): how many
            continuations are identical and how long the agreeing prefixes are
  server    both OpenAI servers under the same closed-loop load: 1, 4, 16 and 64 streams, each sending
            streamed /v1/completions (Alpaca prompts, max_tokens 64, temperature 0, ignore_eos) back to
            back for a fixed time; output tok/s, time to first token and latency (median, p90)

Every decode number is also put against the memory roofline: the measured read bandwidth of this
machine (the higher of numpy sums over 512 MiB and kvflow_bench_attention's compiled reader, medians
of repeats) over the bytes a decode step reads per token
(the GGUF's weight matrices + the KV cache at that depth: f16 in both by default; fp32 in kvflow's
exact f32 mode).

Run it from the repository root after building kvflow (`make -C build kvflow_cli kvflow_server_bin`),
on a quiet machine (the numbers are only as good as the machine is idle; the report flags a load
average over 0.5):

  .venv/bin/python bench/llama_cpp_compare.py                       # everything, ~40 min on 2 cores
  .venv/bin/python bench/llama_cpp_compare.py --quick --out-prefix /tmp/cmp    # smoke test, a few min
  .venv/bin/python bench/llama_cpp_compare.py --sections decode,prefill --skip-build

Most of the time goes to prefilling the deep decode depths (every repeat prefills again, untimed
in llama-bench, timed as prefill in kvflow bench); --depths, --repeats and --concurrency shorten it.
The first run also downloads llama-cpp-python's sdist with pip and builds llama.cpp (~20 min on 2
cores, under `nice`); later runs reuse the build when the version and flags match. Writes
OUT.json, OUT.md and OUT.png (the plot needs matplotlib; skipped with a message without it), where
OUT is --out-prefix (default bench/results/llama_cpp_compare). Not part of CI.
"""
import argparse
import datetime
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

from provenance import provenance

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache", "llama-cpp")
DEFAULT_LLAMA_CPP_PYTHON = "0.3.36"  # vendors ggml-org/llama.cpp@0c1e57098 (its CHANGELOG says)
SECTIONS = ("decode", "prefill", "ppl", "greedy", "server")

# The build: portable x86-64 with the AVX-512 family this VM has; AMX off (the CPU reports it, the VM
# traps it, so GGML_NATIVE=ON dies with an illegal instruction).
def cpu_isa_flags():
    """ggml's instruction-set options, each ON exactly when this CPU has it (/proc/cpuinfo): a build
    for AVX-512 dies with SIGILL on an AVX2-only machine, and one without it is slow on an AVX-512 one."""
    try:
        with open("/proc/cpuinfo") as f:
            have = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        have = []
    options = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX512": "avx512f",
               "AVX512_VNNI": "avx512_vnni", "AVX512_VBMI": "avx512vbmi", "AVX512_BF16": "avx512_bf16"}
    return [f"-DGGML_{opt}={'ON' if flag in have else 'OFF'}" for opt, flag in options.items()]


LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", *cpu_isa_flags(),
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]
LLAMA_TARGETS = ("llama-bench", "llama-server", "llama-perplexity")

START = time.time()
COMMANDS = []  # every command run, for the report


def log(msg):
    el = time.time() - START
    print(f"[{int(el // 60):02d}:{int(el % 60):02d}] {msg}", flush=True)


class BenchError(RuntimeError):
    pass


def shell_join(cmd):
    return " ".join(c if re.fullmatch(r"[\w@%+=:,./-]+", c) else "'" + c.replace("'", "'\\''") + "'" for c in cmd)


def rel(path):
    """A path as the report shows it: relative to the repository when inside it."""
    p = os.path.abspath(path)
    return os.path.relpath(p, REPO) if p.startswith(REPO + os.sep) else p


def run(cmd, *, what, record=True, timeout=None, cwd=None, env=None):
    """Runs cmd, returns (stdout, stderr, seconds); raises BenchError with the output's tail on failure."""
    if record:
        COMMANDS.append(shell_join([rel(c) if os.path.isabs(c) else c for c in cmd]))
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                           errors="replace")
    except FileNotFoundError:
        raise BenchError(f"{what}: {cmd[0]} not found")
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: timed out after {timeout} s: {shell_join(cmd)}")
    if p.returncode != 0:
        tail = "\n".join((p.stdout + "\n" + p.stderr).strip().splitlines()[-25:])
        raise BenchError(f"{what} failed (exit {p.returncode}): {shell_join(cmd)}\n{tail}")
    return p.stdout, p.stderr, time.time() - t0


# ---------------------------------------------------------------------------------------------------
# llama.cpp: fetch and build

def llama_cpp_paths(version):
    src_root = os.path.join(CACHE, f"llama_cpp_python-{version}")
    return {
        "sdist": os.path.join(CACHE, f"llama_cpp_python-{version}.tar.gz"),
        "src_root": src_root,
        "src": os.path.join(src_root, "vendor", "llama.cpp"),
        "build": os.path.join(CACHE, f"build-{version}"),
        "bin": os.path.join(CACHE, f"build-{version}", "bin"),
    }


def vendored_commit(src_root, version):
    """The llama.cpp commit llama-cpp-python's CHANGELOG names for this version ('unknown' if none)."""
    try:
        text = open(os.path.join(src_root, "CHANGELOG.md"), encoding="utf-8").read()
    except OSError:
        return "unknown"
    m = re.search(r"^## \[" + re.escape(version) + r"\](.*?)(?=^## \[)", text, re.S | re.M)
    if m:
        c = re.search(r"llama\.cpp@([0-9a-f]{7,40})", m.group(1))
        if c:
            return c.group(1)
    return "unknown"


def download_sdist(project, version, path):
    """The sdist of project==version from PyPI into `path`, checked against PyPI's sha256. Not
    `pip download --no-binary :all:`, which builds every build dependency from source first to
    read the metadata (tens of minutes on 2 cores)."""
    import hashlib
    import urllib.request
    # The simple index (PEP 503) lists every file with its sha256 in the link's fragment.
    with urllib.request.urlopen(f"https://pypi.org/simple/{project}/", timeout=60) as r:
        index = r.read().decode()
    name = f"{project.replace('-', '_')}-{version}.tar.gz"
    links = re.findall(r'href="([^"]*/' + re.escape(name) + r'#sha256=([0-9a-f]{64}))"', index)
    if not links:
        raise BenchError(f"PyPI's simple index has no {name}")
    url, digest = links[0][0].split("#")[0], links[0][1]
    tmp = path + ".part"
    with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    with open(tmp, "rb") as f:
        got = hashlib.sha256(f.read()).hexdigest()
    if got != digest:
        os.remove(tmp)
        raise BenchError(f"{url}: sha256 {got} is not PyPI's {digest}")
    os.replace(tmp, path)


def ensure_llama_cpp(version, skip_build):
    """Returns {'bin': dir, 'version', 'commit'}; downloads and builds what is missing."""
    p = llama_cpp_paths(version)
    stamp_path = os.path.join(p["build"], "kvflow_build_stamp.json")
    binaries = [os.path.join(p["bin"], t) for t in LLAMA_TARGETS]
    have_binaries = all(os.access(b, os.X_OK) for b in binaries)
    if skip_build:
        if not have_binaries:
            raise BenchError(f"--skip-build, but {rel(p['bin'])} lacks {', '.join(LLAMA_TARGETS)}: "
                             "run once without --skip-build")
        commit = vendored_commit(p["src_root"], version)
        log(f"llama.cpp: using the existing build in {rel(p['bin'])} (--skip-build)")
        return {"bin": p["bin"], "version": version, "commit": commit}

    os.makedirs(CACHE, exist_ok=True)
    if not os.path.isfile(p["sdist"]):
        log(f"llama.cpp: downloading llama-cpp-python=={version} (sdist, with llama.cpp's source) into {rel(CACHE)}")
        download_sdist("llama-cpp-python", version, p["sdist"])
        if not os.path.isfile(p["sdist"]):
            raise BenchError(f"pip download did not produce {p['sdist']}")
    if not os.path.isdir(p["src"]):
        log(f"llama.cpp: unpacking {rel(p['sdist'])}")
        with tarfile.open(p["sdist"]) as tar:
            tar.extractall(CACHE)
        if not os.path.isdir(p["src"]):
            raise BenchError(f"{rel(p['sdist'])} has no vendor/llama.cpp")
    commit = vendored_commit(p["src_root"], version)
    flags = LLAMA_CMAKE_FLAGS + [f"-DLLAMA_BUILD_COMMIT={commit}",
                                 # the unpacked tree sits inside kvflow's git checkout: never ask git
                                 "-DGIT_EXECUTABLE=/bin/false"]
    stamp = {"llama_cpp_python": version, "llama_cpp_commit": commit, "cmake_flags": flags}
    try:
        old = json.load(open(stamp_path))
    except (OSError, ValueError):
        old = None
    if have_binaries and old == stamp:
        log(f"llama.cpp: build of {version} (llama.cpp {commit}) is cached in {rel(p['bin'])}")
        return {"bin": p["bin"], "version": version, "commit": commit}

    log(f"llama.cpp: configuring {rel(p['src'])} -> {rel(p['build'])}")
    cmake = shutil.which("cmake") or "cmake"
    run(["nice", cmake, "-S", p["src"], "-B", p["build"]] + flags, what="cmake configure (llama.cpp)")
    log(f"llama.cpp: building {', '.join(LLAMA_TARGETS)} (-j2 under nice; ~20 min on 2 cores)")
    run(["nice", cmake, "--build", p["build"], "--config", "Release", "-j2", "--target", *LLAMA_TARGETS],
        what="cmake build (llama.cpp)")
    missing = [b for b in binaries if not os.access(b, os.X_OK)]
    if missing:
        raise BenchError(f"the build did not produce {', '.join(rel(m) for m in missing)}")
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=1)
    return {"bin": p["bin"], "version": version, "commit": commit}


# ---------------------------------------------------------------------------------------------------
# The model file: shapes and bytes per decode token

# ggml type id -> (elements per block, bytes per block)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 30: ("BF16", 1, 2)}


def read_gguf(path):
    """The metadata scalars and the tensor table (name, ggml type, dims) of a GGUF file."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def rstr():
            return f.read(rd("Q")).decode("utf-8", "replace")

        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

        def value(t):
            if t in scalar:
                return rd(scalar[t])
            if t == 8:
                return rstr()
            if t == 9:
                et, n = rd("I"), rd("Q")
                if et in scalar:  # skip numeric arrays in one read
                    f.seek(n * struct.calcsize(scalar[et]), 1)
                else:
                    for _ in range(n):
                        value(et)
                return None
            raise BenchError(f"{path}: unknown GGUF value type {t}")

        if f.read(4) != b"GGUF":
            raise BenchError(f"{path} is not a GGUF file")
        rd("I")  # the format version
        n_tensors, n_kv = rd("Q"), rd("Q")
        meta = {}
        for _ in range(n_kv):
            key = rstr()
            meta[key] = value(rd("I"))
        tensors = []
        for _ in range(n_tensors):
            name = rstr()
            dims = [rd("Q") for _ in range(rd("I"))]
            ttype = rd("I")
            rd("Q")  # offset
            tensors.append((name, ttype, dims))
    return meta, tensors


def model_info(path):
    meta, tensors = read_gguf(path)
    arch = meta.get("general.architecture", "llama")
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)
    layers, heads = g("block_count"), g("attention.head_count")
    kv_heads, hidden = g("attention.head_count_kv", heads), g("embedding_length")
    head_dim = g("attention.key_length") or hidden // heads
    names = {t[0] for t in tensors}
    weight_bytes, params, types = 0, 0, {}
    for name, ttype, dims in tensors:
        if ttype not in GGML_TYPES:
            raise BenchError(f"{path}: tensor {name} has ggml type {ttype}, unknown to this script")
        tname, block, block_bytes = GGML_TYPES[ttype]
        n = 1
        for d in dims:
            n *= d
        if len(dims) < 2:
            continue  # norms: negligible, and not matrices
        nbytes = n // block * block_bytes
        if name == "token_embd.weight" and "output.weight" in names:
            # a lookup: a decode step reads one row; the output matrix is read whole instead
            nbytes, n = nbytes // dims[1], n // dims[1]
        weight_bytes += nbytes
        params += n
        types[tname] = types.get(tname, 0) + 1
    return {
        "file": rel(path), "name": meta.get("general.name", os.path.basename(path)), "arch": arch,
        "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "hidden": hidden,
        "context_length": g("context_length", 2048), "tensor_types": types,
        "decode_weight_bytes": weight_bytes,        # what one decode step reads of the GGUF's matrices
        "decode_weight_params": params,
        "kv_bytes_per_token_f32": 2 * layers * kv_heads * head_dim * 4,  # kvflow's KV cache
        "kv_bytes_per_token_f16": 2 * layers * kv_heads * head_dim * 2,  # llama.cpp's default KV cache
    }


# ---------------------------------------------------------------------------------------------------
# The machine

def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_info():
    mem = ""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    flags = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                fl = set(line.split(":", 1)[1].split())
                flags = " ".join(x for x in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512vbmi",
                                             "avx512_bf16", "amx_tile") if x in fl)
                break
    except OSError:
        pass
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "memory": mem, "simd": flags,
            "kernel": platform.release(), "load_avg_start": os.getloadavg()}


def measure_bandwidth(threads, mib=512, repeats=7):
    """Read bandwidth in GB/s: numpy sums over a float64 array of `mib` MiB, split over `threads`
    threads (numpy drops the GIL in reductions), median of repeats; and on one thread."""
    import numpy as np
    a = np.ones(mib * 2**20 // 8)
    parts = np.array_split(a, threads)

    def timed(parallel):
        times = []
        for _ in range(repeats):
            if parallel:
                ts = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            else:
                t0 = time.perf_counter()
                np.sum(a)
            times.append(time.perf_counter() - t0)
        return a.nbytes / statistics.median(times) / 1e9

    np.sum(a)  # touch every page first
    return {"threads": threads, "gbps": timed(True), "gbps_1_thread": timed(False), "mib": mib,
            "repeats": repeats, "method": f"numpy float64 sum over {mib} MiB, split over the threads, median"}


def measure_bandwidth_compiled(build_dir, threads):
    """Read bandwidth in GB/s from kvflow's compiled reader (kvflow_bench_attention's
    BM_ReadBandwidth: every thread sums its share of a 256 MiB buffer, median of passes), or None
    when the benchmarks are not built. numpy's sum is not always memory-bound (its pairwise
    summation has measured half of what a plain reader gets here), so the roofline takes the
    higher of the two."""
    exe = os.path.join(build_dir, "bench", "kvflow_bench_attention")
    if not os.path.exists(exe):
        return None
    # The benchmark's full name is BM_ReadBandwidth/<threads>/iterations:1/real_time.
    out = subprocess.run([exe, f"--benchmark_filter=^BM_ReadBandwidth/{threads}/", "--benchmark_format=json"],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or not out.stdout.strip():
        log(f"warning: {exe} measured no read bandwidth ({out.stderr.strip()[:200]}); using numpy's")
        return None
    for b in json.loads(out.stdout).get("benchmarks", []):
        if "read_GB/s" in b:
            return float(b["read_GB/s"])
    return None


def roofline(tok_s, bytes_per_token, gbps):
    limit = gbps * 1e9 / bytes_per_token
    return {"bytes_per_token": bytes_per_token, "roofline_tok_s": limit, "pct_of_roofline": 100.0 * tok_s / limit}


# ---------------------------------------------------------------------------------------------------
# Sections: decode and prefill (llama-bench vs kvflow bench)

def llama_bench(bin_dir, model, threads, args, what):
    out, _, _ = run([os.path.join(bin_dir, "llama-bench"), "-m", model, "-t", str(threads), "-o", "json"] + args,
                    what=what)
    try:
        rows = json.loads(out)
    except ValueError:
        raise BenchError(f"{what}: llama-bench printed no JSON:\n{out[-2000:]}")
    return rows


def llama_bench_has_depth(bin_dir):
    p = subprocess.run([os.path.join(bin_dir, "llama-bench"), "--help"], capture_output=True, text=True)
    return "--n-depth" in p.stdout + p.stderr


def kvflow_bench(cli, model, threads, depths, n, repeats, dtype="auto"):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        run([cli, "bench", "-m", model, "--threads", str(threads), "--dtype", dtype,
             "-d", ",".join(str(d) for d in depths), "-n", str(n), "-r", str(repeats), "--json", path],
            what=f"kvflow bench ({dtype})")
        return json.load(open(path))
    finally:
        os.unlink(path)


def median_ts(row):
    s = row.get("samples_ts") or [row["avg_ts"]]
    return statistics.median(s)


def section_decode(cfg, llama, info, bw):
    depths, n, r = cfg["depths"], cfg["decode_tokens"], cfg["repeats"]
    rows = {d: {"depth": d} for d in depths}
    log(f"decode: kvflow bench -d {','.join(map(str, depths))} -n {n} -r {r}")
    kv = kvflow_bench(cfg["cli"], cfg["model"], cfg["threads"], depths, n, r)
    for res in kv["results"]:
        rows[res["depth"]]["kvflow_tok_s"] = res["decode_tok_s"]
        rows[res["depth"]]["kvflow_runs"] = res["runs"]
        log(f"  kvflow depth {res['depth']}: {res['decode_tok_s']:.1f} tok/s")
    log("decode: kvflow bench --dtype f32 -d 0 (exact fp32 reference row)")
    kv32 = kvflow_bench(cfg["cli"], cfg["model"], cfg["threads"], [0], n, r, dtype="f32")
    f32 = kv32["results"][0]
    log(f"  kvflow f32 depth 0: {f32['decode_tok_s']:.1f} tok/s")

    emulated = False
    if llama_bench_has_depth(llama["bin"]):
        log(f"decode: llama-bench -p 0 -n {n} -d {','.join(map(str, depths))} -r {r}")
        lrows = llama_bench(llama["bin"], cfg["model"], cfg["threads"],
                            ["-p", "0", "-n", str(n), "-d", ",".join(map(str, depths)), "-r", str(r)],
                            what="llama-bench (decode)")
        for lr in lrows:
            d = lr.get("n_depth", 0)
            if d in rows:
                rows[d]["llama_tok_s"] = median_ts(lr)
                rows[d]["llama_samples_ts"] = lr.get("samples_ts")
                log(f"  llama.cpp depth {d}: {rows[d]['llama_tok_s']:.1f} tok/s")
        llama_meta = {k: lrows[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "type_k",
                                                    "type_v", "n_batch", "n_ubatch", "flash_attn", "n_threads")
                      if lrows}
    else:
        # An older llama-bench without -d: only depth 0 is comparable (reported, not emulated).
        emulated = True
        log("decode: this llama-bench has no -d/--n-depth; measuring depth 0 only")
        lrows = llama_bench(llama["bin"], cfg["model"], cfg["threads"], ["-p", "0", "-n", str(n), "-r", str(r)],
                            what="llama-bench (decode)")
        rows[0]["llama_tok_s"] = median_ts(lrows[0])
        llama_meta = {}

    one_thread = None
    if cfg["threads"] > 1:
        # Thread-scaling check: both engines on one thread at depth 0. On a machine with other load,
        # llama.cpp's OpenMP barriers can make it slower on T threads than on one; this row shows it.
        log("decode: thread-scaling check, both engines on 1 thread at depth 0")
        k1 = kvflow_bench(cfg["cli"], cfg["model"], 1, [0], n, r)["results"][0]["decode_tok_s"]
        l1 = llama_bench(llama["bin"], cfg["model"], 1, ["-p", "0", "-n", str(n), "-r", str(r)],
                         what="llama-bench (decode, 1 thread)")
        one_thread = {"kvflow_tok_s": k1, "llama_tok_s": median_ts(l1[0]) if l1 else None,
                      "llama_samples_ts": l1[0].get("samples_ts") if l1 else None}
        log(f"  1 thread: kvflow {k1:.1f} tok/s, llama.cpp {one_thread['llama_tok_s']:.1f} tok/s")

    gbps = bw["gbps"]
    # kvflow's KV element: fp16 when its weights stay quantized (its engine line says which).
    kvflow_kv_per_token = (info["kv_bytes_per_token_f16"] if "fp16 KV" in (kv.get("engine") or "")
                           else info["kv_bytes_per_token_f32"])
    info["kvflow_kv_bytes_per_token"] = kvflow_kv_per_token
    for d, row in rows.items():
        ctx = d + n / 2  # the mean KV length over the timed decode steps
        kv_b = info["decode_weight_bytes"] + kvflow_kv_per_token * ctx
        ll_b = info["decode_weight_bytes"] + info["kv_bytes_per_token_f16"] * ctx
        if "kvflow_tok_s" in row:
            row["kvflow_roofline"] = roofline(row["kvflow_tok_s"], kv_b, gbps)
        if "llama_tok_s" in row:
            row["llama_roofline"] = roofline(row["llama_tok_s"], ll_b, gbps)
        if "kvflow_tok_s" in row and "llama_tok_s" in row:
            row["ratio"] = row["kvflow_tok_s"] / row["llama_tok_s"]
    f32_bytes = 4 * info["decode_weight_params"] + info["kv_bytes_per_token_f32"] * n / 2
    return {"decode_tokens": n, "repeats": r, "rows": [rows[d] for d in depths],
            "kvflow_engine": kv.get("engine"),
            "kvflow_f32_depth0": {"tok_s": f32["decode_tok_s"], "runs": f32["runs"], "engine": kv32.get("engine"),
                                  "roofline": roofline(f32["decode_tok_s"], f32_bytes, gbps)},
            "one_thread_depth0": one_thread, "llama_bench": llama_meta, "llama_depth_unsupported": emulated}


def section_prefill(cfg, llama):
    sizes, r = cfg["prefill_sizes"], cfg["repeats"]
    rows = {s: {"tokens": s} for s in sizes}
    log(f"prefill: kvflow bench -d {','.join(map(str, sizes))} -n 0 -r {r}")
    kv = kvflow_bench(cfg["cli"], cfg["model"], cfg["threads"], sizes, 0, r)
    for res in kv["results"]:
        rows[res["depth"]]["kvflow_tok_s"] = res["prefill_tok_s"]
        rows[res["depth"]]["kvflow_runs"] = res.get("runs")
        log(f"  kvflow {res['depth']} tokens: {res['prefill_tok_s']:.1f} tok/s")
    log(f"prefill: llama-bench -p {','.join(map(str, sizes))} -n 0 -r {r}")
    lrows = llama_bench(llama["bin"], cfg["model"], cfg["threads"],
                        ["-p", ",".join(map(str, sizes)), "-n", "0", "-r", str(r)], what="llama-bench (prefill)")
    for lr in lrows:
        s = lr.get("n_prompt")
        if s in rows:
            rows[s]["llama_tok_s"] = median_ts(lr)
            rows[s]["llama_samples_ts"] = lr.get("samples_ts")
            log(f"  llama.cpp {s} tokens: {rows[s]['llama_tok_s']:.1f} tok/s")
    for row in rows.values():
        if "kvflow_tok_s" in row and "llama_tok_s" in row:
            row["ratio"] = row["kvflow_tok_s"] / row["llama_tok_s"]
    return {"repeats": r, "rows": [rows[s] for s in sizes], "kvflow_engine": kv.get("engine"),
            "llama_batch": {k: lrows[0].get(k) for k in ("n_batch", "n_ubatch", "flash_attn")} if lrows else {}}


# ---------------------------------------------------------------------------------------------------
# Section: perplexity

def section_ppl(cfg, llama):
    text = cfg["wikitext"]
    if not os.path.isfile(text):
        log(f"ppl: {text} not found; skipping the perplexity section")
        return {"skipped": f"{rel(text)} not found"}
    ctx, chunks, t = cfg["ppl_ctx"], cfg["ppl_chunks"], str(cfg["threads"])
    log(f"ppl: llama-perplexity -c {ctx} --chunks {chunks} on {rel(text)}")
    out, err, l_s = run([os.path.join(llama["bin"], "llama-perplexity"), "-m", cfg["model"], "-f", text,
                         "-c", str(ctx), "--chunks", str(chunks), "-t", t], what="llama-perplexity")
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out + err)
    if not m:
        raise BenchError("llama-perplexity: no 'Final estimate: PPL = ...' in its output")
    l_ppl, l_err = float(m.group(1)), float(m.group(2))
    log(f"  llama.cpp: PPL {l_ppl:.4f} +/- {l_err:.4f} ({l_s:.0f} s)")
    log(f"ppl: kvflow perplexity --method second-half --ctx {ctx} --max-windows {chunks}")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        run([cfg["cli"], "perplexity", "-m", cfg["model"], "--file", text, "--ctx", str(ctx), "--method",
             "second-half", "--max-windows", str(chunks), "--threads", t, "--json", path], what="kvflow perplexity")
        kv = json.load(open(path))
    finally:
        os.unlink(path)
    log(f"  kvflow: PPL {kv['perplexity']:.4f} ({kv['seconds']:.0f} s)")
    return {"ctx": ctx, "chunks": chunks, "file": rel(text),
            "llama_ppl": l_ppl, "llama_ppl_stderr": l_err, "llama_wall_s": l_s,
            "kvflow_ppl": kv["perplexity"], "kvflow_seconds": kv["seconds"], "kvflow_windows": kv["windows"],
            "kvflow_scored_tokens": kv["scored_tokens"], "ratio": kv["perplexity"] / l_ppl}


# ---------------------------------------------------------------------------------------------------
# Section: the two servers under closed-loop load

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_prompts(path, count=256, max_chars=1000):
    """Fixed prompts: Alpaca instructions (+ input) short enough for a 512-token context, or a fixed text."""
    prompts = []
    if os.path.isfile(path):
        for rec in json.load(open(path, encoding="utf-8")):
            p = rec["instruction"] + ("\n\n" + rec["input"] if rec.get("input") else "") + "\n\nAnswer:"
            if len(p) <= max_chars:
                prompts.append(p)
            if len(prompts) == count:
                break
    if not prompts:
        base = "The history of the printing press begins in the fifteenth century, when"
        prompts = [f"{base} (variant {i})" for i in range(count)]
    return prompts


class Server:
    """A server process on a free port, its log in a file; stop() sends SIGTERM, then SIGKILL."""

    def __init__(self, name, cmd_fn, log_dir):
        self.name, self.port = name, free_port()
        self.cmd = cmd_fn(self.port)
        self.log_path = os.path.join(log_dir, f"{name}-{self.port}.log")
        COMMANDS.append(shell_join([rel(c) if os.path.isabs(c) else c for c in self.cmd]))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def log_tail(self, lines=20):
        try:
            return "\n".join(open(self.log_path, errors="replace").read().splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout=180):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise BenchError(f"{self.name} not ready (/health) after {timeout} s:\n{self.log_tail()}")

    def model_id(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", "/v1/models")
        data = json.loads(c.getresponse().read())
        return data["data"][0]["id"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def stream_completion(port, body):
    """One streamed /v1/completions request: (ttft_s, latency_s, completion_tokens, finish_reason)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        ttft, tokens, chunks, finish = None, None, 0, None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
            if ev.get("usage"):
                tokens = ev["usage"].get("completion_tokens")
        latency = time.perf_counter() - t0
    finally:
        conn.close()
    if tokens is None:  # no usage chunk: a length finish means max_tokens, else count the chunks
        tokens = body["max_tokens"] if finish == "length" else chunks
    return (ttft if ttft is not None else latency), latency, tokens, finish


def closed_loop(port, make_body, prompts, streams, duration):
    """`streams` threads, each sending requests back to back until `duration` s have passed (the ones in
    flight then finish). Output tok/s is all completion tokens over the time until the last finished."""
    records, errors, lock = [], [], threading.Lock()
    t_start = time.perf_counter()
    t_stop = t_start + duration

    def worker(i):
        k = i * 7
        while time.perf_counter() < t_stop:
            try:
                r = stream_completion(port, make_body(prompts[k % len(prompts)]))
            except Exception as e:  # noqa: BLE001 -- reported, not fatal for the other streams
                with lock:
                    errors.append(str(e))
                if len(errors) > 10:
                    return
                continue
            with lock:
                records.append((time.perf_counter(),) + r)
            k += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not records:
        raise BenchError(f"no request completed: {errors[:3]}")
    wall = max(r[0] for r in records) - t_start
    ttft = [r[1] for r in records]
    lat = [r[2] for r in records]
    toks = [r[3] for r in records]

    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]

    return {"streams": streams, "requests": len(records), "errors": len(errors), "error_examples": errors[:3],
            "per_request": [{"ttft_s": r[1], "latency_s": r[2], "tokens": r[3], "finish": r[4],
                             "done_s": r[0] - t_start} for r in records],
            "wall_s": wall, "output_tokens": sum(toks), "output_tok_s": sum(toks) / wall,
            "requests_per_s": len(records) / wall,
            "ttft_median_s": statistics.median(ttft), "ttft_p90_s": pct(ttft, 0.9),
            "latency_median_s": statistics.median(lat), "latency_p90_s": pct(lat, 0.9),
            "all_max_tokens": all(r[4] == "length" for r in records),
            "tokens_per_request_min": min(toks), "tokens_per_request_max": max(toks)}


def section_server(cfg, llama):
    prompts = load_prompts(cfg["prompts"])
    source = rel(cfg["prompts"]) if os.path.isfile(cfg["prompts"]) else "a fixed text"
    ctx, max_tokens, t = cfg["server_ctx"], cfg["server_max_tokens"], str(cfg["threads"])
    log_dir = tempfile.mkdtemp(prefix="llama_cpp_compare_logs_")
    log(f"server: {len(prompts)} prompts from {source}; logs in {log_dir}")
    levels = []
    for n in cfg["concurrency"]:
        level = {"streams": n}
        for name in ("kvflow", "llama"):
            if name == "kvflow":
                cmd = lambda port, n=n: [cfg["server"], "--model", cfg["model"], "--host", "127.0.0.1", "--port",
                                         str(port), "--threads", t, "--max-model-len", str(ctx),
                                         "--max-num-seqs", str(max(n, 1))]
                extra = {}
            else:
                # --parallel n slots of ctx tokens each (-c is the total), continuous batching, no prompt cache
                cmd = lambda port, n=n: [os.path.join(llama["bin"], "llama-server"), "-m", cfg["model"],
                                         "--host", "127.0.0.1", "--port", str(port), "-t", t, "-tb", t,
                                         "-c", str(ctx * n), "--parallel", str(n), "--cont-batching",
                                         "--cache-ram", "0", "--no-webui"]
                extra = {"cache_prompt": False}
            label = "kvflow-server" if name == "kvflow" else "llama-server"
            log(f"server: {label}, {n} stream(s), {cfg['server_duration']:.0f} s")
            srv = Server(label, cmd, log_dir)
            try:
                srv.wait_ready()
                model_id = srv.model_id()

                def make_body(prompt, model_id=model_id, extra=extra):
                    b = {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                    b.update(extra)
                    return b

                stream_completion(srv.port, make_body(prompts[0]))  # warm-up, untimed
                res = closed_loop(srv.port, make_body, prompts, n, cfg["server_duration"])
            finally:
                srv.stop()
            level[name] = res
            log(f"  {label}: {res['output_tok_s']:.1f} tok/s, TTFT median {res['ttft_median_s'] * 1e3:.0f} ms, "
                f"latency median {res['latency_median_s']:.2f} s, {res['requests']} requests"
                + (f", {res['errors']} errors" if res["errors"] else ""))
        level["ratio_tok_s"] = level["kvflow"]["output_tok_s"] / level["llama"]["output_tok_s"]
        levels.append(level)
    shutil.rmtree(log_dir, ignore_errors=True)
    return {"prompts": source, "num_prompts": len(prompts), "ctx_per_sequence": ctx, "max_tokens": max_tokens,
            "duration_s": cfg["server_duration"], "levels": levels}


def completion_text(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status}: {data[:500]!r}")
        return json.loads(data)["choices"][0]["text"]
    finally:
        conn.close()


def section_greedy(cfg, llama, count=16, max_tokens=32):
    """Greedy continuations of the same prompts from both servers: the two engines quantize activations
    alike but sum in different orders, so continuations agree until a near-tie flips an argmax."""
    prompts = load_prompts(cfg["prompts"], count=count)
    t = str(cfg["threads"])
    log_dir = tempfile.mkdtemp(prefix="llama_cpp_compare_logs_")
    commands = {
        "kvflow": lambda port: [cfg["server"], "--model", cfg["model"], "--host", "127.0.0.1", "--port", str(port),
                                "--threads", t, "--max-model-len", str(cfg["server_ctx"]), "--max-num-seqs", "1"],
        "llama": lambda port: [os.path.join(llama["bin"], "llama-server"), "-m", cfg["model"], "--host", "127.0.0.1",
                               "--port", str(port), "-t", t, "-tb", t, "-c", str(cfg["server_ctx"]), "--parallel", "1",
                               "--cache-ram", "0", "--no-webui"],
    }
    texts = {}
    for name, cmd in commands.items():
        label = "kvflow-server" if name == "kvflow" else "llama-server"
        log(f"greedy: {label}, {len(prompts)} prompts x {max_tokens} tokens at temperature 0")
        srv = Server(label, cmd, log_dir)
        try:
            srv.wait_ready()
            model_id = srv.model_id()
            texts[name] = [completion_text(srv.port, {"model": model_id, "prompt": p, "max_tokens": max_tokens,
                                                      "temperature": 0}) for p in prompts]
        finally:
            srv.stop()
    shutil.rmtree(log_dir, ignore_errors=True)
    rows = [{"kvflow": k, "llama": l} for k, l in zip(texts["kvflow"], texts["llama"])]
    res = score_agreement({"prompts": len(rows), "max_tokens": max_tokens, "rows": rows})
    log(f"  identical continuations: {res['identical']} of {len(rows)} ({res['identical_empty']} of them empty); "
        f"agreeing prefix {100 * res['mean_agreeing_fraction']:.0f}% of the text")
    return res


AGREEMENT_METRIC = ("per prompt: characters up to the first difference / the longer continuation's length; two "
                    "identical continuations (two empty ones included) agree fully (1.0); mean over the prompts")


def score_agreement(greedy):
    """Fills the agreement figures of a greedy section from its raw continuations (rows' kvflow, llama)."""
    for r in greedy["rows"]:
        k, l = r["kvflow"], r["llama"]
        agree = next((i for i, (a, b) in enumerate(zip(k, l)) if a != b), min(len(k), len(l)))
        r.update({"identical": k == l, "empty": k == l == "", "agreeing_chars": agree, "kvflow_chars": len(k),
                  "llama_chars": len(l), "agreeing_fraction": 1.0 if k == l else agree / max(len(k), len(l))})
    rows = greedy["rows"]
    greedy.update({"identical": sum(r["identical"] for r in rows),
                   "identical_empty": sum(r["empty"] for r in rows),
                   "identical_nonempty": sum(r["identical"] and not r["empty"] for r in rows),
                   "mean_agreeing_fraction": statistics.mean(r["agreeing_fraction"] for r in rows),
                   "agreement_metric": AGREEMENT_METRIC})
    return greedy


# ---------------------------------------------------------------------------------------------------
# Report

def fmt(v, spec=".1f", suffix=""):
    return "n/a" if v is None else format(v, spec) + suffix


def ratio_str(v):
    return "n/a" if v is None else f"{v:.2f}x"


def pct_str(r):
    return "n/a" if not r else f"{r['pct_of_roofline']:.0f}%"


def kvflow_rates(runs, what):
    """tok/s of each kvflow bench run (decode: steps / decode_s; prefill: prompt tokens / prefill_s)."""
    if not runs:
        return None
    if what == "decode":
        return [r["decode_steps"] / r["decode_s"] for r in runs if r.get("decode_s")]
    return [r["prompt_tokens"] / r["prefill_s"] for r in runs if r.get("prefill_s")]


def spread_str(median, runs):
    """'median (min-max)' over the runs; 'median (runs not recorded)' without them."""
    if median is None:
        return "n/a"
    if not runs:
        return f"{median:.1f} (runs not recorded)"
    return f"{median:.1f} ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else f"{median:.1f}"


def ratio_spread_str(ratio, a_runs, b_runs):
    """The ratio of medians, flagged when the two engines' runs overlap (inside the run-to-run spread)."""
    if ratio is None:
        return "n/a"
    if not a_runs or not b_runs:
        return f"{ratio:.2f}x (spread unknown)"
    within = min(a_runs) <= max(b_runs) and min(b_runs) <= max(a_runs)
    return f"{ratio:.2f}x" + (", within run-to-run spread" if within else "")


def write_markdown(path, res):
    info, bw, L = res["model"], res.get("bandwidth"), []
    L.append(f"# kvflow vs llama.cpp on the CPU: {os.path.basename(info['file'])}, {res['threads']} threads\n")
    d = res["device"]
    L.append(f"- Device: {d['cpu']}, {d['cores']} cores, {d['memory']} RAM ({d['simd']}); load average at start "
             f"{d['load_avg_start'][0]:.2f}, at end {d.get('load_avg_end', [0])[0]:.2f}")
    L.append(f"- llama.cpp: {res['llama_cpp']['version_string']}; build flags: "
             f"{' '.join(f for f in LLAMA_CMAKE_FLAGS if 'AVX' in f or 'NATIVE' in f or 'AMX' in f)}")
    L.append(f"- kvflow: commit {res['kvflow_commit']}; date {res['date']}")
    L.append(f"- Model: {info['name']} ({info['file']}): {info['layers']} layers, {info['kv_heads']} KV heads x "
             f"{info['head_dim']}, tensors {info['tensor_types']}")
    if res.get("quick"):
        L.append("- **--quick run: short, noisy smoke-test numbers, not a measurement**")
    busiest = max(d["load_avg_start"][0], d.get("load_avg_end", [0])[0])
    if busiest > 0.5:
        L.append(f"- **The machine was busy (load average up to {busiest:.1f} on {d['cores']} cores): the numbers are "
                 "noisy, and llama.cpp's multi-threaded ones suffer most (its OpenMP threads meet at a barrier "
                 "after every op, so one descheduled thread stalls the other)**")
    L.append("")
    if bw:
        L.append(f"Memory read bandwidth (measured): {bw['gbps']:.1f} GB/s on {bw['threads']} threads "
                 f"({bw['gbps_1_thread']:.1f} GB/s on one; {bw['method']}). Bytes per decode token (modeled): "
                 f"{info['decode_weight_bytes'] / 1e6:.1f} MB of GGUF weight matrices + KV at the mean depth "
                 f"({info.get('kvflow_kv_bytes_per_token', info['kv_bytes_per_token_f32'])} B/token in kvflow "
                 f"(its fp16 KV cache with quantized weights; fp32 in the f32 row), {info['kv_bytes_per_token_f16']} "
                 f"B/token f16 in llama.cpp). Roofline tok/s = bandwidth / bytes per token.\n")
    sec = res["sections"]
    if "decode" in sec:
        s = sec["decode"]
        L.append(f"## Decode, batch 1 ({s.get('decode_tokens', '?')} tokens after the prefilled depth, median of "
                 f"{s.get('repeats', '?')})\n")
        if "error" in s:
            L.append(f"Failed: `{s['error']}`\n")
        else:
            L.append("tok/s: median (min-max) over the runs; the ratio is of the medians, \"within run-to-run "
                     "spread\" when the two engines' runs overlap.\n")
            L.append("| depth | kvflow tok/s | llama.cpp tok/s | kvflow / llama.cpp | kvflow % of roofline | "
                     "llama.cpp % of roofline |")
            L.append("|---:|---:|---:|---:|---:|---:|")
            for r in s["rows"]:
                kr, lr = kvflow_rates(r.get("kvflow_runs"), "decode"), r.get("llama_samples_ts")
                L.append(f"| {r['depth']} | {spread_str(r.get('kvflow_tok_s'), kr)} | "
                         f"{spread_str(r.get('llama_tok_s'), lr)} | {ratio_spread_str(r.get('ratio'), kr, lr)} | "
                         f"{pct_str(r.get('kvflow_roofline'))} | {pct_str(r.get('llama_roofline'))} |")
            f = s["kvflow_f32_depth0"]
            L.append(f"| 0, kvflow --dtype f32 (reference) | "
                     f"{spread_str(f['tok_s'], kvflow_rates(f.get('runs'), 'decode'))} | | | {pct_str(f['roofline'])} "
                     f"(4 B/weight) | |")
            o = s.get("one_thread_depth0")
            if o:
                ratio = o["kvflow_tok_s"] / o["llama_tok_s"] if o.get("llama_tok_s") else None
                L.append(f"| 0, both on 1 thread (thread-scaling check) | {fmt(o['kvflow_tok_s'])} | "
                         f"{fmt(o.get('llama_tok_s'))} | {ratio_str(ratio)} | | |")
            L.append("")
            if s.get("llama_depth_unsupported"):
                L.append("This llama-bench has no `-d`: llama.cpp was measured at depth 0 only.\n")
            lb = s.get("llama_bench") or {}
            if lb:
                L.append(f"llama-bench: KV {lb.get('type_k')}/{lb.get('type_v')}, flash_attn {lb.get('flash_attn')}, "
                         f"backends {lb.get('backends')}. kvflow: {s.get('kvflow_engine')}.\n")
    if "prefill" in sec:
        s = sec["prefill"]
        L.append(f"## Prefill (one prompt from an empty cache, median of {s.get('repeats', '?')})\n")
        if "error" in s:
            L.append(f"Failed: `{s['error']}`\n")
        else:
            L.append("tok/s: median (min-max) over the runs (\"runs not recorded\": a record written before the "
                     "per-run figures were kept).\n")
            L.append("| prompt tokens | kvflow tok/s | llama.cpp tok/s | kvflow / llama.cpp |")
            L.append("|---:|---:|---:|---:|")
            for r in s["rows"]:
                kr, lr = kvflow_rates(r.get("kvflow_runs"), "prefill"), r.get("llama_samples_ts")
                L.append(f"| {r['tokens']} | {spread_str(r.get('kvflow_tok_s'), kr)} | "
                         f"{spread_str(r.get('llama_tok_s'), lr)} | {ratio_spread_str(r.get('ratio'), kr, lr)} |")
            L.append(f"\nPrefill is compute-bound, so no bandwidth roofline. llama-bench batch: {s.get('llama_batch')}; "
                     "kvflow prefills in chunks of --max-num-batched-tokens (2048).\n")
    if "ppl" in sec:
        s = sec["ppl"]
        L.append("## Perplexity, WikiText-2 test (second half of each chunk scored, as llama-perplexity does)\n")
        if "error" in s:
            L.append(f"Failed: `{s['error']}`\n")
        elif "skipped" in s:
            L.append(f"Skipped: {s['skipped']}.\n")
        else:
            L.append("| ctx | chunks | kvflow PPL | llama.cpp PPL | kvflow / llama.cpp | kvflow s | llama.cpp s |")
            L.append("|---:|---:|---:|---:|---:|---:|---:|")
            L.append(f"| {s['ctx']} | {s['chunks']} | {s['kvflow_ppl']:.4f} | {s['llama_ppl']:.4f} "
                     f"± {s['llama_ppl_stderr']:.4f} | {s['ratio']:.4f} | {s['kvflow_seconds']:.1f} | "
                     f"{s['llama_wall_s']:.1f} (incl. load) |")
            L.append("")
    if "greedy" in sec:
        s = sec["greedy"]
        L.append("## Greedy continuations, the same prompts through both servers\n")
        if "error" in s:
            L.append(f"Failed: `{s['error']}`\n")
        else:
            L.append(f"{s['prompts']} Alpaca prompts, {s['max_tokens']} tokens at most at temperature 0 (stopping at "
                     f"the end-of-sequence token: llama.cpp's ignore_eos masks it, vLLM's and kvflow's do not), one "
                     f"request at a time: **{s['identical']} of {s['prompts']} continuations identical** "
                     f"({s.get('identical_empty', '?')} of them empty on both sides, "
                     f"{s.get('identical_nonempty', '?')} non-empty); the agreeing prefix is "
                     f"{100 * s['mean_agreeing_fraction']:.0f}% of the text on average (characters up to the first "
                     "difference over the longer continuation; identical continuations, empty ones included, count "
                     "1). Both engines quantize the activations to 8 bits per block as "
                     "ggml does but sum in different orders, so a continuation can part at a near-tie.\n")
            for i, r in enumerate(s["rows"][:3]):
                L.append(f"- prompt {i}: kvflow `{r['kvflow'][:80]!r}` / llama.cpp `{r['llama'][:80]!r}`")
            L.append("")
    if "server" in sec:
        s = sec["server"]
        L.append("## Server, closed loop (each stream sends streamed /v1/completions back to back)\n")
        if "error" in s:
            L.append(f"Failed: `{s['error']}`\n")
        else:
            L.append(f"{s['num_prompts']} prompts from {s['prompts']}, max_tokens {s['max_tokens']}, temperature 0, "
                     f"ignore_eos; {s['duration_s']:.0f} s per level (requests in flight then finish); "
                     f"{s['ctx_per_sequence']} tokens of context per sequence; TTFT = first streamed text. One run "
                     "per level and server: no run-to-run spread was measured, so a ratio near 1 is not a "
                     "difference. "
                     + ("Per-request TTFT, latency and tokens are in the JSON (per_request).\n"
                        if all("per_request" in lv["kvflow"] for lv in s["levels"])
                        else "Per-request figures: not recorded in this record (summaries only).\n"))
            L.append("| streams | kvflow tok/s | llama.cpp tok/s | kvflow / llama.cpp | TTFT median kvflow / llama.cpp "
                     "(ms) | TTFT p90 (ms) | latency median (s) | latency p90 (s) | requests |")
            L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for lv in s["levels"]:
                k, l = lv["kvflow"], lv["llama"]
                L.append(f"| {lv['streams']} | {k['output_tok_s']:.1f} | {l['output_tok_s']:.1f} | "
                         f"{lv['ratio_tok_s']:.2f}x | {k['ttft_median_s'] * 1e3:.0f} / {l['ttft_median_s'] * 1e3:.0f} | "
                         f"{k['ttft_p90_s'] * 1e3:.0f} / {l['ttft_p90_s'] * 1e3:.0f} | "
                         f"{k['latency_median_s']:.2f} / {l['latency_median_s']:.2f} | "
                         f"{k['latency_p90_s']:.2f} / {l['latency_p90_s']:.2f} | {k['requests']} / {l['requests']} |")
            odd = [f"{lv['streams']} streams" for lv in s["levels"]
                   if not (lv["kvflow"]["all_max_tokens"] and lv["llama"]["all_max_tokens"])
                   or lv["kvflow"]["errors"] or lv["llama"]["errors"]]
            if odd:
                L.append(f"\nNote: at {', '.join(odd)} not every request ran to max_tokens or some failed (see the JSON).")
            L.append("")
    L.append("## Measured and modeled\n")
    L.append("- Measured: every tok/s, TTFT, latency and perplexity above, and the memory read bandwidth.")
    L.append("- Modeled: bytes per decode token (the GGUF's weight matrices, the token embedding counted as the "
             "tied output matrix, plus KV bytes at depth + half the decode tokens) and so the rooflines. kvflow keeps "
             "the Q4_1 matrices as they are in the file but holds the tied embedding/output as Q8_0, so its real "
             "bytes per token are somewhat higher than modeled; the f32 row uses 4 bytes per weight.")
    L.append("- The client (Python threads) shares the CPU with the server it measures.\n")
    L.append("## Commands\n")
    L.append("```")
    L.extend(res["commands"])
    L.append("```")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def rescore(path):
    """Recomputes a stored record's greedy agreement from its raw continuations (the metric before this
    fix scored two identical empty continuations 0) and re-renders its Markdown; measures nothing."""
    with open(path) as f:
        res = json.load(f)
    g = res.get("sections", {}).get("greedy")
    if g and "rows" in g and "error" not in g:
        old = {k: g.get(k) for k in ("identical", "mean_agreeing_fraction")}
        if "agreement_metric" not in g:
            score_agreement(g)
            g["rescored"] = {"date": provenance()["date"], "by": provenance()["command"],
                             "previous_figures": old,
                             "previous_metric": "agreeing chars / max(1, longer length): two identical empty "
                                                "continuations scored 0"}
            log(f"greedy: mean agreeing fraction {100 * old['mean_agreeing_fraction']:.1f}% -> "
                f"{100 * g['mean_agreeing_fraction']:.1f}%; identical {g['identical']} "
                f"({g['identical_empty']} empty)")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    # Notes written by hand after the generated report (after its Commands block) are kept.
    md = os.path.splitext(path)[0] + ".md"
    old = open(md).read() if os.path.exists(md) else ""
    start = old.find("## Commands\n\n```\n")
    end = old.find("\n```\n", start + 17) if start >= 0 else -1
    notes = old[end + 5:] if end >= 0 else ""
    write_markdown(md, res)
    if g and g.get("rescored"):
        notes += (f"\nGreedy agreement recomputed from the stored continuations on {g['rescored']['date']} "
                  f"(`{g['rescored']['by']}`): the earlier metric scored two identical empty continuations 0 "
                  f"({100 * g['rescored']['previous_figures']['mean_agreeing_fraction']:.0f}% then, "
                  f"{100 * g['mean_agreeing_fraction']:.0f}% now; {g['identical_empty']} of the "
                  f"{g['identical']} identical continuations are empty). Nothing was re-measured.\n")
    if notes:
        with open(md, "a") as f:
            f.write(notes)
    log(f"rewrote {rel(path)} and {rel(md)}")
    return 0


def write_plot(path, res):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not installed in {sys.executable}'s environment: skipping the plot {rel(path)}")
        return False
    sec = res["sections"]
    panels = [k for k, key in (("decode", "rows"), ("prefill", "rows"), ("server", "levels")) if key in sec.get(k, {})]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, k in zip(axes[0], panels):
        s = sec[k]
        if k == "decode":
            x = [r["depth"] for r in s["rows"]]
            ax.plot(x, [r.get("kvflow_tok_s") for r in s["rows"]], "o-", label="kvflow")
            ax.plot(x, [r.get("llama_tok_s") for r in s["rows"]], "s-", label="llama.cpp")
            ax.plot(x, [r.get("kvflow_roofline", {}).get("roofline_tok_s") for r in s["rows"]], ":",
                    label="roofline (kvflow bytes)")
            ax.set(xlabel="KV depth (tokens)", ylabel="decode tok/s", title="Decode, batch 1")
        elif k == "prefill":
            x = [str(r["tokens"]) for r in s["rows"]]
            xs = range(len(x))
            ax.bar([i - 0.2 for i in xs], [r.get("kvflow_tok_s") or 0 for r in s["rows"]], 0.4, label="kvflow")
            ax.bar([i + 0.2 for i in xs], [r.get("llama_tok_s") or 0 for r in s["rows"]], 0.4, label="llama.cpp")
            ax.set_xticks(list(xs), x)
            ax.set(xlabel="prompt tokens", ylabel="prefill tok/s", title="Prefill")
        else:
            x = [lv["streams"] for lv in s["levels"]]
            ax.plot(x, [lv["kvflow"]["output_tok_s"] for lv in s["levels"]], "o-", label="kvflow-server")
            ax.plot(x, [lv["llama"]["output_tok_s"] for lv in s["levels"]], "s-", label="llama-server")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.set(xlabel="concurrent streams", ylabel="output tok/s", title="Server, closed loop")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"kvflow vs llama.cpp, {os.path.basename(res['model']['file'])}, {res['threads']} threads"
                 + (" (--quick: noisy)" if res.get("quick") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ---------------------------------------------------------------------------------------------------

def parse_int_list(s):
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help text states them itself (default None: full vs --quick)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main():
    ap = argparse.ArgumentParser(
        description="Compare kvflow's CPU backend with llama.cpp on the same GGUF file and thread count: "
                    "decode at several KV depths, prefill, WikiText-2 perplexity, and both OpenAI servers under "
                    "closed-loop load. Relative paths are taken from the repository root; build kvflow first.",
        epilog="Example: .venv/bin/python bench/llama_cpp_compare.py --quick --out-prefix /tmp/cmp  (smoke test)",
        formatter_class=HelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf", help="GGUF file both engines load")
    ap.add_argument("--rescore", metavar="OUT.json",
                    help="measure nothing: recompute the greedy agreement of a stored record from its continuations "
                         "and rewrite OUT.json and OUT.md")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test (noisy numbers): depths 0,256, 16 decode tokens, 1 repeat, prefill 128, 2 "
                         "perplexity chunks, 1 and 4 streams for 6 s with max_tokens 16; a few minutes")
    ap.add_argument("--skip-build", action="store_true", help="use the cached llama.cpp build as it is")
    ap.add_argument("--out-prefix", default="bench/results/llama_cpp_compare",
                    help="writes PREFIX.json, PREFIX.md and PREFIX.png")
    ap.add_argument("--llama-cpp-python", default=DEFAULT_LLAMA_CPP_PYTHON,
                    help="llama-cpp-python version whose vendored llama.cpp is built")
    ap.add_argument("--build-dir", default="build", help="kvflow's build directory (kvflow, kvflow-server)")
    ap.add_argument("--depths", type=parse_int_list,
                    help="decode depths (default 0,1024,4096 and 8K capped so depth + 2 x decode tokens fits the "
                         "model's context: 8064 for SmolLM2)")
    ap.add_argument("--decode-tokens", type=int, help="timed decode tokens per run (default 64)")
    ap.add_argument("--repeats", type=int, help="runs per measurement, medians reported (default 3)")
    ap.add_argument("--prefill-sizes", type=parse_int_list, help="prefill prompt lengths (default 512,4096)")
    ap.add_argument("--ppl-ctx", type=int, default=512, help="perplexity chunk length")
    ap.add_argument("--ppl-chunks", type=int, help="perplexity chunks scored (default 20)")
    ap.add_argument("--wikitext", default="../shared/datasets/wikitext-2/test.txt",
                    help="WikiText-2 test text (relative to the repository root); the section is skipped without it")
    ap.add_argument("--prompts", default="../shared/datasets/alpaca/alpaca_5000.json",
                    help="Alpaca JSON for the server prompts (a fixed text without it)")
    ap.add_argument("--concurrency", type=parse_int_list, help="server streams per level (default 1,4,16,64)")
    ap.add_argument("--server-duration", type=float, help="seconds of load per level and server (default 60)")
    ap.add_argument("--server-max-tokens", type=int, help="max_tokens per server request (default 64)")
    ap.add_argument("--server-ctx", type=int, default=512, help="context per sequence on both servers")
    args = ap.parse_args()
    if args.rescore:
        return rescore(args.rescore)

    q = args.quick
    pick = lambda v, full, quick: v if v is not None else (quick if q else full)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        ap.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    os.chdir(REPO)
    model = os.path.abspath(args.model)
    if not os.path.isfile(model):
        ap.error(f"--model {args.model}: no such file (fetch it with tools/quickstart or tools/fetch-model)")
    cli = os.path.abspath(os.path.join(args.build_dir, "kvflow"))
    server = os.path.abspath(os.path.join(args.build_dir, "kvflow-server"))
    for b, target in ((cli, "kvflow_cli"), (server, "kvflow_server_bin")):
        if not os.access(b, os.X_OK):
            ap.error(f"{rel(b)} not found: build kvflow first (make -C {args.build_dir} -j2 {target})")
    p = subprocess.run([cli, "bench", "--help"], capture_output=True, text=True)
    if p.returncode != 0:
        ap.error(f"{rel(cli)} has no 'bench' subcommand: rebuild kvflow (make -C {args.build_dir} kvflow_cli)")

    info = model_info(model)
    n_dec = pick(args.decode_tokens, 64, 16)
    top = min(8192, info["context_length"]) - 2 * n_dec
    cfg = {
        "model": model, "threads": args.threads, "cli": cli, "server": server,
        "depths": pick(args.depths, [0, 1024, 4096, top], [0, 256]),
        "decode_tokens": n_dec, "repeats": pick(args.repeats, 3, 1),
        "prefill_sizes": pick(args.prefill_sizes, [512, 4096], [128]),
        "ppl_ctx": args.ppl_ctx, "ppl_chunks": pick(args.ppl_chunks, 20, 2),
        "wikitext": os.path.abspath(args.wikitext), "prompts": os.path.abspath(args.prompts),
        "concurrency": pick(args.concurrency, [1, 4, 16, 64], [1, 4]),
        "server_duration": pick(args.server_duration, 60.0, 6.0),
        "server_max_tokens": pick(args.server_max_tokens, 64, 16), "server_ctx": args.server_ctx,
    }
    if max(cfg["depths"]) + cfg["decode_tokens"] + 1 > info["context_length"]:
        ap.error(f"--depths: {max(cfg['depths'])} + {cfg['decode_tokens']} decode tokens exceed the model's "
                 f"context ({info['context_length']})")

    log(f"kvflow vs llama.cpp: {rel(model)}, {args.threads} threads, sections {','.join(sections)}"
        + (" (--quick)" if q else ""))
    device = device_info()
    if device["load_avg_start"][0] > 0.5:
        log(f"warning: load average {device['load_avg_start'][0]:.2f}: other work on this machine will make the "
            "numbers noisy")
    llama = ensure_llama_cpp(args.llama_cpp_python, args.skip_build)
    llama["version_string"] = f"llama-cpp-python {llama['version']} (vendored llama.cpp {llama['commit']})"
    log(f"llama.cpp: {llama['version_string']}")

    bw = None
    if "decode" in sections:
        log(f"bandwidth: numpy sums over 512 MiB on {args.threads} thread(s)")
        bw = measure_bandwidth(args.threads)
        log(f"  {bw['gbps']:.1f} GB/s ({bw['gbps_1_thread']:.1f} GB/s on one thread)")
        compiled = measure_bandwidth_compiled(os.path.abspath(args.build_dir), args.threads)
        if compiled:
            log(f"  compiled reader (kvflow_bench_attention): {compiled:.1f} GB/s")
            bw["gbps_numpy"] = bw["gbps"]
            bw["gbps_compiled"] = compiled
            if compiled > bw["gbps"]:
                bw["gbps"] = compiled
                bw["method"] = ("the higher of kvflow_bench_attention's BM_ReadBandwidth (each thread sums its share "
                                f"of 256 MiB) at {compiled:.1f} GB/s and numpy float64 sums over {bw['mib']} MiB at "
                                f"{bw['gbps_numpy']:.1f} GB/s")

    results = {}
    failed = []
    for name in sections:
        try:
            if name == "decode":
                results[name] = section_decode(cfg, llama, info, bw)
            elif name == "prefill":
                results[name] = section_prefill(cfg, llama)
            elif name == "ppl":
                results[name] = section_ppl(cfg, llama)
            elif name == "greedy":
                results[name] = section_greedy(cfg, llama)
            else:
                results[name] = section_server(cfg, llama)
        except BenchError as e:
            log(f"{name}: FAILED: {e}")
            results[name] = {"error": str(e)}
            failed.append(name)

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        commit += "-dirty" if dirty else ""
    except OSError:
        commit = "unknown"
    device["load_avg_end"] = os.getloadavg()
    res = {"provenance": provenance(per_run_figures="decode/prefill rows: kvflow_runs, llama_samples_ts; "
                                                    "server levels: per_request; greedy: rows"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "quick": q,
           "threads": args.threads, "device": device, "kvflow_commit": commit,
           "llama_cpp": {k: v for k, v in llama.items() if k != "bin"} | {"cmake_flags": LLAMA_CMAKE_FLAGS},
           "model": info, "bandwidth": bw, "config": {k: (rel(v) if isinstance(v, str) and os.path.isabs(v) else v)
                                                      for k, v in cfg.items()},
           "sections": results, "commands": COMMANDS,
           "measured": "tok/s, TTFT, latency, perplexity, memory read bandwidth",
           "modeled": "bytes per decode token (GGUF weight matrices + KV at the mean depth) and the rooflines"}
    out = os.path.abspath(args.out_prefix)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(out + ".md", res)
    wrote = [out + ".json", out + ".md"]
    if write_plot(out + ".png", res):
        wrote.append(out + ".png")
    log("wrote " + ", ".join(rel(w) for w in wrote))
    print(open(out + ".md").read())
    if failed:
        log(f"sections that failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
