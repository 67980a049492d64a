"""Structured output: replies constrained to a grammar (JSON schema, JSON object, regex, choice,
Lark), masks per verification row, speculative output equal to plain output under a constraint,
sampling exactly from the masked target distribution, and the server's response_format."""
from __future__ import annotations

import itertools
import json
import re

import httpx
import openai
import pytest
import torch
from scipy.stats import chisquare

import tokenleap.spec.engine as engine_mod
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError, SamplingParams, StructuredOutput
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.models.build import build_transformer
from tokenleap.models.transformer import Segment
from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.sampling import logits_to_probs, make_generator
from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.spec.structured import Constraints, grammar_of

from conftest import ToyDetokenizer, random_weights, tiny_config, tiny_model
from serving_helpers import LiveServer

VOCAB = 100  # 0 pad, 1 BOS, 2 EOS, 3.. printable ASCII


class CharTokenizer:
    """One token per printable ASCII character."""

    eos_token_ids = (2,)
    bos_token_id = 1
    vocab_size = VOCAB

    def piece(self, i: int) -> str:
        return chr(i + 29) if 3 <= i < 98 else ""

    def token_bytes(self, i: int) -> bytes:
        return self.piece(i).encode()

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 29 for c in text if 32 <= ord(c) <= 126]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece(i) for i in ids)

    def detokenizer(self) -> ToyDetokenizer:
        return ToyDetokenizer(self)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


TOK = CharTokenizer()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # a random model would pad with spaces forever
GRAMMARS = {"choice": StructuredOutput(choice=["alpha", "beta", "gamma"]),
            "regex": StructuredOutput(regex="[a-e]{2,5}-[0-9]{1,3}"),
            "json": StructuredOutput(json=SCHEMA),
            "lark": StructuredOutput(grammar='start: "x" ("+" "x")* "=" /[0-9]/'),
            "gbnf": StructuredOutput(grammar='root ::= "x" ("+" "x")* "=" [0-9]')}  # llama.cpp's grammar syntax


def follows(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in ("alpha", "beta", "gamma")
    if kind == "regex":
        return re.fullmatch("[a-e]{2,5}-[0-9]{1,3}", text) is not None
    if kind in ("lark", "gbnf"):
        return re.fullmatch(r"x(\+x)*=[0-9]", text) is not None
    obj = json.loads(text)
    return set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3)


def engine(proposer=None, k="auto") -> Engine:
    return Engine(tiny_model("qwen2", seed=3, vocab=VOCAB), TOK, max_len=256, proposer=proposer,
                  controller=ControllerConfig(max_k=4, fixed_k=None if k == "auto" else k))


def run(eng: Engine, prompt: str, params: SamplingParams):
    *_, (seq, _) = eng.generate(TOK.encode(prompt), params)
    return seq


def test_masks_follow_each_rows_state():
    c = Constraints(TOK, VOCAB, (2,)).make(StructuredOutput(choice=["abc", "abd"]))
    a, b, cc, d, x = TOK.encode("abcdx")
    masked = c.mask(torch.zeros(4, VOCAB), [a, b, x])  # draft a, b, x: x is forbidden at row 2

    def allowed(row):
        return set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
    assert allowed(0) == {a} and allowed(1) == {b} and allowed(2) == {cc, d}
    assert allowed(3) == set(range(VOCAB))  # after a forbidden draft token: unused, left alone
    assert c.mask(torch.zeros(1, VOCAB), [])[0].isfinite().sum() == 1  # the matcher was left as it was
    c.advance([a, b, d])
    assert set(torch.isfinite(c.mask(torch.zeros(1, VOCAB), [])[0]).nonzero().flatten().tolist()) == {2}  # EOS
    c.advance([2])  # EOS after a complete reply


class SpecialTokenizer(CharTokenizer):
    """Id 98 is a special token spelled "<s>" (a chat marker: decoding a reply skips it)."""

    class backend:
        @staticmethod
        def get_added_tokens_decoder():
            return {98: type("Added", (), {"special": True})()}

    def piece(self, i: int) -> str:
        return "<s>" if i == 98 else super().piece(i)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        parts = text.split("<s>") if parse_special else [text]  # (as real tokenizers read their specials)
        return [t for j, part in enumerate(parts) for t in ([98] if j else []) + CharTokenizer.encode(self, part)]


