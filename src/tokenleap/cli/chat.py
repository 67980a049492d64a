"""``tokenleap chat``: talk with a model in the terminal, as llama.cpp's conversation mode or
``transformers chat`` do -- each reply streamed, the conversation kept between turns, with the same
speculation, sampling and model flags as ``generate``.

Every turn renders the whole conversation with the model's chat template and decodes it on a paged
engine of one slot whose prefix cache keeps what earlier turns computed, so a turn computes only what
is new since: the new message, where the cache keeps single blocks of prompts and replies (an int4 /
int6 model on the compiled layers); else about the last reply too (whole prefill windows of prompts). A conversation that
outgrows the context window loses its oldest turns (the system prompt stays), so that a reply has
room for up to a quarter of the window; a reply cut by the window's end says so. Ctrl-C stops a reply
where it is (what was written stays in the conversation); at the prompt, Ctrl-D, /exit or Ctrl-C twice
ends the session (Ctrl-C on piped input: interrupted, exit 130). Lines ending in a backslash continue on the
next line.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from tokenleap.cli.main import (add_chat_template_arg, add_model_args, add_sampling_args, sampling_from_args,
                                spec_config)
from tokenleap.cli.output import stats_line
from tokenleap.config import ConfigError, SamplingParams

HELP = "/clear starts a new conversation, /exit (or Ctrl-D) quits, a line ending in \\ continues; Ctrl-C stops a reply"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="talk with a model in the terminal (multi-turn, streamed)")
    add_model_args(p)
    add_chat_template_arg(p)
    p.add_argument("--system", help="system prompt (default: the chat template's own, if any)")
    add_sampling_args(p, max_tokens=1024)
    p.add_argument("--stats", action="store_true", help="after each reply: tokens/s and speculation metrics on stderr")
    p.set_defaults(func=cmd_chat)


class ChatSession:
    """One conversation with ``llm`` (an ``api.LLM``), a turn at a time (see the module docstring)."""

    def __init__(self, llm, system: str | None = None) -> None:
        from tokenleap.serve.batch import session_engine
        self.llm, self.system = llm, system
        self.engine = session_engine(llm)
        self.messages: list[dict[str, Any]] = []
        self.dropped = 0  # turns dropped so far to fit the context window
        self.cached_tokens = 0  # of the last turn's prompt, the tokens its prefix cache supplied

    def clear(self) -> None:
        self.messages = []

    def prompt_ids(self, reply_room: int, least_room: int | None = None) -> list[int]:
        """The conversation rendered for the next reply, its oldest turns dropped until it and
        ``reply_room`` tokens fit the context (a ConfigError, the conversation untouched, if the last
        message does not fit even alone with ``least_room`` tokens, by default ``reply_room``)."""
        least_room = reply_room if least_room is None else least_room
        if least_room >= self.engine.max_len:
            raise ConfigError(f"the context window ({self.engine.max_len} tokens) leaves no room for a message "
                              f"and a reply of {least_room} tokens (raise --max-model-len)")
        system = self._encode([]) if self.system else []
        if len(system) + least_room > self.engine.max_len:
            raise ConfigError(f"the system prompt (--system) is {len(system)} tokens with the chat template; the "
                              f"context window is {self.engine.max_len} (raise --max-model-len, or shorten it)")
        alone = self._encode(self.messages[-1:])
        if len(alone) + least_room > self.engine.max_len:
            raise ConfigError(f"the message is {len(alone)} tokens with the chat template; the context window is "
                              f"{self.engine.max_len} (raise --max-model-len, or write less)")
        from tokenleap.serve.context_window import fit_turns
        kept, ids = fit_turns(self.messages, self._encode, self.engine.max_len - reply_room)  # (cut before a user turn)
        dropped = len(self.messages) - len(kept)
        del self.messages[:dropped]  # (gone for good: the next turns need not render them again)
        self.dropped += dropped
        return ids

    def _encode(self, messages: list[dict[str, Any]]) -> list[int]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return self.llm.tokenizer.encode_chat(head + messages)

    def reply(self, text: str, params: SamplingParams, write, stop_requested=lambda: False):
        """Add the user's ``text``, stream the reply through ``write`` (stopping early when
        ``stop_requested()`` turns true) and keep it; returns the reply's ``RequestOutput``."""
        from tokenleap.outputs import request_output
        self.messages.append({"role": "user", "content": text})
        try:
            # room for the reply: up to a quarter of the window (older turns go first); a message is
            # refused only where not even 16 tokens are left for it
            room = min(params.max_tokens, max(16, self.engine.max_len // 4))
            ids = self.prompt_ids(room, min(params.max_tokens, 16))
        except ConfigError:
            self.messages.pop()
            raise
        t0, seq = time.perf_counter(), None
        steps = self.engine.generate(ids, params)
        try:
            for seq, piece in steps:
                write(piece)
                if stop_requested():
                    break
        except BaseException:
            self.messages.pop()  # no reply: the message is not part of the conversation
            raise
        finally:
            steps.close()  # frees the sequence's slot (its prompt windows stay cached)
        self.messages.append({"role": "assistant", "content": seq.text})
        self.cached_tokens = seq.cached_tokens  # prompt tokens the prefix cache supplied
        return request_output(ids, seq, time.perf_counter() - t0)


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    spec = spec_config(args)
    from tokenleap.api import LLM
    llm = LLM(args.model, dtype=args.dtype, quant=args.quant, speculative=spec, max_model_len=args.max_model_len,
              cache_dir=args.cache_dir, chat_template=args.chat_template)
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ConfigError(f"{args.model} has no chat template: use an instruct / chat model, give one with "
                          "--chat-template, or tokenleap generate")
    session = ChatSession(llm, args.system)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # undecodable input: refused line by line, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    if args.stats:
        print(f"[tokenleap] {llm.describe(session.engine)}", file=sys.stderr)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"[tokenleap] chatting with {args.model}: {HELP}", file=sys.stderr)
    refused = 0  # messages not sent: piped input then exits 1, as a script needs to see
    while True:
        text = _read_message(interactive)
        if text is None or text.strip() in ("/exit", "/quit"):
            return 1 if refused and not interactive else 0
        if text.strip() in ("/clear", "/reset"):
            session.clear()
            print("[tokenleap] new conversation", file=sys.stderr)
            continue
        if text.strip() == "/help":
            print(f"[tokenleap] {HELP}", file=sys.stderr)
            continue
        if text.strip().startswith("/") and len(text.split()) == 1 and "/" not in text.strip()[1:]:
            print(f"[tokenleap] unknown command {text.strip()}; /help lists them", file=sys.stderr)
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes that are not UTF-8 (read as lone surrogates)
            print(f"[tokenleap] the message is not UTF-8 text (at character {e.start}): not sent", file=sys.stderr)
            refused += 1
            continue
        if not text.strip():
            continue
        before = session.dropped
        stop = _StopOnInterrupt()
        try:
            with stop:
                out = session.reply(text, params, _write, stop.requested)
        except ConfigError as e:
            print(f"[tokenleap] {e}", file=sys.stderr)
            refused += 1
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if session.dropped > before:
            print(f"[tokenleap] the conversation outgrew the context window: its {session.dropped - before} oldest "
                  "messages were dropped", file=sys.stderr)
        if stop.hit:
            print("[tokenleap] reply stopped", file=sys.stderr)
        elif out.finish_reason == "length" and out.prompt_tokens + len(out.token_ids) >= session.engine.max_len:
            print(f"[tokenleap] the reply reached the end of the context window ({session.engine.max_len} tokens) "
                  "and was cut; the next message drops the oldest turns (or raise --max-model-len)", file=sys.stderr)
        if args.stats:
            print(f"[tokenleap] {stats_line(out.stats)}; prompt {out.prompt_tokens} tokens, "
                  f"{session.cached_tokens} of them cached", file=sys.stderr)


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _read_message(interactive: bool) -> str | None:
    """The next message (continued lines joined), or None at the end of input or a second Ctrl-C in a row at
    a fresh prompt (the first says how to quit: a Ctrl-C meant for a reply that had just ended does not
    lose the conversation, as in Node's REPL). Ctrl-C with continued lines pending drops them and asks
    again (as a shell does); the end of input sends them."""
    lines, prompt, warned = [], "> ", False
    while True:
        try:
            line = input(prompt if interactive else "")
        except KeyboardInterrupt:
            if not interactive:
                raise  # a script's input cut by Ctrl-C: main reports "interrupted" and exits 130
            print(file=sys.stderr)
            if not lines and warned:
                return None
            if not lines:
                print("(Ctrl-C again, Ctrl-D or /exit quits)", file=sys.stderr)
            warned, lines, prompt = not lines, [], "> "
            continue
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return "\n".join(lines) if lines else None
        warned = False
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = "... "
            continue
        lines.append(line)
        return "\n".join(lines)


class _StopOnInterrupt:
    """While active, Ctrl-C asks the reply to stop after the current step instead of raising."""

    def __init__(self) -> None:
        self.hit = False
        self._old = None

    def requested(self) -> bool:
        return self.hit

    def __enter__(self) -> "_StopOnInterrupt":
        def on_interrupt(signum, frame):
            self.hit = True
        try:
            self._old = signal.signal(signal.SIGINT, on_interrupt)
        except ValueError:  # not the main thread: Ctrl-C keeps its default
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
