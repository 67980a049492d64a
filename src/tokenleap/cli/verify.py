"""``tokenleap verify``: the losslessness certificate (``certify.py``) for a model and proposer as the
user runs them. Registered into the main parser by ``cli.build_parser``.

Exit status: 0 when every check passes, 1 when one fails, 2 on bad usage."""
from __future__ import annotations

import argparse
import json
import sys
import time

from tokenleap.cli.main import UsageError, add_model_args, positive_int, read_prompts_file, spec_config
from tokenleap.config import ConfigError

_EPILOG = """checks (one line each, PASS or FAIL):
  greedy        speculative greedy output is token-identical to plain greedy output on every prompt
  seeded        seeded sampling (--seed S + prompt index) gives the same tokens with and without speculation
  distribution  unseeded sampling, the first --positions tokens after the first prompt the method drafts
                for (n-gram lookup may find nothing to draft after some): plain and speculative
                samples are not told apart by a chi-square homogeneity test, and every speculative token
                fits the target's exact plain distribution for its prefix (KS on the randomized PIT and
                a log-likelihood score; p >= --alpha); plain's own samples must fit as well
  power         the fit test, with the same --samples, rejects plain sampling at T*0.9 against the T
                probabilities (p < --alpha); if not, the sample count is too small to certify anything
  block-rule    a one-token step's logits equal, bit for bit, the matching row of a k-token block
  acceptance    the drafts the distribution check's speculative samples tested (run to --trial-tokens
                tokens) were kept as often as min(1, p/q) with the target's exact p says (the count's
                two-sided test, normal or exact where it has little spread, p >= --alpha); the line
                says the smallest c a verifier accepting with min(1, c p/q) would need to be seen
example:
  tokenleap verify --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
      --quant int4 --draft-quant int4
"""


def _probability(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not 0 < x < 0.5:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 0.5), got {value!r}")
    return x


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = 0.0
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value!r}")
    return x


def _positions(value: str) -> int:
    n = positive_int(value)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (the first token comes from the prefill, which never "
                                         f"drafts), got {value!r}")
    return n


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help="certify that speculation is lossless for a model and proposer",
                              epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    # a fixed draft length, so every check drafts ('auto' certifies the adaptive controller's choices);
    # a short context: the checks' prompts are short and --batch slots of it are kept per engine
    p.set_defaults(num_spec_tokens=4, max_model_len=512)
    for action in p._actions:  # (the shared flags' help states generate's defaults)
        if action.dest == "max_model_len":
            action.help = "context window (default: 512: the checks' prompts are short)"
    p.add_argument("--prompts", "--prompts-file", metavar="FILE", help="JSONL file with a \"prompt\" per line "
                                                     "(default: a small built-in set)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--samples", type=positive_int, default=300,
                   help="samples per arm of the distribution check (plain, speculative, biased; default: 300)")
    p.add_argument("--max-tokens", type=positive_int, default=32,
                   help="tokens per prompt (greedy, seeded; default: 32)")
    p.add_argument("--temperature", type=_positive_float, default=1.0,
                   help="temperature of the sampled checks (default: 1.0)")
    p.add_argument("--positions", type=_positions, default=2,
                   help="the distribution check compares the joint of the first N generated tokens (default: 2)")
    p.add_argument("--alpha", type=_probability, default=0.01,
                   help="significance level of every test; a right engine fails one of the four sampled tests about "
                        "3-4x this often: rerun with another --seed before concluding (default: 0.01)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds of the seeded check and of every random stream (default: 0)")
    p.add_argument("--trial-tokens", type=positive_int, default=16,
                   help="tokens each speculative sample runs to, for the acceptance count (default: 16)")
    p.add_argument("--batch", type=positive_int, default=16, help="samples decoded together (default: 16)")
    p.add_argument("--json", action="store_true", help="print the certificate as one JSON object")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from tokenleap.spec.certify import DEFAULT_PROMPTS, CertifyConfig, certify

    # (before spec_config: verify's own default --num-spec-tokens would have it refuse a missing method
    # as "--num-spec-tokens ... goes with a speculative method", a flag the user never gave)
    if args.spec in (None, "none") and not args.draft_model:
        raise UsageError("verify compares speculative decoding with plain decoding: "
                         "give --draft-model NAME_OR_PATH or --spec ngram")
    spec = spec_config(args)  # checks the model flags before anything loads
    texts = read_prompts_file(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    try:
        cfg = CertifyConfig(max_tokens=args.max_tokens, temperature=args.temperature, samples=args.samples,
                            positions=args.positions, alpha=args.alpha, seed=args.seed,
                            trial_tokens=args.trial_tokens)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    make, encode = engine_factory(args, spec)
    prompts = [encode(t) for t in texts]
    t0 = time.perf_counter()

    def progress(name: str) -> None:
        if not args.json:
            print(f"[verify] {name} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)

    cert = certify(make, prompts, cfg, progress)
    if args.json:
        out = cert.to_dict()
        out.update(model=args.model, draft_model=args.draft_model, spec=spec.method, quant=args.quant,
                   draft_quant=args.draft_quant, num_spec_tokens=args.num_spec_tokens, prompts=len(prompts),
                   seconds=round(time.perf_counter() - t0, 1), config=vars(cfg))
        print(json.dumps(out))
    else:
        print(cert.report())
    return 0 if cert.passed else 1


def engine_factory(args: argparse.Namespace, spec):
    """``(factory, encode)``: the target loaded once, shared by a plain and a speculative engine,
    each with ``--batch`` cache slots of ``--max-model-len`` tokens."""
    from tokenleap.api import LLM
    from tokenleap.spec.engine import Engine

    loaded: dict[str, LLM] = {}  # the LLM loads on first use; encode() and both engines share its target

    def llm() -> LLM:
        if "llm" not in loaded:
            loaded["llm"] = LLM(args.model, dtype=args.dtype, quant=args.quant, speculative=spec,
                                max_model_len=args.max_model_len, cache_dir=args.cache_dir, num_slots=args.batch)
        return loaded["llm"]

    def encode(text: str) -> list[int]:
        return llm().encode(text, chat=args.chat)

    engines: dict[bool, Engine] = {}

    def make(speculative: bool) -> Engine:
        if speculative not in engines:
            base = llm()
            if speculative:
                engines[True] = base.engine
            else:
                engines[False] = Engine(base.target.model, base.tokenizer, max_len=base.engine.max_len,
                                        num_slots=args.batch)
        return engines[speculative]

    return make, encode
