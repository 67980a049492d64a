"""``tokenleap serve`` through the real command line with the real SmolLM2-135M-Instruct."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tokenleap.cli.main import build_parser
from tokenleap.cli.serve import model_aliases

from serving_helpers import wait_until


def test_serve_arguments_and_defaults():
    args = build_parser().parse_args(["serve", "--model", "smollm2-135m-instruct", "--spec", "ngram"])
    assert (args.host, args.port, args.max_num_seqs, args.block_size) == ("127.0.0.1", 8000, 16, 16)
    assert args.func.__name__ == "cmd_serve"
    assert {"/m/q.gguf", "q.gguf", "q"} <= set(model_aliases("/m/q.gguf"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_busy_port_or_a_bad_host_is_refused_before_the_model_loads(capsys, monkeypatch):
    from tokenleap.cli import serve as serve_cli
    from tokenleap.cli.main import main
    monkeypatch.setattr(serve_cli, "build_app", lambda *a: pytest.fail("the model was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "smollm2-135m-instruct", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"cannot listen on 127.0.0.1:{port}" in err and "serving" not in err
        # replicas too, before Ray starts (Ray's proxy would share the port with the server there)
        import ray
        monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
        assert main(["serve", "--model", "smollm2-135m-instruct", "--port", str(port), "--replicas", "2"]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
        for flags, said in ((["--draft-model", "no-such-draft"], "'no-such-draft' is neither a catalog model"),
                            (["--prefill-chunk", "7"], "must be a multiple of --block-size")):
            assert main(["serve", "--model", "smollm2-135m-instruct", "--replicas", "2", *flags]) == 2
            assert said in capsys.readouterr().err
        # (on a cluster the models are where the replicas run: a path missing here is not refused here)
        from tokenleap.cli import replicas as replicas_cli
        monkeypatch.setattr(replicas_cli, "serve_replicas", lambda args: 0)
        assert main(["serve", "--model", "/cluster/models/m.gguf", "--ray-address", "ray://head:10001"]) == 0
    assert main(["serve", "--model", "no-such-model"]) == 2  # before the port opens and says it is loading
    err = capsys.readouterr().err
    assert "'no-such-model' is neither a catalog model" in err and "loading" not in err
    # so is every flag that can be checked without the model
    for flags, said in ((["--draft-model", "no-such-draft"], "'no-such-draft' is neither a catalog model"),
                        (["--spec", "draft"], "--spec draft needs --draft-model"),
                        (["--prefill-chunk", "7"], "--prefill-chunk (7) must be a multiple of --block-size (16)")):
        assert main(["serve", "--model", "smollm2-135m-instruct", *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and "loading" not in err, err
    assert main(["serve", "--model", "smollm2-135m-instruct", "--host", "999.1.1.1"]) == 2
    assert "--host '999.1.1.1' is not an address" in capsys.readouterr().err
    assert main(["serve", "--model", "smollm2-135m-instruct", "--port", "65536"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
    # (Ray Serve's proxy needs a port of its own, named: 0 is for one process only)
    assert main(["serve", "--model", "smollm2-135m-instruct", "--port", "0", "--replicas", "2"]) == 2
    assert "--port must be in 1..65535" in capsys.readouterr().err


def test_the_default_kv_budget_is_at_most_half_the_memory_available(monkeypatch):
    """Without --kv-cache-gb: 4 GiB, or half of what the machine has available where that is less (the
    cache's memory check would refuse a default the machine cannot hold); a budget given is kept."""
    from tokenleap import meminfo
    from tokenleap.cache.paged import DEFAULT_KV_GB, kv_budget_gb
    assert DEFAULT_KV_GB == 4.0  # (serve's help says so)
    for available, want in ((64 * 2**30, 4.0), (3 * 2**30, 1.5), (None, 4.0)):
        monkeypatch.setattr(meminfo, "meminfo", lambda field, a=available: a if field == "MemAvailable" else None)
        assert kv_budget_gb(None) == want and kv_budget_gb(6.0) == 6.0


def test_while_the_model_loads_every_path_answers_503_in_its_apis_error_form(capsys, monkeypatch):
    """The port listens before the model loads: a probe or a client gets 503 "loading" (llama.cpp's
    answer; "connection refused" before), in the error object of the API its path belongs to, and a
    second server cannot take the port meanwhile. A failed load closes the port."""
    from tokenleap.cli import serve as serve_cli
    from tokenleap.cli.main import main
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    seen = {}

    def loading(args, spec=None):
        with httpx.Client(timeout=10) as c:
            seen["health"] = c.get(url + "/health")
            seen["head"] = c.head(url + "/health")
            seen["chat"] = c.post(url + "/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "x" * 5000}]})
            seen["ollama"] = c.post(url + "/api/generate", json={"model": "m", "prompt": "hi"})
            seen["anthropic"] = c.post(url + "/v1/messages", json={})
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        raise RuntimeError("the load failed")
    monkeypatch.setattr(serve_cli, "build_app", loading)
    with pytest.raises(RuntimeError, match="the load failed"):
        main(["serve", "--model", "smollm2-135m-instruct", "--port", str(port)])
    assert f"loading smollm2-135m-instruct; {url} answers 503" in capsys.readouterr().err
    assert all(r.status_code == (529 if name == "anthropic" else 503) and r.headers["retry-after"] == "1"
               for name, r in seen.items())  # (529: Anthropic's status for its overloaded_error)
    assert seen["head"].content == b""
    openai_error = {"message": "the model is loading; retry shortly", "type": "unavailable_error", "param": None,
                    "code": "model_loading"}
    assert seen["health"].json() == seen["chat"].json() == {"error": openai_error}
    assert seen["ollama"].json() == {"error": "the model is loading; retry shortly"}
    assert seen["anthropic"].json()["type"] == "error"
    assert seen["anthropic"].json()["error"]["type"] == "overloaded_error"
    with socket.socket() as again:  # the port was closed with the failed load (its served connections may
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # linger in TIME_WAIT: bind as a server does)
        again.bind(("127.0.0.1", port))
        again.listen()


@pytest.mark.parametrize("signals,timeout,message", [
    ("TERM", 1, "the server is shutting down"),  # the stream ends once --shutdown-timeout has passed
    ("INT INT", 60, "the server was stopped"),  # a second Ctrl-C: at once, however long the timeout
])
def test_a_signal_ends_a_long_stream_with_an_error_event(smollm2_gguf, signals, timeout, message):
    """SIGTERM (or Ctrl-C) with a stream far from done: the server says it is shutting down, the stream
    gets an error event and [DONE] once --shutdown-timeout has passed -- or at once on a second Ctrl-C
    -- and the process exits without a traceback (uvicorn alone would wait for the whole reply; on its
    forced exit each stream and the app died in a KeyboardInterrupt traceback)."""
    import signal
    import time

    # --port 0: the port is the server's from the start (a port found free and then taken by another test
    # in between failed the start, exit 2); the first line names it
    cmd = [sys.executable, "-m", "tokenleap.cli.main", "serve", "--model", "smollm2-135m-instruct", "--port",
           "0", "--spec", "none", "--log-interval", "0", "--shutdown-timeout", str(timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        loading = proc.stderr.readline()
        port = re.search(r"http://127\.0\.0\.1:(\d+) answers 503", loading)
        assert port, loading
        url = f"http://127.0.0.1:{port.group(1)}"
        assert wait_until(lambda: _healthy(url) or proc.poll() is not None, 300) and proc.poll() is None, \
            proc.stderr.read() if proc.poll() is not None else "no answer"
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            t0 = time.monotonic()
            for name in signals.split():
                proc.send_signal(getattr(signal, "SIG" + name))
                time.sleep(0.5)
            rest = list(lines)
        assert proc.wait(30) in (0, 130, -signal.SIGTERM) and time.monotonic() - t0 < 20
        events = [line.removeprefix("data: ") for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and message in events[-2]
        err = proc.stderr.read()
        assert "tokenleap: shutting down: 1 request(s) in flight" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


def test_smollm2_through_the_cli(smollm2_gguf):
    # --port 0: the system picks a free port, which the start line names
    cmd = [sys.executable, "-m", "tokenleap.cli.main", "serve", "--model", "smollm2-135m-instruct", "--port", "0",
           "--max-model-len", "512", "--api-key", "k", "--spec", "ngram", "--max-num-seqs", "4", "--log-interval", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        started = next((line for line in proc.stderr if "tokenleap: serving" in line), "")
        port = re.search(r" on http://127\.0\.0\.1:(\d+)/v1 ", started)
        assert port and int(port.group(1)) > 0, started or proc.stderr.read()
        url = f"http://127.0.0.1:{port.group(1)}"
        assert wait_until(lambda: _healthy(url) or proc.poll() is not None, 300) and proc.poll() is None, \
            proc.stderr.read() if proc.poll() is not None else "no answer"
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=300)
        questions = ["What is the capital of France?", "Name three colors."]

        def ask(q: str) -> str:
            r = c.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": q}],
                                          max_tokens=10, temperature=0)
            return r.choices[0].message.content

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(ask, questions))
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(60)
    from tokenleap.api import LLM
    from tokenleap.config import SamplingParams
    llm = LLM("smollm2-135m-instruct", max_model_len=512)
    want = [o.text for o in llm.generate(questions, SamplingParams(max_tokens=10), chat=True)]
    assert answers == want and "Paris" in answers[0]


def test_bfloat16_serving_engine_with_float32_activations(smollm2_gguf):
    """--dtype bfloat16 with tokenleap's kernels: the model computes in float32 (on any CPU), so the
    paged KV caches (target's and draft's) must be float32 too -- they were bf16, and every prefill
    failed."""
    import torch

    from tokenleap import kernels
    from tokenleap.config import SamplingParams, SpecConfig
    from tokenleap.cli.serve import build_engine
    if not kernels.available():
        pytest.skip("tokenleap's kernels are not available here")
    spec = SpecConfig(method="draft", draft_model="smollm2-135m-instruct", draft_quant="int4")
    outputs = []
    for s in (None, spec):
        engine = build_engine("smollm2-135m-instruct", spec=s, dtype="bfloat16", max_model_len=256, max_num_seqs=2)
        assert engine.cache.k[0].dtype == engine.model.dtype == torch.float32
        if s is not None:
            assert engine.proposer.cache.k[0].dtype == torch.float32
        ids = engine.tokenizer.encode("def fibonacci(n):")
        *_, (seq, _) = engine.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True))
        outputs.append(seq.generated)
    assert len(outputs[0]) == 16 and outputs[1] == outputs[0]


def test_a_prefill_chunk_the_blocks_do_not_divide_is_refused_before_loading(monkeypatch):
    import tokenleap.models.pretrained as pretrained
    from tokenleap.cli.main import UsageError
    from tokenleap.cli.serve import build_engine
    monkeypatch.setattr(pretrained, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UsageError, match=r"--prefill-chunk \(7\) must be a multiple of --block-size \(16\)"):
        build_engine("smollm2-135m-instruct", prefill_chunk=7, block_size=16)