def test_a_special_tokens_spelling_is_text_to_a_grammar():
    """A grammar that spells a special token's text takes the text's own tokens, never the special
    token (whose spelling the reply's decoding would skip, leaving text outside the grammar)."""
    tok = SpecialTokenizer()
    c = Constraints(tok, VOCAB, (2,)).make(StructuredOutput(choice=["<s>x"]))
    lt, s, gt, x = tok.encode("<s>x", parse_special=False)
    assert set(c.allowed().nonzero().flatten().tolist()) == {lt}
    c.advance([lt, s, gt])
    assert set(c.allowed().nonzero().flatten().tolist()) == {x}


def test_a_schema_that_names_its_properties_allows_no_others():
    """vLLM's default (and OpenAI's strict mode): no keys past the declared ones unless the schema asks for
    them; an object schema that names no properties, or says ``additionalProperties``, stays open."""
    def allowed_after(schema: dict, text: str) -> set[str]:
        c = Constraints(TOK, VOCAB, (2,)).make(StructuredOutput(json=schema))
        c.advance(TOK.encode(text))
        return {TOK.piece(t) for t in c.allowed().nonzero().flatten().tolist() if t != 2}
    tight = {"x-guidance": {"whitespace_flexible": False}}
    named = {**tight, "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert allowed_after(named, '{"ok":true') == {"}"}
    assert "," in allowed_after({**named, "additionalProperties": True}, '{"ok":true')
    assert "," in allowed_after({**tight, "type": "object"}, '{"ok":true')
    nested = {**tight, "type": "array", "items": {"type": "object", "properties": {"n": {"enum": [1]}}}}
    assert allowed_after(nested, '[{"n":1') == {"}"}


@pytest.mark.parametrize("kind", sorted(GRAMMARS))
def test_replies_follow_the_grammar(kind):
    eng = engine()
    for prompt in ("hello there", "{}", "12345"):
        seq = run(eng, prompt, SamplingParams(max_tokens=60, structured=GRAMMARS[kind]))
        assert seq.finish_reason == "stop" and follows(kind, seq.text), (prompt, seq.text)
        for seed in range(3):
            seq = run(eng, prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured=GRAMMARS[kind]))
            assert seq.finish_reason == "stop" and follows(kind, seq.text), (prompt, seed, seq.text)


@pytest.mark.parametrize("kind", sorted(GRAMMARS))
@pytest.mark.parametrize("proposer", ["ngram", "self", "random"])
def test_speculative_output_equals_plain_under_a_constraint(kind, proposer):
    plain = engine()
    draft = {"ngram": lambda: NgramProposer(3, 1),
             "self": lambda: DraftModelProposer(tiny_model("qwen2", seed=3, vocab=VOCAB), VOCAB, 256),
             "random": lambda: DraftModelProposer(tiny_model("qwen2", seed=9, vocab=VOCAB), VOCAB, 256)}[proposer]
    for k in (2, "auto"):
        spec = engine(draft(), k)
        for prompt, temperature, seed, ignore_eos in (("hello there", 0.0, None, False), ("{}", 0.0, None, False),
                                                      ("abc", 0.8, 4, False), ("xyz", 1.0, 11, False),
                                                      ("hello there", 0.0, None, True)):  # EOS drafted past the end
            params = SamplingParams(max_tokens=40, temperature=temperature, seed=seed, ignore_eos=ignore_eos,
                                    structured=GRAMMARS[kind])
            want, got = run(plain, prompt, params), run(spec, prompt, params)
            assert got.generated == want.generated, (prompt, k)
        if k == 2:  # speculation did run (at the fixed length: "auto" drafts only where measured times say it pays)
            assert spec.totals.draft_tokens > 0


def test_a_draft_model_drafts_inside_the_grammar():
    """The target drafting for itself under a grammar: its masked proposals are exactly what the
    masked target chooses, so every drafted token is accepted but those drafted past the end of
    the reply (unmasked, the grammar rejected nearly all: 7 of 555 accepted on these)."""
    for kind in ("json", "regex", "lark", "choice"):
        spec = engine(DraftModelProposer(tiny_model("qwen2", seed=3, vocab=VOCAB), VOCAB, 256), 3)
        for prompt in ("hello", "{}", "12345", "zz"):
            seq = run(spec, prompt, SamplingParams(max_tokens=40, structured=GRAMMARS[kind]))
            assert (seq.finish_reason == "length" or follows(kind, seq.text)) and seq.stats.draft_tokens > 0
            assert seq.stats.draft_tokens - seq.stats.accepted_tokens <= 3, (kind, prompt)  # the last step's
    c = Constraints(TOK, VOCAB, (2,)).make(StructuredOutput(choice=["xy"]))
    only_a = torch.full((1, VOCAB), float("-inf"))
    only_a[0, TOK.encode("a")[0]] = 0.0  # a draft head whose subset lacks every allowed token
    assert torch.isfinite(c.draft(only_a)[0]).nonzero().flatten().tolist() == TOK.encode("x")


