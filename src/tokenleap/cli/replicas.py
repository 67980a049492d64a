"""``tokenleap serve --replicas N``: the command-line side of serving on Ray Serve replicas.

Kept apart from ``replicas.py`` so that ``tokenleap --help`` and the single-process server never
import Ray; Ray is imported only when ``--replicas`` (> 1) or ``--autoscale`` asks for it.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from tokenleap.cli.main import UsageError, positive_int

RAY_MISSING = "serving on replicas needs Ray Serve: pip install 'tokenleap[ray]'"


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """The ``serve`` options of replicated serving (all other options apply to each replica)."""
    g = p.add_argument_group("replicas (Ray Serve; --kv-cache-gb, --max-num-seqs and the rest apply per replica)")
    g.add_argument("--replicas", type=positive_int, default=1,
                   help="engine replicas behind one OpenAI endpoint (1: the single-process server)")
    g.add_argument("--ray-address", default=None,
                   help="join a Ray cluster: 'auto' or ray://HOST:PORT (default: start a local Ray instance)")
    g.add_argument("--autoscale", type=parse_autoscale, default=None, metavar="MIN:MAX",
                   help="let Ray Serve scale the replicas between MIN and MAX on ongoing requests per replica")
    g.add_argument("--threads-per-replica", type=positive_int, default=None,
                   help="torch threads (and Ray CPUs) of each replica (default: the cores / replicas)")


def parse_autoscale(value: str) -> tuple[int, int]:
    """argparse type for ``MIN:MAX`` (0 <= MIN <= MAX, MAX >= 1)."""
    lo, sep, hi = value.partition(":")
    try:
        bounds = (int(lo), int(hi)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise argparse.ArgumentTypeError(f"must be MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, got {value!r}")
    return bounds


def threads_per_replica(args: argparse.Namespace) -> int:
    """``--threads-per-replica``, or this machine's cores shared by the (largest number of) replicas."""
    if args.threads_per_replica:
        return args.threads_per_replica
    most = args.autoscale[1] if args.autoscale else args.replicas
    return max(1, (os.cpu_count() or 1) // most)


def serve_replicas(args: argparse.Namespace) -> int:
    """Deploy the ingress and the replicas on Ray Serve and block until interrupted."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError(RAY_MISSING) from None
    from tokenleap.serve.replicas.deployment import build_application, settings_from_args
    from tokenleap.cli.serve import _is_loopback, listening_socket

    settings = settings_from_args(args)
    if not args.ray_address:  # a local proxy: a busy port fails now (Ray's proxy shares a port with another's)
        listening_socket(args.host, args.port).close()
    if not _is_loopback(args.host) and not args.api_key:
        print(f"tokenleap: warning: serving on {args.host} without --api-key", file=sys.stderr)

    def stop(signum, frame):  # SIGTERM, and SIGINT even where a shell started us with it ignored (`cmd &`)
        raise KeyboardInterrupt
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        if args.ray_address:
            ray.init(address=args.ray_address)
        else:  # a local instance with a CPU for each replica's threads (Ray's CPUs are a scheduling count)
            most = args.autoscale[1] if args.autoscale else args.replicas
            ray.init(num_cpus=max(os.cpu_count() or 1, most * settings.threads), include_dashboard=False)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(settings), name=settings.app_name, route_prefix="/", blocking=False)
        for sig in signals:  # (again: starting Ray may have put handlers of its own in place)
            signal.signal(sig, stop)
        shape = (f"autoscaling {args.autoscale[0]}..{args.autoscale[1]}" if args.autoscale else
                 f"{args.replicas} replicas")
        print(f"tokenleap: serving {settings.served_name} on http://{args.host}:{args.port}/v1 -- {shape} of "
              f"{settings.threads} thread(s) each on Ray Serve (Ctrl-C stops)", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:  # (a second signal while shutting down acts as it did before: the user insists)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            serve.shutdown()
            if not args.ray_address:  # the local Ray instance this command started, its agents included
                ray.shutdown()
    return 0
