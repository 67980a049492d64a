"""The output pool on agent-like traffic: requests that differ in their details and are answered
with much the same text -- tool calls to one function for different arguments, and one kind of
code for different names. Each request once, greedy, through one engine without the pool and one
with it (alternating which goes first); outputs must be identical. Prints tok/s per request and the
median / total-time ratios.

    python docs/bench/pool-zen4-s37/agent.py --spec ngram
    python docs/bench/pool-zen4-s37/agent.py --spec auto
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenleap.api import LLM
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.spec.proposers.base import forget_outputs

sys.path.insert(0, str(Path(__file__).parent))
from run import pair, summary  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight for a passenger",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string"}, "destination": {"type": "string"}, "date": {"type": "string"},
        "passenger": {"type": "string"}, "seat": {"type": "string", "enum": ["window", "aisle"]}},
        "required": ["origin", "destination", "date", "passenger"]}}}]
TRIPS = [("Paris", "Berlin", "2027-03-02", "Ana Lopez", "window"), ("Oslo", "Rome", "2027-04-11", "Ben Okafor", "aisle"),
         ("Madrid", "Vienna", "2027-05-20", "Chen Wei", "window"), ("Lisbon", "Prague", "2027-06-08", "Dana Smith", "aisle"),
         ("Dublin", "Athens", "2027-07-14", "Eli Cohen", "window"), ("Warsaw", "Zurich", "2027-08-03", "Fay Brown", "aisle")]
THINGS = [("Customer", "name, email, created_at"), ("Invoice", "number, amount, due_date"),
          ("Product", "sku, title, price"), ("Shipment", "tracking_id, carrier, shipped_at"),
          ("Employee", "employee_id, full_name, hired_on"), ("Ticket", "ticket_id, subject, opened_at")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--spec", default="ngram")
    ap.add_argument("--pool", type=int, default=1 << 15)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    spec = SpecConfig(method=args.spec, draft_model="auto" if args.spec == "auto" else None, draft_quant="int4",
                      ngram_pool=0)
    engines = {"none": LLM(args.model, quant=args.quant, speculative=spec),
               "pool": LLM(args.model, quant=args.quant, speculative=SpecConfig(**{**spec.__dict__,
                                                                                   "ngram_pool": args.pool}))}
    tok = engines["none"].tokenizer
    for llm in engines.values():  # a warm-up each, its output then forgotten
        llm.generate([tok.encode("def add(a, b):")], SamplingParams(max_tokens=16))
        forget_outputs(llm.engine.proposer)
    params = SamplingParams(max_tokens=args.max_tokens)
    rows: list = []
    jobs = []
    for (origin, dest, date, who, seat), (thing, fields) in zip(TRIPS, THINGS):
        ask = f"Book a {seat} seat for {who} from {origin} to {dest} on {date}."
        jobs.append((tok.encode_chat([{"role": "user", "content": ask}], tools=TOOLS), "tool call: " + who))
        code = (f"Write a Python dataclass {thing} with the fields {fields}, a from_dict classmethod, a "
                f"to_dict method and a short docstring. Code only.")
        jobs.append((tok.encode_chat([{"role": "user", "content": code}]), "code: " + thing))
    for i, (ids, label) in enumerate(jobs):
        pair(engines, ids, params, i % 2 == 1, label, rows)
    summary("tool calls", [r for r in rows if r[0].startswith("tool")])
    summary("code of one kind", [r for r in rows if r[0].startswith("code")])
    summary("all", rows)


if __name__ == "__main__":
    main()
