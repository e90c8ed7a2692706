"""Start the suite's Python processes (servers, docs examples, CLI runs) from a warm parent.

Why: a test that starts `python -m chatserve serve` pays the interpreter's imports every time (torch,
transformers, the app: ~1.3 s of a 2.6 s server start on a fast host, 4-5 s on a slow one), and the
suite starts dozens. A fork server (one per pytest worker, started at its first use) imports them
once (`tests/helpers/prefork_preload.py`); each process is a fork of it that runs the same entry
point the command line would (`runpy` of the module or the script, with its own argv, environment,
working directory and output files), so what runs is the product's code from `main()` on.
(Not multiprocessing's forkserver: it re-imports the parent's `__main__` in every child, which in a
pytest worker is pytest's.)

The protocol, one JSON object per line: the worker writes {"id", "argv", "env", "cwd", "out", "err"}
to the server's stdin; the server answers {"id", "pid"} once it forked, and {"exit": pid, "code"}
when a child ended (it reaps them, polling every 20 ms), which is how `poll` and `wait` learn a
status they could not wait for themselves (the child is the server's, not the worker's).

What is the same as a subprocess: a process of its own (its pid, signals, exit status: a signal's
death is -signum, as `subprocess` reports it), its environment, its files, its atexit handlers.
What differs: the interpreter was started earlier, so variables read at import time (ATEN_*,
ONEDNN_*, HF_*, ...) come from the pytest worker's environment: `start` runs a real subprocess when
the caller's environment differs from the fork server's in one of those (`can_fork`).
`CHATSERVE_TEST_NO_PREFORK=1` turns the whole thing off (every process a real subprocess).

Tests that are about the process itself (the `chatserve` entry point, signal handling at shutdown)
start a real subprocess (`start(..., real=True)`).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Variables read when the fork server's imports ran (the interpreter, the dynamic loader and the
# allocator, torch and its OpenMP / oneDNN / MKL, numpy, huggingface_hub and transformers): a process
# that needs another value of one of these must be a new interpreter. Everything else is read after
# the fork (the child's own environment is set first), by code the server has not imported
# (TORCHINDUCTOR_* and TORCHDYNAMO_*, say: torch's compiler is not imported there; the suite's
# torch.compile tests set TORCHINDUCTOR_CACHE_DIR in the worker).
IMPORT_TIME_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "ATEN_", "TORCH_", "PYTORCH_", "ONEDNN_", "DNNL_", "OMP_", "KMP_",
                            "GOMP_", "MKL_", "OPENBLAS_", "CUDA_", "NPY_", "NUMPY_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_")
# ...except these, which the child applies itself (sys.path from PYTHONPATH) or which are the same everywhere
FORKABLE_ENV = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"})
ROOT = Path(__file__).resolve().parents[2]


def disabled() -> bool:
    return os.environ.get("CHATSERVE_TEST_NO_PREFORK", "") not in ("", "0")


class _ServerGone(RuntimeError):
    """The fork server process has exited."""


class _Client:
    """The worker's side: the fork server process, a reader thread for its answers, the statuses."""

    def __init__(self) -> None:
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # (read by huggingface_hub at import; the suite is offline)
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.helpers.prefork import serve; serve()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=self.env)
        self.cond = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.codes: dict[int, int] = {}  # pid -> exit code (-signum for a signal)
        self.dead = False
        self.ids = itertools.count()
        threading.Thread(target=self._read, name="prefork-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "pid" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                else:
                    self.codes[msg["exit"]] = msg["code"]
                self.cond.notify_all()
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str | None) -> int:
        rid = next(self.ids)
        line = json.dumps({"id": rid, "argv": argv, "env": env, "cwd": cwd, "out": out, "err": err}) + "\n"
        with self.cond:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                self.dead = True
                raise _ServerGone(f"the fork server exited ({self.proc.wait()})") from exc
            if not self.cond.wait_for(lambda: rid in self.pids or self.dead, timeout=120):
                raise RuntimeError("the fork server did not answer in 120 s")
            if self.dead:
                raise _ServerGone(f"the fork server exited ({self.proc.wait()})")
            return self.pids.pop(rid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: pid in self.codes or self.dead, timeout=timeout)
            return self.codes.get(pid)


_lock = threading.Lock()
_client: _Client | None = None


def _fork_client() -> _Client:
    global _client
    with _lock:
        if _client is None or _client.dead:
            _client = _Client()
        return _client


def server_env() -> dict[str, str]:
    """The environment the fork server started with (starting it): a process with this environment,
    plus any run-time variables, is a fork."""
    return dict(_fork_client().env)


