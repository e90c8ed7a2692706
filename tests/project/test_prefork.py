"""The suite's fork server (tests/helpers/prefork.py) behaves as `python script.py` / `python -m mod`
would for what the tests rely on: argv, environment, directory, output, exit status, signals, atexit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import prefork

SCRIPT = r'''
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "var", os.environ.get("CHATSERVE_PREFORK_PROBE"))
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
if sys.argv[1:] == ["sleep"]:
    time.sleep(60)
raise SystemExit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
'''


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.skipif(prefork.disabled(), reason="CHATSERVE_TEST_NO_PREFORK is set")
@pytest.mark.parametrize("real", [False, True], ids=["fork", "subprocess"])
def test_a_run_is_what_the_interpreter_would_do(script: Path, tmp_path: Path, real: bool) -> None:
    env = {**prefork.server_env(), "CHATSERVE_PREFORK_PROBE": "yes"}
    if real:
        env["TORCH_PREFORK_PROBE"] = "1"  # a variable torch could have read at import: a real process
    assert prefork.can_fork(env) is not real
    done = prefork.run([str(script), "7"], env=env, cwd=tmp_path, timeout=60, out_dir=tmp_path / "out")
    assert done.returncode == 7
    assert done.stdout.splitlines() == [f"argv ['7'] cwd {tmp_path} var yes", "thread joined", "atexit ran"]
    assert done.stderr == "to stderr\n"


@pytest.mark.skipif(prefork.disabled(), reason="CHATSERVE_TEST_NO_PREFORK is set")
def test_modules_signals_and_statuses(script: Path, tmp_path: Path) -> None:
    # -m, and stdin is /dev/null: json.tool reads nothing and fails as the real command does
    done = prefork.run(["-m", "json.tool", "--compact"], env=os.environ, cwd=tmp_path, timeout=60, out_dir=tmp_path / "m")
    real = subprocess.run([sys.executable, "-m", "json.tool", "--compact"], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (real.returncode, real.stdout, real.stderr) == (1, "", real.stderr)
    assert "Expecting value" in real.stderr
    proc = prefork.start([str(script), "sleep"], env=prefork.server_env(), cwd=tmp_path, stdout=tmp_path / "sleep.log")
    assert isinstance(proc, prefork.ForkedProcess) and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.3)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL == proc.returncode  # as subprocess reports a signal's death
    crash = prefork.run([str(tmp_path / "missing.py")], env=os.environ, cwd=tmp_path, timeout=60, out_dir=tmp_path / "c")
    assert crash.returncode == 1 and "missing.py" in crash.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a pid that has been reaped is gone
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"pid {proc.pid} still exists after its exit was reported")


@pytest.mark.skipif(prefork.disabled(), reason="CHATSERVE_TEST_NO_PREFORK is set")
def test_a_command_runs_as_python_dash_c_runs_it(tmp_path: Path) -> None:
    code = ("import sys; print(sys.argv, __name__, repr(sys.path[0]), 'answer' in dir()); "
            "import __main__; print(__main__.__dict__ is globals()); raise SystemExit(int(sys.argv[1]))")
    done = prefork.run(["-c", code, "3"], env=prefork.server_env(), cwd=tmp_path, timeout=60, out_dir=tmp_path / "c")
    real = subprocess.run([sys.executable, "-c", code, "3"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (real.returncode, real.stdout, real.stderr)
    assert done.returncode == 3 and done.stdout == "['-c', '3'] __main__ '' False\nTrue\n"
    broken = prefork.run(["-c", "1/0"], env=prefork.server_env(), cwd=tmp_path, timeout=60, out_dir=tmp_path / "z")
    assert broken.returncode == 1 and "ZeroDivisionError" in broken.stderr


@pytest.mark.skipif(prefork.disabled(), reason="CHATSERVE_TEST_NO_PREFORK is set")
def test_a_fork_server_that_died_is_replaced(script: Path, tmp_path: Path, monkeypatch) -> None:
    # A fork server of this test's own: the worker's may have live children (a session's shared
    # server) whose exit statuses only it can report.
    client = prefork._Client()
    monkeypatch.setattr(prefork, "_client", client)
    try:
        env = dict(client.env)
        client.proc.kill()
        client.proc.wait(10)
        done = prefork.run([str(script), "3"], env=env, cwd=tmp_path, timeout=60, out_dir=tmp_path / "a")
        assert done.returncode == 3, done.stderr  # a new interpreter, or a fork of a new server: either way it ran
        deadline = time.monotonic() + 10
        while not client.dead and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.dead
        proc = prefork.start([str(script), "4"], env=env, cwd=tmp_path, stdout=tmp_path / "b.log")
        assert isinstance(proc, prefork.ForkedProcess) and proc.wait(60) == 4
        assert prefork._client is not client
    finally:
        if prefork._client is not client and prefork._client is not None:
            prefork._client.proc.stdin.close()  # the replacement ends at EOF (monkeypatch restores the worker's)
            prefork._client.proc.wait(30)


def test_disabled_means_real_subprocesses(monkeypatch) -> None:
    monkeypatch.setenv("CHATSERVE_TEST_NO_PREFORK", "1")
    assert not prefork.can_fork(os.environ)
    assert sys.platform != "linux" or prefork.can_fork({**os.environ, "CHATSERVE_TEST_NO_PREFORK": "0"}) is False
