"""Fixtures for the kvflow-server tests: start the server on loopback, talk to it, stop it.

The binaries come from the environment: KVFLOW_SERVER (kvflow-server) and KVFLOW_CLI (kvflow).
Every server is started with --port 0; its stderr is read by a background thread, the port is
taken from the `listening on http://HOST:PORT` line, and the log is attached to failing tests.
"""

import collections
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = "tiny-random"
SMOLLM2 = "smollm2-135m"
HTTP_TIMEOUT = 60.0  # seconds; every socket in these tests has a timeout
LISTEN_RE = re.compile(r"listening on http://([^\s:/]+|\[[^\]]+\]):(\d+)")

_live_servers = []  # for attaching logs to failure reports
# OpenMP workers that spin-wait slow a step down ~100x when the 2 cores are shared with other
# processes (ctest -j, builds), and the tests then time out; passive waiting does not change
# results, so servers and the CLI started here wait passively unless the caller chose otherwise.
OMP_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def _binary(var):
    path = os.environ.get(var)
    if not path:
        pytest.skip(f"{var} is not set: point it at the built binary to run the server tests")
    if not os.access(path, os.X_OK):
        pytest.fail(f"{var}={path} is not an executable file")
    return path


# ---------------------------------------------------------------------------------------------
# HTTP helpers


class Response:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # lower-cased names
        self.body = body

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"Response({self.status}, {self.body[:500]!r})"


def http_request(host, port, method, path, body=None, headers=None, timeout=HTTP_TIMEOUT):
    """One request on a fresh connection. body: bytes, str, or a JSON-able object."""
    hdrs = dict(headers or {})
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
        hdrs.setdefault("Content-Type", "application/json")
    if isinstance(body, str):
        body = body.encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


def iter_sse(resp):
    """Yields the data payloads of an http.client response body in text/event-stream format."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.rstrip(b"\r\n")
        if line.startswith(b"data:"):
            yield line[5:].strip().decode()


def parse_prometheus(text):
    """Parses Prometheus text format 0.0.4. Returns (types, samples): types maps a metric family
    to its TYPE; samples is a list of (name, labels dict, float value). Raises on bad lines."""
    types, samples = {}, []
    sample_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)(\s+-?\d+)?$")
    label_re = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] == "TYPE":
                assert len(parts) == 4, f"bad TYPE line: {line!r}"
                assert parts[3] in ("counter", "gauge", "histogram", "summary", "untyped"), line
                assert parts[2] not in types, f"TYPE given twice: {line!r}"
                types[parts[2]] = parts[3]
            continue
        m = sample_re.match(line)
        assert m, f"bad sample line: {line!r}"
        labels = {}
        if m.group(3):
            rest = m.group(3).strip()
            pos = 0
            while pos < len(rest):
                lm = label_re.match(rest, pos)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = lm.group(2)
                pos = lm.end()
        value = m.group(4)
        v = float({"+Inf": "inf", "-Inf": "-inf", "NaN": "nan"}.get(value, value))
        samples.append((m.group(1), labels, v))
    return types, samples


class Metrics:
    """A parsed /metrics page."""

    def __init__(self, text):
        self.text = text
        self.types, self.samples = parse_prometheus(text)

    def family(self, name):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and self.types.get(name[: -len(suffix)]) == "histogram":
                return name[: -len(suffix)]
        return name

    def get(self, name, default=None, **labels):
        """Sum of the samples of `name` whose labels include `labels`."""
        vals = [v for n, l, v in self.samples
                if n == name and all(l.get(k) == str(x) for k, x in labels.items())]
        if not vals:
            if default is not None:
                return default
            raise KeyError(f"metric {name}{labels or ''} not in /metrics:\n{self.text}")
        return sum(vals)

    def has(self, name):
        return any(n == name for n, _, _ in self.samples)


# mpirun for the tests that serve under it (prefill across ranks, tensor parallelism). CI runs as
# root in a container: let Open MPI run there, on few cores, over shared memory.
MPIRUN = shutil.which("mpirun")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_hwloc_base_binding_policy": "none",
           "OMPI_MCA_btl": "self,vader", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}

# ---------------------------------------------------------------------------------------------
# The server process


class ServerProcess:
    def __init__(self, binary, args, env=None, name="kvflow-server", launcher=()):
        self.launcher = list(launcher)  # e.g. ["mpirun", "-np", "2"]: the server runs under it
        self.binary = binary
        self.args = list(args)
        self.env = env
        self.name = name
        self.proc = None
        self.host = None
        self.port = None
        self.lines = collections.deque(maxlen=4000)
        self._ready = threading.Event()
        self._reader = None
        self.returncode = None
        self.signalled = False

    # -- life cycle
    def start(self, timeout=120.0):
        env = dict(os.environ)
        env.pop("KVFLOW_API_KEY", None)
        env.update(OMP_ENV)
        env.update(self.env or {})
        cmd = [*self.launcher, self.binary, "--host", "127.0.0.1", "--port", "0", *self.args]
        self.lines.append("$ " + " ".join(cmd))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        _live_servers.append(self)
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before "
                                   f"listening:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not log 'listening on' within {timeout} s:"
                                   f"\n{self.log()}")
        while True:  # "/health is 200 from then on"; poll briefly anyway
            try:
                if self.get("/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name}: /health never answered 200:\n{self.log()}")
            time.sleep(0.05)
        return self

    def _read_stderr(self):
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            if not self._ready.is_set():
                m = LISTEN_RE.search(line)
                if m:
                    self.host = m.group(1).strip("[]")
                    self.port = int(m.group(2))
                    self._ready.set()

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig):
        self.signalled = True
        self.proc.send_signal(sig)

    def wait(self, timeout):
        self.returncode = self.proc.wait(timeout)
        if self._reader:
            self._reader.join(5)
        return self.returncode

    def stop(self, sig=signal.SIGTERM, timeout=40.0):
        """Signals the server and waits for it; returns its exit code."""
        if self.proc.poll() is None:
            if not self.signalled:  # a second SIGTERM may cut a graceful shutdown short
                self.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.name} did not exit within {timeout} s of "
                                     f"{signal.Signals(sig).name}:\n{self.log()}")
        return self.wait(5)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self):
        if self in _live_servers:
            _live_servers.remove(self)

    def log(self, last=200):
        return "\n".join(list(self.lines)[-last:])

    # -- requests
    @property
    def url(self):
        return f"http://{self.host}:{self.port}"

    def request(self, method, path, body=None, headers=None, timeout=HTTP_TIMEOUT):
        return http_request(self.host, self.port, method, path, body, headers, timeout)

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def metrics(self):
        r = self.get("/metrics", timeout=10)
        assert r.status == 200, r
        ctype = r.headers.get("content-type", "")
        assert ctype.startswith("text/plain"), f"/metrics Content-Type {ctype!r}"
        return Metrics(r.body.decode())

    def wait_idle(self, timeout=5.0):
        """Polls /metrics until nothing runs or waits and every KV block is free; returns the
        last Metrics (the caller asserts on it)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m.get("kvflow:num_requests_running") == 0
                    and m.get("kvflow:num_requests_waiting") == 0
                    and m.get("kvflow:num_requests_in_flight", 0) == 0
                    and m.get("kvflow:kv_cache_blocks_free") == m.get("kvflow:kv_cache_blocks_total"))
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def connect(self, timeout=HTTP_TIMEOUT):
        return socket.create_connection((self.host, self.port), timeout=timeout)