def test_invalid_grammars_are_clear_errors():
    eng = engine()
    for bad, message in ((StructuredOutput(regex="(unclosed"), "invalid regex"),
                         (StructuredOutput(json={"type": "object", "properties": 3}), "invalid json"),
                         (StructuredOutput(grammar="start: ???"), "invalid grammar"),
                         (StructuredOutput(grammar="root ::= ("), "invalid grammar.*GBNF")):
        with pytest.raises(ConfigError, match=message):
            eng.create(TOK.encode("hi"), SamplingParams(structured=bad))
    # barred words that leave the grammar nothing: a clear error, greedy or sampled (not a refused token)
    for sampling in (dict(), dict(temperature=1.0, seed=1)):
        with pytest.raises(ConfigError, match="bad_words leave no token"):
            run(eng, "hi", SamplingParams(structured=StructuredOutput(choice=["yes"]), bad_words=("y",), **sampling))
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ConfigError, match="non-empty"):
        StructuredOutput(choice=[])


# -- sampling exactly from the masked distribution ----------------------------------------------
V, N_SAMPLES = 4, 1500  # tokens a, b, c and EOS
GRAMMAR = StructuredOutput(regex="(a[bc]|b[ab]|c[abc])[abc]")  # the allowed second token depends on the first
PARAMS = dict(temperature=1.0)


class AbcTokenizer(CharTokenizer):
    eos_token_ids = (3,)
    bos_token_id = None
    vocab_size = V

    def piece(self, i: int) -> str:
        return "abc"[i] if i < 3 else ""

    def encode(self, text: str) -> list[int]:
        return ["abc".index(c) for c in text]


def abc_model(seed: int, scale: float):
    cfg = tiny_config("llama", vocab=V, hidden=32, intermediate=64, heads=2, kv_heads=1)
    return build_transformer(cfg, random_weights(cfg, seed, scale=scale), torch.float32)


def exact(target, token_level: bool = True) -> dict[tuple[int, ...], float]:
    """Each reply's probability: each token from its row's softmax masked to the grammar. With
    ``token_level=False``: the unmasked distribution renormalized over whole valid replies, what
    a sampler that only discarded invalid replies would give -- a different distribution."""
    prompt = [0, 1, 2]
    out = {}
    for cont in itertools.product(range(3), repeat=3):
        text = "".join("abc"[t] for t in cont)
        if not re.fullmatch("(a[bc]|b[ab]|c[abc])[abc]", text):
            continue
        ids = prompt + list(cont)
        cache = KVCache(target.config, 1, 32, torch.float32)
        logits = target(torch.tensor(ids), [Segment(cache.allocate(), 0, len(ids))], cache).logits[len(prompt) - 1:-1]
        p = 1.0
        for j, t in enumerate(cont):
            row = logits[j].clone()
            row[3] = float("-inf")  # EOS is not allowed before the reply is complete
            if token_level and j == 1:
                ok = {"a": "bc", "b": "ab", "c": "abc"}["abc"[cont[0]]]
                row[[i for i in range(3) if "abc"[i] not in ok]] = float("-inf")
            p *= float(logits_to_probs(row[None], **PARAMS)[0, t])
        out[cont] = p
    total = sum(out.values())
    return {k: v / total for k, v in out.items()} if not token_level else out


def test_speculative_sampling_matches_the_masked_distribution(monkeypatch):
    target, draft = abc_model(13, 0.4), abc_model(12, 2.0)  # a far draft: many rejections
    eng = Engine(target, AbcTokenizer(), max_len=32, proposer=DraftModelProposer(draft, V, 32),
                 controller=ControllerConfig(max_k=3, fixed_k=3))
    gen = torch.Generator().manual_seed(5)
    monkeypatch.setattr(engine_mod, "request_randomness",
                        lambda _: make_generator(int(torch.randint(0, 2**31, (1,), generator=gen))))
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N_SAMPLES):
        *_, (seq, _) = eng.generate([0, 1, 2], SamplingParams(max_tokens=8, structured=GRAMMAR, **PARAMS))
        assert seq.finish_reason == "stop" and len(seq.generated) == 4  # three tokens, then EOS (forced)
        key = tuple(seq.generated[:3])
        counts[key] = counts.get(key, 0) + 1
    want = exact(target)
    assert abs(sum(want.values()) - 1) < 1e-5 and sum(counts.values()) == N_SAMPLES
    assert set(counts) <= set(want)  # nothing outside the grammar
    assert p_value(counts, want) > 1e-3
    wrong = exact(target, token_level=False)  # the same check tells a different distribution apart
    assert sum(abs(want[k] - wrong[k]) for k in want) / 2 > 0.05 and p_value(counts, wrong) < 1e-6


