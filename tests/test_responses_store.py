"""Stored Responses API objects, through the official ``openai`` client against a live server on a
tiny model: ``previous_response_id`` continues a stored conversation (the reply equals that whole
conversation run alone), responses can be retrieved, listed by input item and deleted, ``store:
false`` keeps nothing, and the store drops its least recently used response past its capacity."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.response_store import LRUStore, StoredResponse, page
from tokenleap.serve.scheduler import SchedulerConfig

from serving_helpers import LiveServer, paged_engine, wait_until
from test_responses_api import check_status, reference
from test_server import KEY, NAME, client, start


@pytest.fixture(scope="module")
def server():
    with start(api_key=KEY) as s:
        yield s


def test_previous_response_id_continues_the_conversation(server):
    c = client(server)
    r1 = c.responses.create(model=NAME, instructions="be brief", input="hello there", max_output_tokens=6,
                            temperature=0)
    assert r1.store is True and r1.previous_response_id is None
    r2 = c.responses.create(model=NAME, previous_response_id=r1.id, input="and then?", max_output_tokens=8,
                            temperature=0)
    # the earlier turns come first; the earlier instructions do not (OpenAI does not carry them over)
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "and then?"}]
    _, ref = reference(turns, 8)
    assert r2.output_text == ref.text and r2.previous_response_id == r1.id
    check_status(r2, ref)
    # a third turn, streamed, with instructions of its own: the whole chain before it
    events = list(c.responses.create(model=NAME, previous_response_id=r2.id, instructions="now longer",
                                     input=[{"role": "user", "content": [{"type": "input_text", "text": "go"}]}],
                                     max_output_tokens=7, temperature=0.9, extra_body={"seed": 3}, stream=True))
    done = events[-1].response
    _, ref = reference([{"role": "system", "content": "now longer"}, *turns,
                        {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "go"}],
                       7, temperature=0.9, seed=3)
    assert done.output_text == ref.text and done.previous_response_id == r2.id
    # the streamed response is stored as its last event gave it
    assert c.responses.retrieve(done.id).model_dump() == done.model_dump()
    # each entry holds the chain's messages, shared with the entries before it, not copied
    store = server.app.state.server.response_store
    first, second = (asyncio.run(store.get(r.id)).messages for r in (r1, r2))
    assert second[:2] == first and all(a is b for a, b in zip(second, first))


def test_retrieve_list_input_items_and_delete(server):
    c = client(server)
    items = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "one"},
             {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    r = c.responses.create(model=NAME, input=items, max_output_tokens=5, temperature=0, metadata={"k": "v"})
    got = c.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    listed = c.responses.input_items.list(r.id)  # newest first, as OpenAI lists them
    assert [(i.role, i.content[0].text) for i in listed.data] == [(m["role"], m["content"]) for m in items[::-1]]
    assert [p.type for i in listed.data for p in i.content] == ["input_text", "output_text", "input_text",
                                                               "input_text"]
    assert len({i.id for i in listed.data}) == 4 and listed.has_more is False
    first = c.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in first.data] == ["rules", "one"] and first.has_more is True
    rest = c.responses.input_items.list(r.id, order="asc", after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["two", "three"] and rest.has_more is False
    headers = {"Authorization": f"Bearer {KEY}"}
    for query, message in (("limit=0", "limit must be"), ("limit=x", "limit must be"), ("order=up", "order must"),
                           ("after=nope", "no input item")):
        bad = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items?{query}", headers=headers)
        assert bad.status_code == 400 and message in bad.json()["error"]["message"]
    cancel = httpx.post(f"{server.url}/v1/responses/{r.id}/cancel", headers=headers)
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    deleted = httpx.delete(f"{server.url}/v1/responses/{r.id}", headers=headers)
    assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id),
                 lambda: c.responses.input_items.list(r.id),
                 lambda: c.responses.create(model=NAME, previous_response_id=r.id, input="x", max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            call()
    assert httpx.get(f"{server.url}/v1/responses/{r.id}").status_code == 401  # the API key is checked first


def test_store_false_keeps_nothing(server):
    c = client(server)
    r = c.responses.create(model=NAME, input="forget me", max_output_tokens=3, temperature=0, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    events = list(c.responses.create(model=NAME, input="forget me", max_output_tokens=3, temperature=0,
                                     store=False, stream=True))
    assert events[-1].response.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(events[-1].response.id)


def test_the_least_recently_used_response_is_dropped_past_capacity():
    config = ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0), responses_store=2)
    with LiveServer(create_app(paged_engine(None), config)) as s:
        c = client(s)
        a, b = (c.responses.create(model=NAME, input=t, max_output_tokens=2, temperature=0) for t in "ab")
        c.responses.retrieve(a.id)  # a is now more recently used than b
        d = c.responses.create(model=NAME, input="d", max_output_tokens=2, temperature=0)
        assert {c.responses.retrieve(x.id).id for x in (a, d)} == {a.id, d.id}
        with pytest.raises(openai.NotFoundError, match="keeps the last 2 responses"):
            c.responses.retrieve(b.id)
    config = ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0), responses_store=0)
    with LiveServer(create_app(paged_engine(None), config)) as s:
        r = client(s).responses.create(model=NAME, input="a", max_output_tokens=2, temperature=0)
        assert r.store is False  # nothing can be kept: the response says so
        with pytest.raises(openai.NotFoundError):
            client(s).responses.retrieve(r.id)


def test_lru_store_and_paging_units():
    store = LRUStore(2)
    entry = StoredResponse({"id": "x"}, [], [])
    for rid in ("r1", "r2", "r3"):
        asyncio.run(store.put(rid, entry))
    assert len(store) == 2 and asyncio.run(store.get("r1")) is None and asyncio.run(store.get("r3")) is entry
    assert asyncio.run(store.delete("r3")) and not asyncio.run(store.delete("r3")) and len(store) == 1
    with pytest.raises(ValueError):
        LRUStore(-1)
    items = [{"id": f"i{n}"} for n in range(5)]
    assert page(items, 2, "desc", None) == {"object": "list", "data": [{"id": "i4"}, {"id": "i3"}],
                                            "first_id": "i4", "last_id": "i3", "has_more": True}
    assert page(items, 20, "asc", "i3")["data"] == [{"id": "i4"}]
    assert page([], 20, "desc", None) == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                          "has_more": False}


class SlowProposer:
    """An n-gram proposer that takes ``delay`` seconds a step: a reply of 100 tokens runs for seconds."""

    def __init__(self, inner, delay: float = 0.05) -> None:
        self.inner, self.name, self.delay = inner, inner.name, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_many(self, requests):
        import time
        time.sleep(self.delay)
        return self.inner.propose_many(requests)


def test_background_responses_run_on_and_can_be_cancelled(server):
    """background: the response comes back at once, in_progress and empty; it is stored completed
    (the reply equal to the conversation run alone) when done. A running one can be cancelled (stored
    cancelled) or deleted; what cannot be done is a 400 that says why."""
    c = client(server)
    _, ref = reference([{"role": "user", "content": "hello there"}], 12, temperature=0)
    r = c.responses.create(model=NAME, input="hello there", max_output_tokens=12, temperature=0, background=True)
    assert (r.status, r.output, r.background) == ("in_progress", [], True)
    assert wait_until(lambda: c.responses.retrieve(r.id).status != "in_progress")
    done = c.responses.retrieve(r.id)
    check_status(done, ref)
    assert done.output_text == ref.text and done.usage.output_tokens == len(ref.generated)
    for extra, message in (({"store": False}, "must be stored"), ({"stream": True}, "not streamed")):
        with pytest.raises(openai.BadRequestError, match=message):
            c.responses.create(model=NAME, input="x", background=True, **extra)

    # a fixed draft length: every step proposes, so takes the delay (the timed controller prices the delay as
    # the draft's cost and decodes plainly, and the reply then ends in well under a second)
    eng = paged_engine("ngram", k=2)
    eng.proposer = SlowProposer(eng.proposer)
    with LiveServer(create_app(eng, ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0)))) as s:
        slow = client(s)
        long = dict(model=NAME, input="hello there", max_output_tokens=100, temperature=0, background=True,
                    extra_body={"ignore_eos": True})
        r = slow.responses.create(**long)
        cancelled = slow.responses.cancel(r.id)
        assert cancelled.status == "cancelled" and slow.responses.retrieve(r.id).status == "cancelled"
        again = httpx.post(f"{s.url}/v1/responses/{r.id}/cancel")
        assert again.status_code == 400 and "has ended (cancelled)" in again.json()["error"]["message"]
        running = slow.responses.create(**long)
        with pytest.raises(openai.BadRequestError, match="still running"):
            slow.responses.create(model=NAME, input="more", previous_response_id=running.id)
        slow.responses.delete(running.id)  # stops it first
        with pytest.raises(openai.NotFoundError):
            slow.responses.retrieve(running.id)
        # deleted where it does not run (another replica: the shared store alone), it stays deleted at its end
        elsewhere = slow.responses.create(**{**long, "max_output_tokens": 12})
        store = s.app.state.server.response_store
        assert asyncio.run(store.delete(elsewhere.id))
        assert wait_until(lambda: not s.app.state.server.scheduler.running and eng.cache.num_used_blocks == 0)
        with pytest.raises(openai.NotFoundError):
            slow.responses.retrieve(elsewhere.id)
        assert wait_until(lambda: eng.cache.num_used_blocks == 0)  # the cancelled sequences were let go
