"""``tokenleap models``: the catalog and what of it is installed, converted and packed here, or a
catalog model's packages installed."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenleap.cli.main import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    m = subparsers.add_parser("models", help="list the model catalog, or install a catalog model's packages")
    m.add_argument("action", nargs="?", default="list", metavar="{list,install}",
                   help="list (the default) or install; a catalog name alone lists that one")
    m.add_argument("name", nargs="?", help="catalog name (install: the one to install; list: that one only)")
    m.add_argument("--json", action="store_true")
    m.add_argument("--cache-dir", default=None)
    m.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from tokenleap.models import packed_cache
    from tokenleap.models.catalog import get_entry, list_models
    from tokenleap.models.checkpoint import converted_dtypes
    if args.action not in ("list", "install"):
        if args.name is not None:
            raise UsageError(f"unknown action {args.action!r}: use list or install "
                             "(tokenleap models [list|install] NAME)")
        args.action, args.name = "list", args.action  # `tokenleap models NAME`: that one's line
    if args.action == "install":
        if not args.name:
            raise UsageError("name the model to install: tokenleap models install NAME (see: tokenleap models)")
        import shlex
        import subprocess
        entry = get_entry(args.name)
        cmd = [sys.executable, "-m"] + shlex.split(entry.install_command())
        print("running:", " ".join(cmd), file=sys.stderr)
        code = subprocess.call(cmd, stdout=2)  # (pip's lines to stderr too: stdout stays for what scripts read)
        if code == 0:  # (pip's own lines say little when it was there already)
            path = next((r.get("path") for r in list_models(None) if r["name"] == entry.name), None)
            print(f"{entry.name}: installed" + (f" at {path}" if path else ""), file=sys.stderr)
        return code
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    if cache_dir is not None and cache_dir.expanduser().exists() and not cache_dir.expanduser().is_dir():
        raise UsageError(f"--cache-dir {args.cache_dir!r} is not a directory")
    if args.name is not None:
        get_entry(args.name)  # an unknown name: the error lists the catalog
    rows = [r for r in list_models(cache_dir) if args.name is None or r["name"] == args.name]
    for r in rows:
        size = get_entry(r["name"]).size
        r["size_bytes"] = size
        r["converted"] = converted_dtypes(Path(r["path"]), cache_dir) if r.get("path") else []
        r["packed"] = packed_cache.stored(Path(r["path"]), cache_dir) if r.get("path") else []
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for r in rows:
        size = f"{r['size_bytes'] / 2**30:.2f} GiB" if r["size_bytes"] else "?"
        state = "installed" if r.get("installed") else "not installed"
        if r["converted"]:
            state += ", converted (" + ", ".join(r["converted"]) + ")"
        elif r.get("installed"):
            state += ", not converted yet (the first use converts it)"
        if r["packed"]:
            state += ", packed (" + ", ".join(f"{p['quant']}{' as a draft' if p.get('others') == 'int4' else ''} "
                                              f"{p['bytes'] / 2**30:.2f} GiB" for p in r["packed"]) + ")"
        print(f"{r['name']:32s} {r.get('architecture', ''):7s} {str(r.get('params', '')):>6s} {size:>9s}  {state}")
        if not r.get("installed"):
            print(f"{'':32s} install: tokenleap models install {r['name']}")
    return 0
