"""``tokenleap serve``: load a model (and a proposer), build the paged engine, run the HTTP server."""
from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

from tokenleap.spec.tree_budget import machine_tree_mode
from tokenleap.cli.main import (UsageError, add_chat_template_arg, add_model_args, non_negative_int, positive_int,
                                spec_config)
from tokenleap.config import SpecConfig

# heavy modules (torch, fastapi) are imported when serving, so other sub-commands start fast


def _positive_float(value: str, allow_zero: bool = False) -> float:
    """argparse type: a finite number > 0 (>= 0 with ``allow_zero``)."""
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not (0 <= x if allow_zero else 0 < x) or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return x


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, paged KV cache)")
    add_model_args(p)
    add_chat_template_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default: 8000; 0: a free one, named in the start line)")
    p.add_argument("--shutdown-timeout", type=lambda v: _positive_float(v, allow_zero=True), default=8.0,
                   metavar="SECONDS", help="on SIGTERM or Ctrl-C, how long the requests in flight may go on before "
                   "they are ended with an error (default: 8, inside docker stop's 10 s; systemd waits 90 s)")
    p.add_argument("--api-key", default=os.environ.get("TOKENLEAP_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every API request -- OpenAI's, "
                        "Ollama's, Anthropic's and llama.cpp's routes, /docs too; /health, /ping, /version, /metrics, "
                        "Ollama's / and /api/version stay open (default: $TOKENLEAP_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    p.add_argument("--max-num-seqs", type=positive_int, default=16, help="sequences decoded together (default: 16)")
    p.add_argument("--max-waiting", type=non_negative_int, default=64,
                   help="queued sequences before requests get 503 (default: 64)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None,
                   help="KV-cache blocks (default: from --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=_positive_float, default=None,
                   help="KV-cache memory budget, target model (default: 4, or half the memory "
                        "available once the model has loaded where that is less)")
    p.add_argument("--prefill-chunk", type=positive_int, default=256,
                   help="prompt tokens per prefill chunk (default: 256)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (default: reuse prompt windows another request computed)")
    p.add_argument("--log-interval", type=lambda v: _positive_float(v, allow_zero=True), default=10.0,
                   help="seconds between stats log lines (0: none; default: 10)")
    p.add_argument("--log-prompts", action="store_true",
                   help="put each request's prompt text in its log line (default: counts and times only)")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per finished or refused request")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins a browser may call the API from (CORS), e.g. https://app.example or '*' "
                        "(default: pages served from this machine -- localhost, 127.0.0.1 -- and desktop apps' "
                        "pages -- app://, file://, tauri://, vscode-webview:// -- as Ollama allows); "
                        "a POST from a page of another origin is refused (403)")
    p.add_argument("--responses-store", type=non_negative_int, default=1000, metavar="N",
                   help="/v1/responses objects kept in memory for previous_response_id and GET /v1/responses/"
                        "{id}: the N most recently used (0: none kept; default 1000)")
    p.add_argument("--reasoning-format", choices=("auto", "none"), default="auto",
                   help="auto: a thinking model's <think> block (Qwen3, DeepSeek-R1 distills) comes back as "
                        "reasoning_content, apart from the content; none: it stays in the content")
    p.add_argument("--embeddings", "--embedding", action="store_true",
                   help="serve POST /v1/embeddings: vectors pooled from the model's final hidden states "
                        "(default: not served, a 501, as llama.cpp)")
    p.add_argument("--pooling", choices=["last", "mean", "cls", "none"], default="last",
                   help="with --embeddings: the last token's hidden state (default), the mean over the tokens, "
                        "the first token's (cls), or none: a vector a token (llama.cpp's /embedding only)")
    p.add_argument("--no-docs", action="store_true",
                   help="do not serve /docs and /openapi.json (default: served, behind --api-key when set)")
    from tokenleap.cli.replicas import add_replica_args  # --replicas N: the same server on Ray Serve replicas
    add_replica_args(p)
    # no --spec: auto when it has more than one proposer to choose from (a draft model found or named,
    # or another method beside n-gram), else plain decoding (see serve_spec_config)
    p.set_defaults(func=cmd_serve, spec=None)


def build_engine(model: str, *, spec: SpecConfig | None = None, dtype: str = "auto", quant: str = "none",
                 max_model_len: int | None = None, max_num_seqs: int = 16, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_gb: float | None = None, prefill_chunk: int = 256,
                 cache_dir: str | None = None, prefix_caching: bool = True, chat_template: str | None = None):
    """A serving ``Engine``: the target on a PagedKVCache, and a proposer (a draft's cache paged too).

    Default pool: room for ``max_num_seqs`` full-length sequences, capped at ``kv_budget_gb(kv_cache_gb)``, and
    never below one full-length sequence (memory is only touched as blocks are written)."""
    from tokenleap.spec.controller import ControllerConfig
    from tokenleap.spec.engine import Engine
    from tokenleap.models.pretrained import load_model
    from tokenleap.cache.paged import PagedKVCache, kv_budget_gb, num_blocks_for_budget
    _check_chunks(prefix_caching, prefill_chunk, block_size)
    spec = spec or SpecConfig()
    target = load_model(model, dtype=dtype, quant=quant, cache_dir=cache_dir, chat_template=chat_template)
    cfg = target.model.config
    max_len = target.context_length(max_model_len)
    per_seq = -(-(max_len + 1) // block_size)
    budget = num_blocks_for_budget(cfg, target.model.dtype, block_size, int(kv_budget_gb(kv_cache_gb) * 2**30))
    blocks = num_kv_blocks or max(min(max_num_seqs * per_seq, budget), per_seq)
    cache = PagedKVCache(cfg, blocks, max_len, target.model.dtype, block_size, num_slots=max_num_seqs,
                         prefix_caching=prefix_caching)
    fixed = None if spec.num_tokens == "auto" else int(spec.num_tokens)
    ctl = ControllerConfig(max_k=max(spec.max_num_tokens, fixed or 1), fixed_k=fixed,
                           tree=machine_tree_mode(spec.tree))
    proposer = _proposer(spec, target, max_len, blocks, block_size, max_num_seqs, cache_dir, prefix_caching)
    if spec.extra.get("serve_default") and len(getattr(proposer, "arms", ())) < 2:
        proposer = None  # the default: auto only with a choice to make (n-gram alone: plain, as always)
    return Engine(target.model, target.tokenizer, max_len=max_len, proposer=proposer, controller=ctl,
                  prefill_chunk=prefill_chunk, cache=cache, tree_nodes=spec.tree_nodes)


def _check_chunks(prefix_caching: bool, prefill_chunk: int, block_size: int) -> None:
    if prefix_caching and prefill_chunk % block_size:
        raise UsageError(f"prefix caching reuses whole prefill chunks: --prefill-chunk ({prefill_chunk}) must be "
                         f"a multiple of --block-size ({block_size}), or pass --no-prefix-caching")


def check_engine_args(args: argparse.Namespace) -> None:
    """The engine flags ``build_engine`` would refuse, checked before anything loads."""
    _check_chunks(not args.no_prefix_caching, args.prefill_chunk, args.block_size)


def _proposer(spec: SpecConfig, target, max_len: int, blocks: int, block_size: int, slots: int,
              cache_dir: str | None, prefix_caching: bool):
    from tokenleap.spec.proposers.factory import build_proposer
    from tokenleap.cache.paged import PagedKVCache

    def paged(draft):  # as many blocks as the target: a draft never holds more tokens of a sequence
        return PagedKVCache(draft.model.config, blocks, max_len, draft.model.dtype, block_size, num_slots=slots,
                            prefix_caching=prefix_caching)

    return build_proposer(spec, target, max_len, slots, cache_dir, draft_cache=paged)


def model_aliases(model: str) -> tuple[str, ...]:
    """Names a request may use for the served model besides its served name: the --model string,
    and for a path its file or directory name with and without the extension."""
    path = Path(model)
    return tuple(dict.fromkeys([model, path.name, path.stem, str(path.expanduser().resolve())]))


def cmd_serve(args: argparse.Namespace) -> int:
    replicas = args.replicas > 1 or args.autoscale or args.ray_address
    if not (1 if replicas else 0) <= args.port <= 65535:  # (0: a free port the system picks, named at start)
        raise UsageError(f"--port must be in {1 if replicas else 0}..65535, got {args.port}")
    if replicas:  # Ray Serve (cli/replicas.py): the flags checked here, before Ray starts -- on a cluster
        if not args.ray_address:  # (--ray-address) the models are where the replicas run, maybe not here
            serve_spec_config(argparse.Namespace(**vars(args)))  # (a copy: each replica reads them as given)
        check_engine_args(args)
        from tokenleap.cli.replicas import serve_replicas
        return serve_replicas(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.disable_log_requests:
        logging.getLogger("tokenleap.serve.requests").setLevel(logging.WARNING)
    spec = serve_spec_config(args)  # (every flag that can be checked without loading: before the port opens)
    check_engine_args(args)
    sock = listening_socket(args.host, args.port)  # before the model loads: a busy port fails at once
    args.port = sock.getsockname()[1]  # (--port 0: the one the system picked)
    from tokenleap.serve.loading import LoadingResponder

    url = f"http://{_url_host(args.host)}:{args.port}"
    print(f"tokenleap: loading {args.model}; {url} answers 503 until it is ready", file=sys.stderr)
    responder = LoadingResponder(sock, tuple(args.allowed_origins)).start()
    try:
        app, engine = build_app(args, spec)
    except BaseException:
        responder.stop()
        sock.close()
        raise
    responder.stop()
    from tokenleap.serve.graceful import GracefulServer

    name = args.served_model_name or args.model
    if not _is_loopback(args.host) and not args.api_key:
        print(f"tokenleap: warning: serving on {args.host} without --api-key", file=sys.stderr)
    cache = engine.cache
    print(f"tokenleap: serving {name} on {url}/v1 (Ollama's API at /api, Anthropic's at "
          f"/v1/messages) -- {cache.num_blocks} KV blocks of "
          f"{cache.block_size} tokens ({cache.nbytes / 2**30:.2f} GiB), max {args.max_num_seqs} sequences, "
          f"speculation: {_speculation(engine.proposer)}, "
          f"prefix caching: {'on' if cache.prefix_caching else 'off'}", file=sys.stderr)
    GracefulServer(app, app.state.server.scheduler, args.shutdown_timeout).run(sockets=[sock])
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` for the server, opened before the engine is built (it answers
    503 while the model loads, ``serve/loading.py``); a UsageError that says why where the address cannot
    be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host!r} is not an address of this machine: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (is another server using it? choose another --port)" if e.errno == errno.EADDRINUSE else ""
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # (an IPv6 address in a URL)


def _speculation(proposer) -> str:
    """The startup line's speculation: off, a method, or auto with its proposers and how its draft was chosen."""
    if proposer is None:
        return "off"
    from tokenleap.spec.proposers.base import draft_model_note, output_pool_note
    arms = getattr(proposer, "arms", None)
    notes = [", ".join(arms)] if arms is not None else []
    notes += [n for n in (draft_model_note(proposer), getattr(proposer, "note", None), output_pool_note(proposer)) if n]
    return f"{proposer.name} ({'; '.join(notes)})" if notes else proposer.name


def build_app(args: argparse.Namespace, spec: SpecConfig | None = None):
    """The serving engine and its FastAPI app, from the parsed ``serve`` command line (also what each
    ``--replicas`` replica runs); ``spec``: ``serve_spec_config(args)`` where the caller has it already."""
    from tokenleap.serve.scheduler import SchedulerConfig
    from tokenleap.serve.app import ServerConfig, create_app
    engine = build_engine(args.model, spec=spec or serve_spec_config(args), dtype=args.dtype, quant=args.quant,
                          max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_gb=args.kv_cache_gb, prefill_chunk=args.prefill_chunk, cache_dir=args.cache_dir,
                          prefix_caching=not args.no_prefix_caching, chat_template=args.chat_template)
    name = args.served_model_name or args.model
    config = ServerConfig(model_name=name, model_aliases=model_aliases(args.model), api_key=args.api_key,
                          scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                                                    log_interval=args.log_interval),
                          allowed_origins=tuple(args.allowed_origins), log_prompts=args.log_prompts,
                          docs=not args.no_docs, responses_store=args.responses_store,
                          embeddings=args.pooling if args.embeddings else None,
                          reasoning=args.reasoning_format == "auto",
                          quantization=None if args.quant == "none" else args.quant.upper())
    return create_app(engine, config), engine


def serve_spec_config(args: argparse.Namespace) -> SpecConfig:
    """``spec_config`` with the server's default: without --spec, auto (marked ``serve_default`` in
    ``extra``: ``build_engine`` keeps it only when it has more than one proposer)."""
    if args.spec is not None:
        return spec_config(args)
    args.spec = "auto"
    spec = spec_config(args)
    return replace(spec, extra={**spec.extra, "serve_default": True})


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