def import_time_differences(env: Mapping[str, str]) -> list[str]:
    """The variables read at the fork server's imports (IMPORT_TIME_ENV_PREFIXES) whose value in
    `env` differs from the environment it started with."""
    base = _client.env if _client is not None else {**os.environ, "HF_HUB_OFFLINE": "1"}
    return sorted(key for key in set(env) | set(base)
                  if key.startswith(IMPORT_TIME_ENV_PREFIXES) and key not in FORKABLE_ENV and env.get(key) != base.get(key))


def can_fork(env: Mapping[str, str]) -> bool:
    """Whether a process with this environment can be a fork of the warm parent."""
    return not disabled() and sys.platform == "linux" and not import_time_differences(env)


class ForkedProcess:
    """The parts of `subprocess.Popen` the tests use, for a child of the fork server."""

    def __init__(self, client: _Client, pid: int, args: list[str]) -> None:
        self._client = client
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._client.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._client.wait(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | Path, stdout: Path,
          stderr: Path | None = None, real: bool = False) -> subprocess.Popen | ForkedProcess:
    """`python *argv` (argv without the interpreter: `["-m", "chatserve", "serve", ...]`,
    `["-c", code, ...]` or `["script.py", ...]`), its output appended to `stdout` (and `stderr`, else the same file).
    A fork of the warm parent where it can be (`can_fork`), else a real subprocess."""
    full = [sys.executable, *argv]
    fork = not real and can_fork(env)
    if os.environ.get("CHATSERVE_TEST_PREFORK_LOG"):  # which way each process started, and why
        with open(os.environ["CHATSERVE_TEST_PREFORK_LOG"], "a") as log:
            log.write(f"{'fork' if fork else 'real'} {import_time_differences(env)} {' '.join(argv)[:120]}\n")
    if not fork:
        out = open(stdout, "ab")
        err = open(stderr, "ab") if stderr else None
        try:
            return subprocess.Popen(full, stdout=out, stderr=err or subprocess.STDOUT, cwd=cwd, env=dict(env),
                                    stdin=subprocess.DEVNULL)
        finally:
            out.close()
            if err is not None:
                err.close()
    client = _fork_client()
    try:
        pid = client.spawn(list(argv), dict(env), str(cwd), str(stdout), str(stderr) if stderr else None)
    except _ServerGone:
        # Its imports failed (a broken checkout, say): a new interpreter shows the same error in the
        # process's own output, where the test reports it, rather than in the worker's stderr.
        return start(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr, real=True)
    return ForkedProcess(client, pid, full)


def run(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | Path, timeout: float,
        out_dir: Path) -> subprocess.CompletedProcess:
    """Like `subprocess.run(python *argv, capture_output=True, text=True, timeout=...)`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out, err = out_dir / "stdout.txt", out_dir / "stderr.txt"
    out.write_bytes(b"")
    err.write_bytes(b"")
    proc = start(argv, env=env, cwd=cwd, stdout=out, stderr=err)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise
    return subprocess.CompletedProcess([sys.executable, *argv], code, out.read_text(errors="replace"),
                                       err.read_text(errors="replace"))


# ---- the fork server (its own process) --------------------------------------------------------


def serve() -> None:
    """Import the heavy modules once, then fork a child per request line on stdin; report each
    child's pid and, once reaped, its exit code on stdout. Single-threaded (a fork copies only the
    calling thread: with no other thread, no lock is left held in the child). Ends at EOF."""
    import selectors

    import tests.helpers.prefork_preload  # noqa: F401

    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    children: set[int] = set()
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.buffer, selectors.EVENT_READ)
    pending = b""
    while True:
        ready = sel.select(timeout=0.02)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 1 << 20)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    proto_out.close()
                    sel.close()
                    _child(req["argv"], req["env"], req["cwd"], req["out"], req["err"])  # never returns
                children.add(pid)
                proto_out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                proto_out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")


def _child(argv: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str | None) -> None:
    """In the fork: become `python <argv>` (a script, `-m module` or `-c code`) with this environment, directory
    and output, run it as the interpreter would (its threads joined, its atexit handlers run), and
    exit with its status."""
    code: Any = 1
    try:
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if err_path else out
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err, null}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        code = 0
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":  # as the interpreter runs a command: argv[0] "-c", '' first on sys.path
                sys.argv = ["-c", *argv[2:]]
                if sys.path[:1] != [""]:
                    sys.path.insert(0, "")
                main = sys.modules["__main__"] = type(sys)("__main__")
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            else:
                sys.argv = list(argv)
                sys.path.insert(0, str(Path(argv[0]).resolve().parent))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then status 1
            traceback.print_exc()
            code = 1
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # (the interpreter joins non-daemon threads)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) else 1)
