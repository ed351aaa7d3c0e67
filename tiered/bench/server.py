"""`tiered serve` in a subprocess, for the benchmarks that talk to it over HTTP (serve_load, lm_eval_check)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, flags: list[str] | tuple[str, ...] = (), env: dict | None = None,
                 timeout_s: float = 300.0) -> subprocess.Popen:
    """`tiered serve --port PORT FLAGS` in a subprocess of this Python (`env`: added to this process's
    environment), returned once its /health answers; its output is piped to proc.stdout.

    Raises:
        RuntimeError: it exited (its output in the message) or did not answer within timeout_s seconds.
    """
    import httpx

    cmd = [sys.executable, "-c", "from tiered.cli import app; app()", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **(env or {})))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("tiered serve exited:\n" + proc.stdout.read())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"tiered serve did not come up in {timeout_s:.0f} s")
