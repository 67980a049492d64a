"""What the replicas of tests/test_replicas.py run: the single-process server's app on a tiny model
(imported by the Ray worker processes, which get tests/ on their PYTHONPATH)."""
from __future__ import annotations

import time

import torch

from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.serve.app import ServerConfig, create_app

from serving_helpers import paged_engine

MODEL = "tiny"
# the tiny model's whole position range: a stream long enough that a client's disconnect reaches the
# replica before the sequence could end by itself, even on a loaded machine
REPLICA_MAX_LEN = 512
# each forward of a replica's target waits this long, so that a stream of REPLICA_MAX_LEN tokens takes
# about a second or more whatever the CPU: on a fast one the tiny model alone runs through them in a
# third of a second, less than a client's disconnect may take to cross the proxy and the ingress
FORWARD_DELAY_S = 0.003


def tiny_app(kind: str | None = "draft"):
    """A replica's app: the tiny target with a tiny draft (``kind``: serving_helpers' proposers)."""
    torch.set_num_threads(1)
    engine = paged_engine(kind, blocks=96, slots=16, max_len=REPLICA_MAX_LEN)
    engine.model.register_forward_pre_hook(lambda module, args: time.sleep(FORWARD_DELAY_S))
    return create_app(engine, ServerConfig(model_name=MODEL, scheduler=SchedulerConfig(max_num_seqs=16,
                                                                                    log_interval=0)))


def tiny_draft_app():
    return tiny_app("draft")


def tiny_plain_app():
    return tiny_app(None)