def p_value(counts: dict, probs: dict) -> float:
    """Chi-square goodness of fit, cells expected fewer than 5 times pooled."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k, p in probs.items():
        if p * N_SAMPLES >= 5:
            obs.append(counts.get(k, 0))
            exp.append(p * N_SAMPLES)
        else:
            rest_o, rest_e = rest_o + counts.get(k, 0), rest_e + p * N_SAMPLES
    obs.append(rest_o)
    exp.append(rest_e)
    return float(chisquare(obs, [e * N_SAMPLES / sum(exp) for e in exp]).pvalue)


# -- the server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    model = tiny_model("qwen2", seed=3, vocab=VOCAB)
    cache = PagedKVCache(model.config, 64, 256, torch.float32, block_size=16, num_slots=4)
    eng = Engine(model, TOK, max_len=256, prefill_chunk=8, cache=cache, proposer=NgramProposer(3, 1))
    with LiveServer(create_app(eng, ServerConfig("m", scheduler=SchedulerConfig(log_interval=0)))) as s:
        yield s


def test_server_response_format_and_guided_fields(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "data?"}], max_tokens=80,
                                  temperature=0, response_format={"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop" and follows("json", r.choices[0].message.content)
    r = c.completions.create(model="m", prompt="data:", max_tokens=80, n=3, temperature=1.0, seed=2,
                             extra_body={"guided_regex": "[a-e]{2,5}-[0-9]{1,3}"})
    assert all(follows("regex", ch.text) for ch in r.choices)
    chunks = c.completions.create(model="m", prompt="pick:", max_tokens=20, temperature=0, stream=True,
                                  extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert follows("choice", "".join(ch.choices[0].text for ch in chunks if ch.choices))
    # vLLM's structured_outputs (its name for the guided_* fields since 0.10.2): the same constraints
    r = c.completions.create(model="m", prompt="data:", max_tokens=80, n=3, temperature=1.0, seed=2,
                             extra_body={"structured_outputs": {"regex": "[a-e]{2,5}-[0-9]{1,3}"}})
    assert all(follows("regex", ch.text) for ch in r.choices)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "data?"}], max_tokens=80,
                                  temperature=0, extra_body={"structured_outputs": {"json": SCHEMA}})
    assert r.choices[0].finish_reason == "stop" and follows("json", r.choices[0].message.content)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "pick"}], max_tokens=20,
                                  temperature=0, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "obj?"}], max_tokens=120,
                                  temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content  # a random model may not close the object within max_tokens
    assert text.lstrip().startswith("{") and (r.choices[0].finish_reason != "stop" or isinstance(json.loads(text), dict))


def test_responses_api_text_format(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.responses.create(model="m", input="data?", max_output_tokens=80, temperature=0,
                           text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}})
    assert r.status == "completed" and follows("json", r.output_text)
    assert r.text.format.type == "json_schema"
    events = list(c.responses.create(model="m", input="data?", max_output_tokens=80, temperature=0, stream=True,
                                     text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


def test_llamacpp_completion_json_schema_and_gbnf_grammar(server):
    r = httpx.post(server.url + "/completion", timeout=60,
                   json={"prompt": "data:", "n_predict": 80, "temperature": 0, "json_schema": SCHEMA}).json()
    assert r["stop_type"] == "eos" and follows("json", r["content"])
    for seed in range(3):
        r = httpx.post(server.url + "/completion", timeout=60,
                       json={"prompt": "sum:", "n_predict": 40, "seed": seed, "grammar": GRAMMARS["gbnf"].grammar}).json()
        assert r["stop_type"] == "eos" and follows("gbnf", r["content"]), r
    bad = httpx.post(server.url + "/completion", json={"prompt": "x", "grammar": "root ::= ("}, timeout=60)
    assert bad.status_code == 400 and "invalid grammar" in bad.json()["error"]["message"]


def test_server_rejects_bad_constraints(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    for body, message in (({"guided_regex": "(unclosed"}, "invalid regex"),
                          ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured output"),
                          ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
                          ({"response_format": {"type": "xml"}}, "response_format"),
                          ({"guided_json": "{not json"}, "not valid JSON"),
                          ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "one structured output"),
                          ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
                          ({"structured_outputs": {"structural_tag": {"type": "x"}}}, "structural_tag is not supported")):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            c.completions.create(model="m", prompt="x", max_tokens=5, extra_body=body)
    r = c.completions.create(model="m", prompt="x", max_tokens=5, temperature=0, extra_body={"guided_choice": ["ok"]})
    assert r.choices[0].text == "ok"  # still serving


def test_a_long_choice_list_is_followed_and_its_matcher_built_once(monkeypatch):
    """2,500 choices (past llguidance's 2,000 items a parser row, as rule alternatives) are one lexeme:
    replies are one of them, a choice that is a prefix of another included; the matcher is built once
    for a spec (``prepare``, off a server's event loop) and copied for each sequence, and an error's
    text is cut short."""
    import types

    import llguidance
    import tokenleap.spec.structured as structured
    choices = [f"c{i}" for i in range(2500)]
    spec = StructuredOutput(choice=choices)
    built = []

    class Counting:  # llguidance's matcher, its constructions counted
        def __new__(cls, *a, **kw):
            built.append(1)
            return llguidance.LLMatcher(*a, **kw)

    for name in ("grammar_from_lark", "grammar_from_regex", "grammar_from_json_schema", "validate_grammar"):
        setattr(Counting, name, staticmethod(getattr(llguidance.LLMatcher, name)))
    counting = types.SimpleNamespace(LLMatcher=Counting, LLTokenizer=llguidance.LLTokenizer,
                                     TokenizerWrapper=llguidance.TokenizerWrapper)
    monkeypatch.setattr(structured, "_llguidance", lambda: counting)
    constraints = Constraints(TOK, VOCAB, (2,))
    constraints.prepare(spec)
    first, second = constraints.make(spec), constraints.make(spec)
    assert len(built) == 1 and first.matcher is not second.matcher
    c1, five = TOK.encode("c1"), TOK.encode("5")
    first.advance(c1)  # "c1" is complete (the reply may end) and begins "c15", "c150", ...
    ok = first.allowed()
    assert ok[2] and ok[five[0]]
    assert second.allowed()[TOK.encode("c")[0]] and not second.allowed()[five[0]]  # a copy has its own state
    eng = engine()
    for seed in range(3):
        reply = run(eng, "pick one", SamplingParams(max_tokens=8, temperature=1.0, seed=seed, structured=spec))
        assert reply.text in choices, reply.text
    with pytest.raises(ConfigError) as e:
        Constraints(TOK, VOCAB, (2,)).make(StructuredOutput(grammar="start: " + " ".join(["("] * 3000)))
    assert len(str(e.value)) < 700


def test_grammars_that_overflowed_the_compilers_stack_are_compiled_or_refused():
    """llguidance's compiler recurses along chains of rules and references: a JSON schema chaining
    1,000 $refs overflowed a default 8 MiB stack and a GBNF chain of 5,000 rules likewise (a segfault
    that took the server down). Compiled on a thread of a large stack, the first is a grammar (and a
    matcher); past the caps (rules, $refs) a grammar is a ConfigError, a 400 for a server."""
    import subprocess
    import sys
    script = """
import json
from tokenleap.config import StructuredOutput
from tokenleap.spec.structured import grammar_of
n = 1000
defs = {f"d{i}": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}]}
        for i in range(n)}
