"""`hetero-sd serve` as a real subprocess, and reading what it answers (tests/serve).

    srv = ServerProcess(config, "--max-running", "1")   # waits until it serves
    httpx.get(srv.url + "/health"); srv.terminate()    # SIGTERM -> exit status

The server binds port 0 and prints "serving <model> on http://host:port" when
ready; the port is read from that line, so no port is guessed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from hetero_sd.testing.fake_backend import ENV as FAKE_ENV

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")  # clients must not send localhost to a proxy
READY_S = 120  # a loaded 2-core CI host imports torch slowly; only a hang should fail this
MAX_NEW_TOKENS = 16


def write_config(path: Path, model: Path, drafter: str = "{kind: ngram, k: 4}", backend: str = "torch",
                 precision: str = "fp32", device: str = "cpu") -> str:
    path.write_text(f"target: {{model: {model}, backend: {backend}, device: {device}, precision: {precision}}}\n"
                    f"drafter: {drafter}\n"
                    f"generation: {{max_new_tokens: {MAX_NEW_TOKENS}}}\n"
                    "memory: {kv_budget: 1MiB}\n")
    return str(path)


# A fake-backend device whose every runner call sleeps its declared cost, so long requests
# take seconds on any host: a test that must catch a request still running (a client that
# leaves, SIGTERM) does not race a fast host. Pass `env=SLOW_ENV` with a config on fake:0.
SLOW_ENV = {FAKE_ENV: json.dumps({"simulate_time": True, "devices": [{"device": "fake:0", "costs": {
    "prefill_per_token_s": 0.001, "decode_per_token_s": 0.05, "verify_base_s": 0.05}}]})}


def write_slow_config(path: Path, model: Path, drafter: str = "{kind: ngram, k: 4}") -> str:
    return write_config(path, model, drafter, backend="fake", device="fake:0")


class ServerProcess:
    def __init__(self, config: str, *args: str, env: dict[str, str] | None = None):
        # cwd = the repository root, so `-m hetero_sd.cli` imports this checkout
        self.proc = subprocess.Popen([sys.executable, "-m", "hetero_sd.cli", "serve", "--config", config,
                                      "--port", "0", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True,
                                     # One compute thread: OpenMP threads of two busy processes on a
                                     # 2-core host spin against each other (conftest's one_torch_thread)
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()  # never let a full pipe block the server
        if not self._ready.wait(READY_S) or not self.url:
            self.stop(kill=True)
            raise AssertionError(f"the server did not start:\n{self.log}")

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"serving .* on (http://\S+)", line)
            if found and not self.url:
                self.url = found.group(1)
                self._ready.set()
        self._ready.set()  # the process ended (before it was ready, if url is empty)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            try:
                if kill:
                    raise subprocess.TimeoutExpired("", 0)
                self.terminate(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def parse_sse(lines) -> list[dict | str]:
    """The data payloads of an SSE stream: JSON objects, and the closing "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (as exposed: a counter's ends in _total) whose
    labels include `labels`, in a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())
