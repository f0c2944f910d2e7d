"""An ``mpcache-server`` child process for benchmarks: started with the given flags from a
checkout (``python -m mpcache.runtime_zmq.cli``), its output read continuously (a full pipe would stall
its logging), ready once it printed ``mpcache-server ready URL``; stopped with SIGTERM, keeping
its exit code and how long it took."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerProcess:
    def __init__(self, flags: Sequence[str], *, repo: str = REPO, env: dict[str, str] | None = None,
                 ready_timeout: float = 300.0) -> None:
        run_env = dict(os.environ if env is None else env)
        run_env["PYTHONPATH"] = os.pathsep.join([repo, run_env.get("PYTHONPATH", "")])
        run_env.setdefault("PYTHONUNBUFFERED", "1")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "mpcache.runtime_zmq.cli", *flags], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=repo, env=run_env)
        self.url = ""
        self.log: list[str] = []
        self.exit_code: int | None = None
        self.stop_s = float("nan")
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                if line.startswith("mpcache-server ready "):
                    self.url = line.split()[2]  # a log record may follow on the same line
                    ready.set()
            ready.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        if not ready.wait(ready_timeout) or not self.url:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.pump.join(5)
            raise RuntimeError("server did not start:\n" + "\n".join(self.log))
        self.ready_s = time.monotonic() - t0

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (None if killed)."""
        self.exit_code = self.proc.poll()
        if self.exit_code is None:
            t0 = time.monotonic()
            self.proc.terminate()
            try:
                self.exit_code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                self.exit_code = None
            self.stop_s = time.monotonic() - t0
        return self.exit_code
