#!/usr/bin/env python
"""Serving benchmark: output tokens/s and request latency (median, p99) at 1, 2, 4, 8, 16 concurrent
clients, speculation off vs on, measured side by side in one run.

Either against a running server (one configuration):
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --model NAME [--api-key KEY]
or launching ``tokenleap serve`` itself for each configuration (plain and speculative, both up at
once; at every concurrency level they take turns, ``--rounds`` times):
    python scripts/bench_serve.py --launch --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --concurrency 1 2 4 8 16 --max-tokens 128 --rounds 3
Small smoke run:
    python scripts/bench_serve.py --launch --model smollm2-135m-instruct --concurrency 1 2 \
        --requests-per-client 2 --max-tokens 16 --server-args "--max-model-len 512"

Every client sends ``--requests-per-client`` streaming chat requests (greedy) one after another; a
warm-up request to each server is not counted. Reported per configuration and concurrency level:
throughput (all output tokens / wall time), median and p99 request latency, median time to first
token (medians over rounds), and the speculative/plain ratio of the median throughputs with each
round's own ratio. Taking turns matters here: this machine's speed drifts by 15-30% over minutes,
so a sweep of one configuration after the other compares different moments.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
import openai

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Implement binary search over a sorted list in Python and explain its complexity.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a function that merges two sorted lists into one sorted list in Python.",
    "Write a Python function that counts the words in a text and returns the 5 most common.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a Python generator that yields prime numbers indefinitely.",
    "Write a Python function that parses a CSV line with quoted fields.",
    "Write a bash one-liner that counts the lines of all .py files in a directory tree.",
    "Write a Python function that computes the Levenshtein distance of two strings.",
    "Write a Python decorator that retries a function up to three times on exception.",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Write a Python function that validates an IPv4 address string.",
]


@dataclass
class Sample:
    latency: float  # seconds from sending to the last token
    ttft: float  # seconds to the first content
    tokens: int


@dataclass
class Level:
    variant: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_seconds: float
    throughput: float  # output tokens / s, all clients together
    latency_median: float
    latency_p99: float
    ttft_median: float
    round: int = 0


def one_request(c: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> Sample:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - t0
    return Sample(latency, latency if ttft is None else ttft, tokens)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def run_level(args, url: str, variant: str, concurrency: int) -> Level:
    def client_loop(i: int) -> list[Sample]:
        c = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=3600)
        prompts = [PROMPTS[(i * args.requests_per_client + j) % len(PROMPTS)] for j in range(args.requests_per_client)]
        return [one_request(c, args.model, p, args.max_tokens) for p in prompts]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = [s for batch in pool.map(client_loop, range(concurrency)) for s in batch]
    wall = time.perf_counter() - t0
    tokens = sum(s.tokens for s in samples)
    lat = [s.latency for s in samples]
    return Level(variant, concurrency, len(samples), tokens, round(wall, 3), round(tokens / wall, 3),
                 round(statistics.median(lat), 3), round(p99(lat), 3),
                 round(statistics.median(s.ttft for s in samples), 3))


def warm_up(args, url: str) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=3600)
    one_request(c, args.model, PROMPTS[0], min(args.max_tokens, 16))  # not counted


def measure(args, servers: list[tuple[str, str]]) -> list[Level]:
    """Every concurrency level, ``--rounds`` times, the servers taking turns at each level (the order
    reversed every other round), so each ratio compares runs minutes apart at most."""
    levels = []
    for r in range(args.rounds):
        for n in args.concurrency:
            for variant, url in (servers if r % 2 == 0 else servers[::-1]):
                level = run_level(args, url, variant, n)
                level.round = r
                print(f"  round {r} {variant:>8s} x{n:<3d} {level.throughput:8.2f} tok/s  latency median "
                      f"{level.latency_median:.2f}s p99 {level.latency_p99:.2f}s  ttft {level.ttft_median:.2f}s",
                      file=sys.stderr)
                levels.append(level)
    return levels


# -- launching servers ----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def launch(args, extra: list[str], stack: contextlib.ExitStack) -> str:
    """Start ``tokenleap serve`` (stopped when ``stack`` closes); returns its URL once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenleap.cli.main", "serve", "--model", args.model, "--port", str(port),
           "--max-num-seqs", str(max(args.concurrency)), *shlex.split(args.server_args), *extra]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    print("launching:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd)

    def stop() -> None:
        proc.terminate()
        proc.wait(60)
    stack.callback(stop)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return url


def variants(args) -> list[tuple[str, list[str]]]:
    """Plain decoding (``--spec none``: the server's default is ``--spec auto``, which drafts with an
    installed catalog draft) and the speculative server as a user starts it."""
    on = (["--draft-model", args.draft_model] if args.draft_model else ["--spec", "ngram"])
    if args.num_spec_tokens:
        on += ["--num-spec-tokens", args.num_spec_tokens]
    return [("plain", ["--spec", "none"]), ("draft" if args.draft_model else "ngram", on)]


def report(levels: list[Level]) -> None:
    """Per variant and level: medians over rounds (throughput, latency p50, TTFT), the worst p99,
    and the speculative / plain ratio of the median throughputs with each round's ratio."""
    groups: dict[tuple[str, int], list[Level]] = {}
    for lv in levels:
        groups.setdefault((lv.variant, lv.concurrency), []).append(lv)
    print(f"{'variant':>8s} {'clients':>7s} {'tok/s':>9s} {'lat p50':>8s} {'lat p99':>8s} {'ttft p50':>8s} "
          f"{'ratio':>6s}  per round")
    for (variant, n), runs in groups.items():
        tput = statistics.median(lv.throughput for lv in runs)
        base_runs = groups.get(("plain", n))
        ratio, rounds = "", ""
        if base_runs and variant != "plain":
            ratio = f"{tput / statistics.median(lv.throughput for lv in base_runs):.2f}"
            by_round = {lv.round: lv.throughput for lv in base_runs}
            rounds = " ".join(f"{lv.throughput / by_round[lv.round]:.2f}" for lv in runs if lv.round in by_round)
        print(f"{variant:>8s} {n:7d} {tput:9.2f} {statistics.median(lv.latency_median for lv in runs):8.2f} "
              f"{max(lv.latency_p99 for lv in runs):8.2f} {statistics.median(lv.ttft_median for lv in runs):8.2f} "
              f"{ratio:>6s}  {rounds}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model name (as the server knows it; with --launch: to load)")
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true", help="start 'tokenleap serve' for each configuration")
    p.add_argument("--draft-model", help="with --launch: speculative configuration uses this draft (else ngram)")
    p.add_argument("--num-spec-tokens", default=None, help="with --launch: 'auto' or N for the speculative run")
    p.add_argument("--server-args", default="", help="extra 'tokenleap serve' arguments, e.g. '--dtype bfloat16'")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="measure every level this many times, the "
                   "configurations taking turns (ratios use the medians)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.launch):
        p.error("give exactly one of --url or --launch")
    with contextlib.ExitStack() as stack:
        if args.url:
            servers = [("server", args.url.rstrip("/"))]
        else:  # every configuration up at once, so the measurements can take turns
            servers = [(name, launch(args, extra, stack)) for name, extra in variants(args)]
        for _, url in servers:
            warm_up(args, url)
        levels = measure(args, servers)
    report(levels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(lv) for lv in levels], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