defs[f"d{n}"] = {"type": "integer"}
print(len(grammar_of(StructuredOutput(json={"$ref": "#/$defs/d0", "$defs": defs}))))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and int(done.stdout) > 0, done.stderr[-500:]  # (a segfault: -11)
    chain = "root ::= r0\n" + "".join(f'r{i} ::= "a{i}" r{i + 1} | "b{i}"\n' for i in range(5000)) + 'r5000 ::= "z"\n'
    with pytest.raises(ConfigError, match="rules; at most"):
        Constraints(TOK, VOCAB, (2,)).make(StructuredOutput(grammar=chain))
    refs = {"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/x"} for i in range(3000)},
            "$defs": {"x": {"type": "integer"}}}
    with pytest.raises(ConfigError, match=r"\$refs; at most"):
        Constraints(TOK, VOCAB, (2,)).make(StructuredOutput(json=refs))
    small = "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(300)) + 'r300 ::= "z"\n'
    c = Constraints(TOK, VOCAB, (2,)).make(StructuredOutput(grammar=small))  # a chain of 300 rules: built
    assert c.allowed()[TOK.encode("a")[0]]
    flat = ("root ::= " + " | ".join(f"c{i}" for i in range(1500)) + "\n"
            + "".join(f'c{i} ::= "t{i}"\n' for i in range(1500)))
    assert grammar_of(StructuredOutput(grammar=flat))  # (llama.cpp writes grammars of this many rules for schemas)
