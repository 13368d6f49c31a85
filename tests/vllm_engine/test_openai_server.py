"""vLLM's OpenAI-compatible server with the sm7x backend: ``vllm serve`` on a local
random-weight model (models.py, with its WordLevel tokenizer), concurrent streamed
completions from a client over 127.0.0.1, and the server log naming the sm7x backend.

Needs what test_engine_matrix.py needs; on GPUs newer than Turing the sm75 library is
forced with the test aid (sm7x.bench._vllm_engine.child_env). The server's log is kept in
$VLLM_ENGINE_OUT (server.log).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the vLLM server test needs a GPU", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (a GPU build)")
pytest.importorskip("transformers", reason="writes its test model with transformers")

from models import write_model  # noqa: E402

from sm7x.bench import _vllm_engine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("server")]

CLIENTS, MAX_TOKENS, START_TIMEOUT = 8, 48, 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 5):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _stream_completion(port: int, prompt: str, out: dict) -> None:
    """One streamed /v1/completions request; records the text pieces and the usage."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        out["status"] = r.status
        pieces, usage, finish = [], None, None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                pieces.append(choice.get("text", ""))
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
        out.update(pieces=pieces, usage=usage, finish=finish)
    except Exception as exc:  # reported by the test, with the server log
        out["error"] = repr(exc)
    finally:
        conn.close()


def test_openai_server_streams_through_sm7x(tmp_path_factory):
    out = os.environ.get("VLLM_ENGINE_OUT") or str(tmp_path_factory.mktemp("server"))
    os.makedirs(out, exist_ok=True)
    model = write_model("llama-d128", os.path.join(out, "models", "llama-d128-server"))
    port = _free_port()
    spec = {"backend": "sm7x", "arch": os.environ.get("SM7X_FA2_FORCE") or "sm75"}
    env = _vllm_engine.child_env(spec, tuple(torch.cuda.get_device_capability()))
    log_path = os.path.join(out, "server.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float16", "--max-model-len", "4096", "--gpu-memory-utilization", "0.08",
           "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "16"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert server.poll() is None, f"vllm serve exited ({server.returncode}); see {log_path}"
            try:
                if _get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not ready in {START_TIMEOUT} s"
            time.sleep(2)
        status, models = _get(port, "/v1/models")
        assert status == 200 and b"tiny" in models
        results = [dict() for _ in range(CLIENTS)]
        prompts = [" ".join(f"w{4 + (i * 37 + j * 11) % 1000}" for j in range(20 + 150 * i))
                   for i in range(CLIENTS)]
        threads = [threading.Thread(target=_stream_completion, args=(port, p, r))
                   for p, r in zip(prompts, results)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        elapsed = time.monotonic() - t0
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    log = open(log_path, errors="replace").read()
    summary = {"clients": CLIENTS, "seconds": elapsed, "results": results,
               "log_lines": [ln for ln in log.splitlines() if _vllm_engine.LOG_KEEP.search(ln)]}
    with open(os.path.join(out, "server.json"), "w") as f:
        json.dump(summary, f, indent=1)
    assert _vllm_engine.SM7X_LOG in log, f"the server did not use the sm7x backend ({log_path})"
    for i, r in enumerate(results):
        assert r.get("status") == 200 and "error" not in r, (i, r)
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == MAX_TOKENS, (i, r)
        assert len(r["pieces"]) >= 2, (i, r)  # streamed, not one piece
