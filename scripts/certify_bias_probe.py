"""How often `tokenleap verify`'s distribution check (with its power check) certifies a verifier with a
bug injected, on the tests' tiny peaked target and flat draft (tests/test_certify.py).

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python scripts/certify_bias_probe.py [SEEDS] [SAMPLES]

Each bug is patched into ``spec/verify.py`` for SEEDS certificates of SAMPLES samples an arm; a sound
check certifies the correct verifier and none of the others."""
from __future__ import annotations

import collections
import sys

import torch

import tokenleap.spec.verify as verify
from tokenleap.spec.certify import CertifyConfig, check_distribution
from test_certify import PROMPTS, engine_factory, peaked_model


def accepting(factor: float):
    """The rule's acceptance scaled: a draft token kept with probability min(1, factor * p / q)."""
    real = verify._num_accepted
    return lambda tokens, q, p, u: real(tokens, q, p, u / factor)


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    bugs = {"correct": {}, "accept min(1, 1.1 p/q)": {"_num_accepted": accepting(1.1)},
            "accept min(1, 1.05 p/q)": {"_num_accepted": accepting(1.05)},
            "on rejection sample p (no residual)": {"_residual": lambda p, q: p}}
    real = {"_num_accepted": verify._num_accepted, "_residual": verify._residual}
    torch.manual_seed(0)
    make = engine_factory(peaked_model(11, 5.0), peaked_model(12, 1.0))
    for name, patch in bugs.items():
        for attr, fn in patch.items():
            setattr(verify, attr, fn)
        counts, zs, seen = collections.Counter(), [], []
        for r in range(seeds):
            cfg = CertifyConfig(samples=samples, seed=1000 * r + 7, block=6)
            dist, power, acceptance = check_distribution(make, PROMPTS[0], cfg)
            counts["certified"] += dist.passed and power.passed and acceptance.passed
            counts["distribution failed"] += not dist.passed
            counts["acceptance failed"] += not acceptance.passed
            zs.append(acceptance.figures["z"])
            seen.append(acceptance.figures["detectable_factor"] or float("inf"))  # (None: no factor could be stated)
        print(f"{name}: {seeds} seeds, {samples} samples: {dict(counts)}; acceptance z {min(zs):+.1f} .. "
              f"{max(zs):+.1f}, detectable factor {min(seen):.3f} .. {max(seen):.3f}", flush=True)
        for attr, fn in real.items():
            setattr(verify, attr, fn)


if __name__ == "__main__":
    main()
