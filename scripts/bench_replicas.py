#!/usr/bin/env python
"""Replicas benchmark (issue 20): throughput and p50/p99 latency at 1, 2, 4, 8, 16 concurrent clients
for 1 replica with 2 threads vs 2 replicas with 1 thread each, plain and speculative side by side,
and each replica's share of the requests.

One local Ray cluster runs four Ray Serve applications at once -- {1x2, 2x1} x {plain, speculative},
each an ingress and its replicas as ``tokenleap serve --replicas`` deploys them, under the route
prefixes /1x2-plain, /2x1-ngram, ... -- and at every concurrency level they take turns (the order
reversed every other round), since this machine's speed drifts over minutes. ``--direct`` adds the
single-process ``tokenleap serve`` (plain and speculative, all cores) as a reference without Ray.

    python scripts/bench_replicas.py --model qwen2.5-coder-1.5b-instruct --draft-model \
        qwen2.5-coder-0.5b-instruct --server-args "--quant int4 --draft-quant int4" --rounds 3
Small smoke run:
    python scripts/bench_replicas.py --model smollm2-135m-instruct --concurrency 1 2 \
        --requests-per-client 1 --max-tokens 8 --server-args "--max-model-len 512"

Clients are bench_serve.py's (streamed greedy chat requests, a warm-up request per server not
counted). Reported per layout, variant and level: throughput, latency p50 / p99, TTFT p50 (medians
over rounds; p99: the worst), the 2x1 / 1x2 throughput ratio, the speculative / plain ratio, and
the replicas' shares of the requests (from each ingress's /metrics).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402  (the clients, levels and server launching of the serving benchmark)

LAYOUTS = {"1x2": (1, 2), "2x1": (2, 1)}  # name -> (replicas, threads per replica)


def routed(url: str) -> dict[str, float]:
    """The ingress's requests answered per replica so far (0 for a live replica that answered none)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if 'replica="' in line and not line.startswith("#"):
            replica = line.split('replica="')[1].split('"')[0]
            if line.startswith("tokenleap:ingress_requests_total{"):
                out[replica] = float(line.rsplit(" ", 1)[1])
            else:
                out.setdefault(replica, 0.0)
    return out


def deploy(args, port: int) -> list[tuple[str, str]]:
    """The four applications on one local Ray cluster; (name, url) of each once ready."""
    import ray
    from ray import serve

    from tokenleap.cli.main import build_parser
    from tokenleap.serve.replicas.deployment import build_application, settings_from_args

    ray.init(num_cpus=sum(r * t for r, t in LAYOUTS.values()) * 2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    servers = []
    for layout, (replicas, threads) in LAYOUTS.items():
        for variant, extra in bench_serve.variants(args):
            name = f"{layout}-{variant}"
            argv = ["serve", "--model", args.model, "--max-num-seqs", str(max(args.concurrency)),
                    *shlex.split(args.server_args), *extra, "--replicas", str(replicas),
                    "--threads-per-replica", str(threads)]
            if args.api_key:
                argv += ["--api-key", args.api_key]
            settings = settings_from_args(build_parser().parse_args(argv), app_name=name)
            print(f"deploying {name}: tokenleap {' '.join(argv)}", file=sys.stderr)
            serve.run(build_application(settings), name=name, route_prefix=f"/{name}", blocking=False)
            servers.append((name, f"http://127.0.0.1:{port}/{name}"))
    return servers


def measure(args, servers: list[tuple[str, str]]) -> tuple[list[bench_serve.Level], dict]:
    """bench_serve's turn-taking, plus each Ray application's per-replica request counts per level."""
    levels, shares = [], {}
    for r in range(args.rounds):
        for n in args.concurrency:
            for name, url in (servers if r % 2 == 0 else servers[::-1]):
                before = routed(url) if not name.startswith("direct") else {}
                level = bench_serve.run_level(args, url, name, n)
                level.round = r
                if not name.startswith("direct"):
                    after = routed(url)
                    counts = sorted((after[k] - before.get(k, 0) for k in after), reverse=True)
                    shares.setdefault((name, n), []).append([c / sum(counts) for c in counts if sum(counts)])
                print(f"  round {r} {name:>12s} x{n:<3d} {level.throughput:8.2f} tok/s  latency p50 "
                      f"{level.latency_median:.2f}s p99 {level.latency_p99:.2f}s", file=sys.stderr)
                levels.append(level)
    return levels, shares


def report(levels: list[bench_serve.Level], shares: dict) -> None:
    groups: dict[tuple[str, int], list[bench_serve.Level]] = {}
    for lv in levels:
        groups.setdefault((lv.variant, lv.concurrency), []).append(lv)
    tput = {k: statistics.median(lv.throughput for lv in runs) for k, runs in groups.items()}
    print(f"{'config':>12s} {'clients':>7s} {'tok/s':>9s} {'lat p50':>8s} {'lat p99':>8s} {'ttft p50':>8s} "
          f"{'2x1/1x2':>8s} {'spec/plain':>10s}  replica shares (max first, per round)")
    for (name, n), runs in groups.items():
        layout, _, variant = name.partition("-")
        other = ("2x1" if layout == "1x2" else "1x2") + "-" + variant
        scale = f"{tput[(name, n)] / tput[(other, n)]:.2f}" if layout == "2x1" and (other, n) in tput else ""
        plain = f"{layout}-plain"
        spec = f"{tput[(name, n)] / tput[(plain, n)]:.2f}" if variant != "plain" and (plain, n) in tput else ""
        share = " ".join("/".join(f"{s:.0%}" for s in rnd) for rnd in shares.get((name, n), []))
        print(f"{name:>12s} {n:7d} {tput[(name, n)]:9.2f} {statistics.median(lv.latency_median for lv in runs):8.2f} "
              f"{max(lv.latency_p99 for lv in runs):8.2f} {statistics.median(lv.ttft_median for lv in runs):8.2f} "
              f"{scale:>8s} {spec:>10s}  {share}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model to serve (catalog name, GGUF file or HF directory)")
    p.add_argument("--draft-model", help="speculative configuration uses this draft (else n-gram lookup)")
    p.add_argument("--num-spec-tokens", default=None, help="'auto' or N for the speculative configuration")
    p.add_argument("--server-args", default="", help="extra 'tokenleap serve' arguments, e.g. '--quant int4'")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="measure every level this many times, taking turns")
    p.add_argument("--direct", action="store_true", help="also the single-process server (no Ray), all cores")
    p.add_argument("--port", type=int, default=0, help="Ray Serve's HTTP port (default: a free one)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    from ray import serve
    import ray
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        servers = deploy(args, args.port or bench_serve.free_port())
        stack.callback(ray.shutdown)
        stack.callback(serve.shutdown)
        if args.direct:
            servers += [(f"direct-{name}", bench_serve.launch(args, extra, stack))
                        for name, extra in bench_serve.variants(args)]
        for _, url in servers:
            bench_serve.warm_up(args, url)
        print(f"all up after {time.monotonic() - t0:.0f}s", file=sys.stderr)
        levels, shares = measure(args, servers)
    report(levels, shares)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"levels": [asdict(lv) for lv in levels],
                       "shares": [{"config": k[0], "clients": k[1], "per_round": v} for k, v in shares.items()]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
