"""Running a benchmark's jobs in their own processes (standard library only).

A driver that never touches a device runs each job as ``python -m <module>``, one after the
other, so that device memory pools (JAX's preallocation, PyTorch's caching allocator) never
share the GPU, and a job that crashes or hangs costs only its own rows.
"""

from __future__ import annotations

import collections
import os
import pathlib
import signal
import subprocess
import sys
import threading

REPO = pathlib.Path(__file__).resolve().parent.parent


def run_worker(module, worker_args, python, timeout, env_extra=None):
    """Run ``python -m module``, echoing its output; return (exit code or None if killed,
    the last lines of its output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(env_extra or {})
    proc = subprocess.Popen(
        [python, "-m", module, *worker_args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    tail = collections.deque(maxlen=15)

    def echo():
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip())

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group
        proc.wait()
        code = None
    reader.join(timeout=10)
    return code, list(tail)


def failure(code, tail, timeout):
    """One line saying why a worker gave no (or not all) rows."""
    if code is None:
        return f"worker killed after {timeout} s"
    last = next((line for line in reversed(tail) if line.strip()), "")
    return f"worker exited with code {code}: {last[:250]}"
