"""A streamed completion's or chat reply's server-sent events, in OpenAI's chunk form: each choice's
new text (a chat reply's thinking in deltas of its own, its content held back from where a tool call
may begin, the calls as the model writes them), logprobs, finish reasons, usage as the request's stream_options
ask, then ``[DONE]``."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import failed
from tokenleap.serve.responses import Format, chat_delta, sse
from tokenleap.serve.reply_stream import ReplyStream
from tokenleap.serve.tool_stream import CallPart, merged
from tokenleap.serve.tools import ToolPlan


async def openai_chunks(job: Job, fmt: Format) -> AsyncIterator[str]:
    """The events of ``job``'s replies (the server's ``_logged`` ends the job, however the stream ends)."""
    chunk_fmt = replace(fmt, object=fmt.object + (".chunk" if fmt.chat else ""), tools=ToolPlan())
    offsets = [0] * len(job.requests)  # text_offset: characters of each choice's tokens so far
    # a thinking model's reasoning apart; content held back from a <tool_call> on, the calls in parts
    splits = [ReplyStream(fmt.reasoning, fmt.tools) for _ in job.requests]
    prompt_ids = [{"prompt_token_ids": list(r.seq.prompt)} if fmt.token_ids else {} for r in job.requests]
    if fmt.chat:
        first = [chat_delta(i, {"role": "assistant", "content": ""}, None) for i in range(len(job.requests))]
        yield sse(chunk_fmt.obj(first, **prompt_ids[0], **fmt.with_usage(job.usage)))
    async for i, out in job.outputs():
        if out.error:
            yield sse(failed(out.error, out.error_status).body())
            break
        text, scored = job.piece(i, out)
        reason = out.finish_reason
        ids = {"token_ids": out.token_ids} if fmt.token_ids else {}  # vLLM's return_token_ids: each chunk's
        if not fmt.chat:  # (a completion choice's first chunk carries its prompt's ids)
            ids, prompt_ids[i] = {**ids, **prompt_ids[i]}, {}
        # (a call cut off by max_tokens is sent as far as it was written, with finish_reason "length", as OpenAI's)
        thought, text, parts, calls = splits[i].feed(text, reason is not None, reason == "length")
        if thought:  # the thinking first, in a delta of its own
            yield sse(chunk_fmt.obj([chat_delta(i, {"reasoning_content": thought}, None)], **fmt.with_usage(job.usage)))
        if calls and reason != "length":
            reason = "tool_calls"
        if parts or calls:  # the content first, then the calls' parts, then a finish reason in a chunk of its
            # own (as OpenAI sends it: the openai SDK's stream helper closes a call's arguments on the chunk after it)
            if text or (scored and fmt.tokens) or ids:
                choice = {**chunk_fmt.choice(i, text, None, scored, offsets[i], delta=True), **ids}
                yield sse(chunk_fmt.obj([choice], **fmt.with_usage(job.usage)))
            if parts:
                yield sse(chunk_fmt.obj([chat_delta(i, {"tool_calls": _call_deltas(parts)}, None)],
                                        **fmt.with_usage(job.usage)))
            if reason is not None:
                yield sse(chunk_fmt.obj([{**chat_delta(i, {}, reason), "stop_reason": job.stop_reason(i)}],
                                        **fmt.with_usage(job.usage)))
        elif text or reason or (scored and fmt.tokens) or ids:
            choice = {**chunk_fmt.choice(i, text, reason, scored, offsets[i], delta=True), **ids}
            if reason is not None:
                choice["stop_reason"] = job.stop_reason(i)
            yield sse(chunk_fmt.obj([choice], **fmt.with_usage(job.usage)))
        if fmt.tokens:
            offsets[i] += sum(len(fmt.tokens.text(t)) for t, _ in scored)
    else:
        if fmt.include_usage:
            yield sse(chunk_fmt.obj([], usage=job.usage()))
    yield sse("[DONE]")


def _call_deltas(parts: list[CallPart]) -> list[dict]:
    """Calls' parts as OpenAI streams them: a call's first delta has its id, type and function name,
    the later ones the next text of its arguments."""
    out = []
    for p in merged(parts):
        fn = {"name": p.name, "arguments": p.arguments} if p.name is not None else {"arguments": p.arguments}
        out.append({"index": p.index, **({"id": p.id, "type": "function"} if p.name is not None else {}),
                    "function": fn})
    return out
