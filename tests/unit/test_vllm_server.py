"""vLLM server mode (``trainer.vllm_mode=server``): the check before any model loads, and a server that stops
answering mid-run, against a real HTTP server on loopback (no vLLM needed: TRL's client speaks plain HTTP)."""

from __future__ import annotations

import http.server
import re
import socket
import threading
from types import SimpleNamespace
from typing import ClassVar

import pytest
import requests

from steadyrl.trainers.vllm_support import VLLMServerError, check_vllm_server, server_errors, server_url


class _Health(http.server.BaseHTTPRequestHandler):
    answers: ClassVar[list[int]] = []  # status codes to answer, in order; the last one repeats
    seen: ClassVar[list[str]] = []

    def do_GET(self):
        type(self).seen.append(self.path)
        code = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Health.seen = []
    yield httpd.server_address[1]
    httpd.shutdown()


def _args(port: int, timeout: float = 3.0, **kw) -> SimpleNamespace:
    fields = dict(vllm_server_base_url=None, vllm_server_host="127.0.0.1", vllm_server_port=port)
    return SimpleNamespace(**{**fields, "vllm_server_timeout": timeout, "output_dir": "/nonexistent/run", **kw})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_a_server_that_answers_after_loading_passes_and_the_attempts_are_counted(server):
    _Health.answers = [503, 503, 200]  # vLLM answers 503 while it loads the model
    assert check_vllm_server(_args(server), interval=0.05) == 3
    assert _Health.seen == ["/health/"] * 3


def test_no_server_is_an_error_naming_host_port_attempts_and_fix():
    port = _closed_port()
    with pytest.raises(VLLMServerError) as err:
        check_vllm_server(_args(port, timeout=0.3), interval=0.1)
    text = str(err.value)
    assert re.search(rf"no vLLM server answers at http://127.0.0.1:{port} \([23] attempt\(s\) over 0.3 s", text), text
    assert "last: ConnectionError" in text and "trl vllm-serve" in text and "trainer.vllm_mode=colocate" in text


def test_a_server_that_keeps_failing_names_its_answer(server):
    _Health.answers = [500]
    with pytest.raises(VLLMServerError, match=r"last: HTTP 500"):
        check_vllm_server(_args(server, timeout=0.2), interval=0.1)


def test_base_url_wins_over_host_and_port():
    assert server_url(_args(1, vllm_server_base_url="http://gen-node:8000/")) == "http://gen-node:8000"
    assert server_url(_args(8001)) == "http://127.0.0.1:8001"


def test_a_server_gone_mid_run_names_the_step_the_url_and_the_checkpoint(tmp_path):
    port = _closed_port()
    with pytest.raises(VLLMServerError) as err, server_errors(_args(port, output_dir=str(tmp_path)), 12):
        requests.get(f"http://127.0.0.1:{port}/generate/", timeout=1)  # what TRL's client raises, retries spent
    text = str(err.value)
    assert text.startswith(f"step 12: the vLLM server at http://127.0.0.1:{port} stopped answering")
    assert f"No complete checkpoint in {tmp_path} yet." in text
    with server_errors(_args(port), 1):  # other errors pass through untouched
        pass
    with pytest.raises(ValueError), server_errors(_args(port), 1):
        raise ValueError("not a connection problem")


def test_server_mode_without_a_gpu_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """TRL 1.16 syncs weights to the server over NCCL only: on a CPU trainer it would fail after loading the model."""
    from steadyrl.config import ConfigError, load_config
    from tests.unit.test_config import BASE, write

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # as if vLLM were installed
    monkeypatch.setattr("steadyrl.config.checks._cuda", lambda: False)
    base = write(tmp_path / "grpo.yaml", BASE)
    with pytest.raises(ConfigError, match=r"server: .* over NCCL, which needs a CUDA GPU .*=colocate"):
        load_config(base, ["trainer.use_vllm=true", "trainer.vllm_mode=server"])
    monkeypatch.setattr("steadyrl.config.checks._cuda", lambda: True)
    assert load_config(base, ["trainer.use_vllm=true", "trainer.vllm_mode=server"]).trainer["vllm_mode"] == "server"