def start_server(binary, args, env=None, name="kvflow-server", launcher=()):
    srv = ServerProcess(binary, args, env=env, name=name, launcher=launcher)
    try:
        return srv.start()
    except BaseException:
        srv.close()
        raise


def stop_server(srv, sig=signal.SIGTERM):
    try:
        if srv.alive():
            rc = srv.stop(sig)
            assert rc == 0, f"{srv.name} exited with {rc} after {signal.Signals(sig).name}:\n{srv.log()}"
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def server_bin():
    return _binary("KVFLOW_SERVER")


@pytest.fixture(scope="session")
def cli_bin():
    return _binary("KVFLOW_CLI")


@pytest.fixture(scope="session")
def server(server_bin):
    """The shared tiny-random server: default flags, --max-model-len 512."""
    srv = start_server(server_bin, ["--model", TINY, "--max-model-len", "512"], name="tiny-random server")
    yield srv
    stop_server(srv)


@pytest.fixture
def make_server(server_bin):
    """Starts a server with extra flags for one test; stops it with SIGTERM (or the signal given
    to .stop) at teardown and asserts exit code 0."""
    started = []

    def make(*args, env=None, model=TINY, launcher=()):
        srv = start_server(server_bin, ["--model", model, *args], env=env,
                           name=f"kvflow-server {' '.join(args)}", launcher=launcher)
        started.append(srv)
        return srv

    yield make
    errors = []
    for srv in started:
        try:
            stop_server(srv)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


def smollm2_available(cli):
    r = subprocess.run([cli, "info", "--model", SMOLLM2], cwd=REPO, capture_output=True, timeout=60)
    return r.returncode == 0


@pytest.fixture(scope="session")
def smollm2_server(server_bin, cli_bin):
    if not smollm2_available(cli_bin):
        pytest.skip("smollm2-135m is not in models/ (run PYTHON=.venv/bin/python tools/fetch-model)")
    srv = start_server(server_bin, ["--model", SMOLLM2, "--max-model-len", "1024"], name="smollm2 server")
    yield srv
    stop_server(srv)


def run_cli(cli, model, prompt, max_tokens, temperature, seed=0, chat=False, ignore_eos=False,
            top_p=1.0, top_k=0, extra=()):
    """Runs `kvflow generate` and returns its generated text (stdout less its one trailing \\n)."""
    cmd = [cli, "generate", "--model", model, "--prompt", prompt, "--max-tokens", str(max_tokens),
           "--temperature", repr(float(temperature)), "--top-p", repr(float(top_p)), "--top-k", str(top_k),
           "--seed", str(seed), *extra]
    if chat:
        cmd.append("--chat")
    if ignore_eos:
        cmd.append("--ignore-eos")
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=120, env={**os.environ, **OMP_ENV})
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stderr.decode(errors='replace')}"
    out = r.stdout.decode("utf-8")
    assert out.endswith("\n"), f"CLI stdout does not end with a newline: {out!r}"
    return out[:-1]


@pytest.fixture(scope="session")
def cli(cli_bin):
    def run(*args, **kw):
        return run_cli(cli_bin, *args, **kw)
    return run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for srv in list(_live_servers):
            report.sections.append((f"{srv.name} (port {srv.port}) stderr, last lines",
                                    srv.log(80)))
