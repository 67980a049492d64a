"""deploy/: the KubeRay manifest parses and names only options the CLI has; the replica flags'
parsing and the error without Ray (none of this needs Ray installed)."""
import argparse
import builtins
from pathlib import Path

import pytest
import yaml

from tokenleap.cli.main import UsageError, build_parser
from tokenleap.cli.replicas import parse_autoscale, serve_replicas

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_rayservice_manifest_names_only_cli_options():
    docs = list(yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text()))
    assert len(docs) == 1 and docs[0]["kind"] == "RayService"
    spec = docs[0]["spec"]
    apps = yaml.safe_load(spec["serveConfigV2"])["applications"]
    assert [a["import_path"] for a in apps] == ["tokenleap.serve.replicas.deployment:app_builder"]
    argv = apps[0]["args"]["argv"]
    known = {s for a in _serve_parser()._actions for s in a.option_strings}
    flags = [a for a in argv if a.startswith("--")]
    assert flags and not [f for f in flags if f not in known], f"unknown options: {set(flags) - known}"
    args = build_parser().parse_args(["serve", *argv])  # and they parse, values included
    assert args.replicas >= 1 and args.threads_per_replica >= 1
    ray_version = spec["rayClusterConfig"]["rayVersion"]
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    assert f'"ray[serve]=={ray_version}"' in pyproject, "the manifest's Ray must be the one tokenleap[ray] pins"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "torch==2.13.0" in dockerfile and ".[ray" in dockerfile


def test_replica_flags():
    args = build_parser().parse_args(["serve", "--model", "m", "--replicas", "3", "--autoscale", "1:4",
                                      "--threads-per-replica", "2", "--ray-address", "auto"])
    assert (args.replicas, args.autoscale, args.threads_per_replica, args.ray_address) == (3, (1, 4), 2, "auto")
    assert build_parser().parse_args(["serve", "--model", "m"]).replicas == 1
    assert parse_autoscale("0:2") == (0, 2)
    for bad in ("3", "4:2", "0:0", "a:b", "-1:2"):
        with pytest.raises(argparse.ArgumentTypeError, match="MIN:MAX"):
            parse_autoscale(bad)


def test_replicas_without_ray_say_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    args = build_parser().parse_args(["serve", "--model", "m", "--replicas", "2"])
    with pytest.raises(UsageError, match=r"pip install 'tokenleap\[ray\]'"):
        serve_replicas(args)
