"""``tokenleap chat``: a conversation a turn at a time on a paged engine whose prefix cache keeps the
earlier turns' prompt windows. Each reply equals the same conversation generated from scratch
(``LLM.chat``), with or without speculation; the oldest turns go when the context is full; a
stopped reply stays in the conversation. Then the real command with SmolLM2-135M on piped stdin."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tokenleap.cli.chat import ChatSession
from tokenleap.config import ConfigError, SamplingParams

from serving_helpers import VOCAB
from test_offline_batch import EncodeChatToy, make_llm


def session_llm(kind, max_model_len: int = 256):
    llm = make_llm(kind, max_model_len=max_model_len)
    llm.tokenizer = EncodeChatToy(VOCAB)
    llm.prefill_chunk = 16  # windows of 16 tokens: short toy turns reach the prefix cache
    return llm


@pytest.mark.parametrize("kind", [None, "ngram", "draft"])
def test_each_turn_equals_the_conversation_generated_from_scratch(kind):
    llm = session_llm(kind)
    session = ChatSession(llm, system="sys")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    written = []
    session.reply("warm up", params, written.append)
    assert llm._engine is None  # the LLM's own engine (and its KV cache) is never built for a chat session
    session.clear()
    written.clear()
    for n, text in enumerate(["hello there", "abcabc again", "and once more", "last"]):
        out = session.reply(text, params, written.append)
        ref = llm.chat([{"role": "system", "content": "sys"}, *session.messages[:-1]], params)[0]
        assert out.token_ids == ref.token_ids and session.messages[-1]["content"] == ref.text == "".join(written)
        if n:  # the earlier turns' windows came from the cache
            assert session.cached_tokens >= 16
        written.clear()
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 4 and session.dropped == 0
    session.clear()
    assert session.reply("hi", params, written.append).token_ids == \
        llm.chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], params)[0].token_ids


def test_the_oldest_turns_go_when_the_context_is_full():
    llm = session_llm("ngram", 128)  # a 128-token context
    session = ChatSession(llm)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for text in ["a long first message " * 2, "a second one", "a third one here"]:
        out = session.reply(text, params, lambda _: None)
        assert out.prompt_tokens + 20 <= 128 and len(out.token_ids) == 20  # room for the whole reply kept
    longer = ChatSession(llm)  # a reply of up to a quarter of the window keeps its room: older turns go first
    thirty = SamplingParams(max_tokens=30, ignore_eos=True)
    assert len(longer.reply("a" * 5, thirty, lambda _: None).token_ids) == 30
    second = longer.reply("b" * 10, thirty, lambda _: None)  # with the first turn: 109 tokens of prompt
    assert longer.dropped == 2 and len(second.token_ids) == 30 and second.prompt_tokens + 30 <= 128
    assert session.dropped >= 2 and session.messages[0]["role"] == "user"
    assert session.messages[-2]["content"] == "a third one here"
    ref = llm.chat(session.messages[:-1], params)[0]  # what is left, from scratch
    assert session.messages[-1]["content"] == ref.text
    with pytest.raises(ConfigError, match="context window is 128"):
        session.reply("x" * 400, params, lambda _: None)
    assert session.messages[-2]["content"] == "a third one here"  # the refused message was not kept
    wordy = ChatSession(llm, system="y" * 400)  # a system prompt that alone fills the context: named as such
    with pytest.raises(ConfigError, match="the system prompt .--system. is"):
        wordy.reply("hi", params, lambda _: None)
    tiny = ChatSession(session_llm("ngram", 12))  # no room for a reply at all: said so, no system prompt blamed
    with pytest.raises(ConfigError, match=r"context window \(12 tokens\) leaves no room"):
        tiny.reply("hi", params, lambda _: None)


def test_a_stopped_reply_stays_and_the_next_turn_is_exact():
    llm = session_llm("draft")
    session = ChatSession(llm)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    pieces = []
    out = session.reply("talk a lot", params, pieces.append, stop_requested=lambda: len(pieces) >= 2)
    assert out.finish_reason == "abort" and 0 < out.num_tokens < 30
    assert session.messages[-1] == {"role": "assistant", "content": out.text}
    nxt = session.reply("go on", params, lambda _: None)
    assert nxt.token_ids == llm.chat(session.messages[:-1], params)[0].token_ids
    assert session.engine.cache.lengths == [0]  # each turn's slot was freed


def test_the_stats_line_names_the_dtype_plainly():
    """chat --stats' startup line (``LLM.describe`` of the session's engine) names the dtype as ``float32``,
    as generate's and the draft model's notes do, not as torch's ``torch.float32``."""
    llm = session_llm("draft")
    line = llm.describe(ChatSession(llm).engine)
    assert "(float32, quant none)" in line and "torch." not in line


def test_smollm2_chat_on_piped_stdin(smollm2_gguf):
    cmd = [sys.executable, "-m", "tokenleap.cli.main", "chat", "--model", "smollm2-135m-instruct", "--max-model-len",
           "512", "--max-tokens", "12", "--spec", "ngram", "--stats"]
    # (an unknown command and a line that is not UTF-8 are refused; the conversation goes on, and the exit
    # status says a message was not sent)
    stdin = b"What is the capital of France?\n/colour\ncaf\xff\nAnd of Italy?\n/clear\nName a color.\n"
    run = subprocess.run(cmd, input=stdin, capture_output=True, timeout=600)
    run.stdout, run.stderr = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 1, run.stderr
    assert "unknown command /colour" in run.stderr and "not UTF-8 text (at character 3)" in run.stderr
    from tokenleap.api import LLM
    llm = LLM("smollm2-135m-instruct", max_model_len=512)
    greedy = SamplingParams(max_tokens=12)
    first = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy)[0].text
    second = llm.chat([{"role": "user", "content": "What is the capital of France?"},
                       {"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}],
                      greedy)[0].text
    third = llm.chat([{"role": "user", "content": "Name a color."}], greedy)[0].text
    assert run.stdout == f"{first}\n{second}\n{third}\n" and "Paris" in first
    assert run.stderr.count("tok/s") == 3 and "new conversation" in run.stderr and "torch." not in run.stderr
    clean = subprocess.run(cmd, input=b"Name a color.\n", capture_output=True, timeout=600)
    assert clean.returncode == 0 and clean.stdout.decode() == f"{third}\n", clean.stderr


def test_a_failed_turn_leaves_the_conversation_as_it_was():
    llm = session_llm(None)
    session = ChatSession(llm)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    session.reply("first", params, lambda _: None)
    before = list(session.messages)

    def broken(_):
        raise RuntimeError("the terminal went away")
    with pytest.raises(RuntimeError):
        session.reply("second", params, broken)
    assert session.messages == before and session.engine.cache.lengths == [0]
    assert session.reply("second", params, lambda _: None).token_ids == llm.chat(session.messages[:-1], params)[0].token_ids


def test_ctrl_c_drops_continued_lines_and_asks_again(monkeypatch, capsys):
    """A message continued with "\\" and then Ctrl-C: the pending lines are dropped and a fresh prompt
    asked (a shell's rule), Ctrl-C twice in a row at a fresh prompt ends the chat (once: it says how to quit),
    the end of input sends what is pending."""
    from tokenleap.cli.chat import _read_message

    def typed(*events):
        it = iter(events)

        def fake_input(prompt=""):
            e = next(it)
            if isinstance(e, BaseException):
                raise e
            return e
        monkeypatch.setattr("builtins.input", fake_input)
    typed("Say banana\\", KeyboardInterrupt(), "Say apple")
    assert _read_message(True) == "Say apple"
    capsys.readouterr()
    typed(KeyboardInterrupt(), "still here")  # one Ctrl-C at a fresh prompt: how to quit, and the chat goes on
    assert _read_message(True) == "still here" and "Ctrl-C again, Ctrl-D or /exit quits" in capsys.readouterr().err
    typed(KeyboardInterrupt(), KeyboardInterrupt())  # twice in a row: the end
    assert _read_message(True) is None
    typed(KeyboardInterrupt(), "x\\", KeyboardInterrupt(), KeyboardInterrupt(), "y")  # not in a row: asks again
    assert _read_message(True) == "y"
    typed("one\\", "two\\", EOFError())
    assert _read_message(True) == "one\ntwo"
    typed("piped\\", KeyboardInterrupt())  # a script's input: interrupted (main exits 130), not a normal end
    with pytest.raises(KeyboardInterrupt):
        _read_message(False)
