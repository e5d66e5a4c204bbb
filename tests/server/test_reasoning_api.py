"""Reasoning models through a real server and the openai client: the thinking split into
``reasoning_content`` / ``reasoning`` (non-streamed and streamed), ``include_reasoning``,
tool calls and structured outputs applying to what follows the thinking, and each
``--reasoning-parser``'s notion of where thinking starts. The model is the scripted
Llama of tests/scripted_model.py, so every expected text is exact."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from server_helpers import ServerProcess, free_port, serve_cmd

from scripted_model import TOOL_CALL, scripted_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_capital",
            "description": "The capital city of a country.",
            "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]},
        },
    }
]


def _client(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(reasoning_servers) -> OpenAI:
    return _client(reasoning_servers.get())


def _chat(client: OpenAI, kwargs: dict | None = None, body: dict | None = None, **kw):
    """``kwargs``: the chat template's; ``body``: fields the openai client does not know."""
    extra = {**(body or {}), **({"chat_template_kwargs": kwargs} if kwargs else {})}
    kw = {"messages": QUESTION, "max_tokens": 40, "temperature": 0, **kw}
    return client.chat.completions.create(model=client.models.list().data[0].id, extra_body=extra, **kw)


def _reasoning(message) -> tuple[str | None, str | None]:
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning"), "both of vLLM's spellings, equal"
    return extra.get("reasoning_content"), message.content


def _stream(
    client: OpenAI, kwargs: dict | None = None, body: dict | None = None, **kw
) -> tuple[list[str], str, list, str | None]:
    """(the reasoning deltas, the content, the tool-call deltas, finish_reason); checks no
    content arrives before the thinking has ended."""
    thoughts: list[str] = []
    content, calls, finish = "", [], None
    for chunk in _chat(client, kwargs, body, stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            extra = d.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                assert not content, "thinking after the answer began"
                thoughts.append(extra["reasoning_content"])
            content += d.content or ""
            calls += d.tool_calls or []
            finish = choice.finish_reason or finish
    return thoughts, content, calls, finish


def test_the_thinking_is_split_from_the_answer(client: OpenAI) -> None:
    r = _chat(client)
    assert _reasoning(r.choices[0].message) == ("I reckon so.", "Paris it is!")
    assert r.choices[0].finish_reason == "stop"


def test_a_prompt_that_opened_or_closed_the_thinking(client: OpenAI) -> None:
    opened = _chat(client, {"think_in_prompt": True})  # Qwen3-Thinking templates end with <think>
    assert _reasoning(opened.choices[0].message) == ("I reckon so.", "Paris it is!")
    closed = _chat(client, {"enable_thinking": False})  # <think></think> in the prompt
    assert _reasoning(closed.choices[0].message) == (None, "Paris it is!")


def test_streamed_deltas_join_to_the_message(client: OpenAI) -> None:
    thoughts, content, calls, finish = _stream(client)
    assert len(thoughts) >= 2, "the thinking streams as it is generated"
    assert ("".join(thoughts), content, calls, finish) == ("I reckon so.", "Paris it is!", [], "stop")


def test_include_reasoning_false_leaves_the_thinking_out(client: OpenAI) -> None:
    r = _chat(client, body={"include_reasoning": False})
    assert _reasoning(r.choices[0].message) == (None, "Paris it is!")
    thoughts, content, _, _ = _stream(client, body={"include_reasoning": False})
    assert (thoughts, content) == ([], "Paris it is!")


def test_a_length_cut_inside_the_thinking(client: OpenAI) -> None:
    r = _chat(client, max_tokens=3)  # <think> I ▁reckon
    assert _reasoning(r.choices[0].message) == ("I reckon", None)
    assert r.choices[0].finish_reason == "length"
    opened = _chat(client, max_tokens=1)  # <think> alone: null, as the stream sends no reasoning ("" before)
    assert _reasoning(opened.choices[0].message) == (None, None)
    assert _stream(client, max_tokens=1)[:2] == ([], "")


def test_tool_calls_are_read_after_the_thinking(client: OpenAI) -> None:
    r = _chat(client, tools=TOOLS)
    msg = r.choices[0].message
    assert _reasoning(msg)[0] == "Need a tool" and not msg.content
    (call,) = msg.tool_calls
    assert call.function.name == "get_capital" and json.loads(call.function.arguments) == {"country": "France"}
    assert r.choices[0].finish_reason == "tool_calls"
    thoughts, content, calls, finish = _stream(client, tools=TOOLS)
    assert ("".join(thoughts), content, finish) == ("Need a tool", "", "tool_calls")
    args = "".join(c.function.arguments or "" for c in calls)
    assert [c.function.name for c in calls if c.function.name] == ["get_capital"]
    assert json.loads(args) == {"country": "France"}


def test_structured_outputs_constrain_only_what_follows_the_thinking(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}
    r = _chat(client, response_format=fmt)
    # free while thinking (the grammar would have forbidden "I"), then JSON instead of "Paris"
    reasoning, content = _reasoning(r.choices[0].message)
    assert reasoning == "I reckon so." and json.loads(content) == json.loads(TOOL_CALL)
    closed = _chat(client, {"enable_thinking": False}, response_format=fmt)  # the prompt ended the thinking
    assert _reasoning(closed.choices[0].message)[0] is None
    assert json.loads(closed.choices[0].message.content) == json.loads(TOOL_CALL)


def test_include_reasoning_must_be_a_boolean(reasoning_servers) -> None:
    srv = reasoning_servers.get()
    r = httpx.post(
        srv.base_url + "/v1/chat/completions",
        json={"model": "x", "messages": QUESTION, "include_reasoning": "sometimes"},
        timeout=30,
    )
    assert r.status_code == 400 and "include_reasoning" in r.text


# -- the other parsers: one server each ------------------------------------------------


@pytest.fixture(scope="module")
def other_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    folder = scripted_model(tmp_path_factory.mktemp("scripted"))
    servers = {}
    for name in ("deepseek_r1", "granite"):  # started together, waited for in turn
        port = free_port()
        log = tmp_path_factory.mktemp(name) / "server.log"
        servers[name] = ServerProcess(serve_cmd(port, str(folder), "--reasoning-parser", name), port, log)
    try:
        for srv in servers.values():
            srv.wait_ready()
        yield servers
    finally:
        for name, srv in servers.items():
            code = srv.stop()
            assert code == 0, f"{name} exited with {code}:\n{srv.log()}"


def test_deepseek_r1_thinks_from_the_first_token(other_servers) -> None:
    c = _client(other_servers["deepseek_r1"])
    for kwargs in ({"think_in_prompt": True}, None):  # with or without <think> written by the model
        assert _reasoning(_chat(c, kwargs).choices[0].message) == ("I reckon so.", "Paris it is!")
    assert _reasoning(_chat(c, {"enable_thinking": False}).choices[0].message) == (None, "Paris it is!")
    thoughts, content, _, _ = _stream(c, {"think_in_prompt": True})
    assert ("".join(thoughts), content) == ("I reckon so.", "Paris it is!")


def test_granite_reads_its_thought_and_response_markers(other_servers) -> None:
    c = _client(other_servers["granite"])
    r = _chat(c, {"thinking": True})
    assert _reasoning(r.choices[0].message) == (" Hmm, rivers. ", " Rome.")
    thoughts, content, _, _ = _stream(c, {"thinking": True})
    assert ("".join(thoughts), content) == (" Hmm, rivers. ", " Rome.")
    plain = _chat(c).choices[0].message  # no thought marker: all of it is the answer
    assert _reasoning(plain) == (None, "<think>I reckon so.</think>Paris it is!")
    # Granite's start marker is several tokens, so the first token cannot say whether the model
    # thinks: a grammar binds from it (it waited for "Here is my response:", never written, and
    # nothing was constrained)
    for kwargs in (None, {"thinking": True}):
        bound = _chat(c, kwargs, body={"structured_outputs": {"regex": "Paris"}}).choices[0]
        assert (bound.message.content, bound.finish_reason) == ("Paris", "stop"), bound


def test_chat_template_kwargs_reach_the_template_on_chat_and_tokenize(reasoning_servers, client: OpenAI) -> None:
    srv = reasoning_servers.get()
    closed = _chat(client, {"enable_thinking": False})
    body = {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}, "return_token_strs": True}
    tok = httpx.post(srv.base_url + "/tokenize", json=body, timeout=30).json()
    assert tok["token_strs"][-2:] == ["<think>", "</think>"] and tok["count"] == closed.usage.prompt_tokens
    model = client.models.list().data[0].id
    for name in ("tokenize", "add_generation_prompt", "messages"):  # the server's own: a 400 naming it
        for path in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(
                srv.base_url + path,
                json={"model": model, "messages": QUESTION, "chat_template_kwargs": {name: True}},
                timeout=30,
            )
            assert r.status_code == 400 and name in r.json()["error"]["message"], (path, r.text)


def test_structured_outputs_bind_a_model_that_does_not_open_its_thinking(client: OpenAI) -> None:
    """Under the qwen3 parser a prompt that leaves the thinking to the model: the grammar
    waited for a </think> that a model which does not think never writes, so nothing was
    constrained (the Granite script's text came back). Now the first token decides."""
    r = _chat(client, {"thinking": True}, body={"structured_outputs": {"regex": "Paris"}})
    assert r.choices[0].message.content == "Paris" and r.choices[0].finish_reason == "stop"


def test_a_grammar_no_token_can_continue_ends_the_row(client: OpenAI) -> None:
    """ "▁it" is this tokenizer's spelling of " it", which xgrammar reads as its raw text: after
    "Paris" no token continues the regex. The row drew token 0 until max_tokens; it ends."""
    r = _chat(
        client,
        {"enable_thinking": False},
        body={"structured_outputs": {"regex": "Paris it is!"}, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.message.content == "Paris" and choice.finish_reason == "stop", choice
    assert 0 not in choice.model_extra["token_ids"]


def test_continuing_a_message_that_opened_its_thinking(client: OpenAI) -> None:
    """The final assistant message being continued ends inside <think>: what follows is
    thinking until </think> (it came back as content, </think> and all)."""
    messages = [*QUESTION, {"role": "assistant", "content": "<think> I"}]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    r = _chat(client, body=body, messages=messages)
    assert _reasoning(r.choices[0].message) == (" reckon so.", "Paris it is!")
    thoughts, content, _, _ = _stream(client, body=body, messages=messages)
    assert ("".join(thoughts), content) == (" reckon so.", "Paris it is!")
    constrained = _chat(client, body={**body, "structured_outputs": {"regex": "Paris"}}, messages=messages)
    assert _reasoning(constrained.choices[0].message) == (" reckon so.", "Paris")


def test_responses_put_the_thinking_in_a_reasoning_item(client: OpenAI) -> None:
    """/v1/responses splits as chat does: a reasoning item, then the message (the thinking came
    back inside output_text), streamed as reasoning_text events before the answer's."""
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input=QUESTION[0]["content"], max_output_tokens=40, temperature=0)
    assert [it.type for it in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "I reckon so." and r.output_text == "Paris it is!"
    assert r.usage.output_tokens_details.reasoning_tokens == 4  # "I", " reckon", " so", "."
    kinds, thought, answer, done = [], "", "", None
    with client.responses.stream(model=model, input=QUESTION[0]["content"], max_output_tokens=40, temperature=0) as s:
        for ev in s:
            kinds.append(ev.type)
            thought += ev.delta if ev.type == "response.reasoning_text.delta" else ""
            answer += ev.delta if ev.type == "response.output_text.delta" else ""
            done = ev.response if ev.type == "response.completed" else done
    assert (thought, answer) == ("I reckon so.", "Paris it is!")
    firsts = [kinds.index(k) for k in ("response.reasoning_text.delta", "response.reasoning_text.done")]
    assert firsts[1] < kinds.index("response.output_text.delta") and firsts[0] < firsts[1]
    assert [it.type for it in done.output] == ["reasoning", "message"] and done.output_text == "Paris it is!"
    assert done.output[0].content[0].text == "I reckon so."
    # the reasoning text's part is added and done around its deltas, as the message's is (vLLM's)
    first, last = kinds.index("response.reasoning_text.delta"), kinds.index("response.reasoning_text.done")
    assert kinds[first - 1] == "response.content_part.added" and kinds[last + 1] == "response.content_part.done"
    from aiolm.server import output_models

    output_models.Response.model_validate(r.model_dump())  # /openapi.json documents the reasoning item
    # cut inside the thinking: the reasoning item is incomplete too
    cut = client.responses.create(model=model, input=QUESTION[0]["content"], max_output_tokens=3, temperature=0)
    assert (cut.status, [it.status for it in cut.output]) == ("incomplete", ["incomplete", "incomplete"])
    with client.responses.stream(model=model, input=QUESTION[0]["content"], max_output_tokens=3, temperature=0) as s:
        items = [ev.item.status for ev in s if ev.type == "response.output_item.done"]
    assert items == ["incomplete", "incomplete"]


def test_messages_put_the_thinking_in_a_thinking_block(reasoning_servers, client: OpenAI) -> None:
    """/v1/messages splits as chat does: a thinking block before the text, or before the
    tool_use the answer holds (the thinking came back as text, its tags and all), streamed as
    thinking_delta events in a block of its own."""
    import anthropic

    srv = reasoning_servers.get()
    model = client.models.list().data[0].id
    ac = anthropic.Anthropic(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)

    def blocks(message) -> list[tuple[str, str | None]]:
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content]

    # greedy: the script's tokens win by 8 logits, so a draw at temperature 1 strays about once in
    # a hundred tokens
    m = ac.messages.create(model=model, max_tokens=40, messages=QUESTION, extra_body={"temperature": 0})
    assert blocks(m) == [("thinking", "I reckon so."), ("text", "Paris it is!")]
    with ac.messages.stream(model=model, max_tokens=40, messages=QUESTION, extra_body={"temperature": 0}) as s:
        kinds = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert blocks(streamed) == blocks(m) and kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    tool = {"name": "get_capital", "description": "x", "input_schema": {"type": "object", "properties": {}}}
    m = ac.messages.create(model=model, max_tokens=40, messages=QUESTION, tools=[tool], extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.content[0].thinking == "Need a tool"
    assert m.content[1].input == {"country": "France"} and m.stop_reason == "tool_use"


def test_a_thinking_budget_forces_the_end_of_the_thinking(client: OpenAI) -> None:
    """vLLM's thinking_token_budget: past that many thinking tokens </think> is forced, and the
    answer follows (the script would think four tokens)."""
    for budget, thought in ((2, "I reckon"), (0, None), (4, "I reckon so."), (-1, "I reckon so.")):
        r = _chat(client, body={"thinking_token_budget": budget, "return_token_ids": True})
        assert _reasoning(r.choices[0].message) == (thought, "Paris it is!"), budget
        assert r.choices[0].finish_reason == "stop"
    thoughts, content, _, _ = _stream(client, body={"thinking_token_budget": 1})
    assert ("".join(thoughts), content) == ("I", "Paris it is!")
    opened = _chat(client, {"think_in_prompt": True}, body={"thinking_token_budget": 3})  # thinking from token one
    assert _reasoning(opened.choices[0].message) == ("I reckon so", "Paris it is!")
    closed = _chat(client, {"enable_thinking": False}, body={"thinking_token_budget": 0})  # nothing to cap
    assert _reasoning(closed.choices[0].message) == (None, "Paris it is!")
    # with a grammar: it still binds what follows the thinking
    bound = _chat(client, body={"thinking_token_budget": 1, "structured_outputs": {"regex": "Paris"}})
    assert _reasoning(bound.choices[0].message) == ("I", "Paris")


def test_a_thinking_budget_needs_one_token_markers(other_servers) -> None:
    r = httpx.post(
        other_servers["granite"].base_url + "/v1/chat/completions",
        json={"messages": QUESTION, "thinking_token_budget": 5, "chat_template_kwargs": {"thinking": True}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    c = _client(other_servers["deepseek_r1"])  # thinks from the first token, its own <think> counted
    assert _reasoning(_chat(c, body={"thinking_token_budget": 2}).choices[0].message) == ("I", "Paris it is!")
    # Anthropic's thinking disabled, on a template without the switch: the thinking is closed at once
    body = {"max_tokens": 40, "temperature": 0, "messages": QUESTION, "thinking": {"type": "disabled"}}
    r = httpx.post(other_servers["deepseek_r1"].base_url + "/v1/messages", json=body, timeout=30)
    assert r.json()["content"] == [{"type": "text", "text": "Paris it is!"}], r.text


def test_messages_thinking_switches_and_caps_the_thinking(reasoning_servers, client: OpenAI) -> None:
    """Anthropic's ``thinking``: disabled asks the template not to think, enabled and adaptive
    to think (enabled capped at budget_tokens); an earlier turn's thinking blocks are taken."""
    import anthropic

    srv = reasoning_servers.get()
    model = client.models.list().data[0].id
    ac = anthropic.Anthropic(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)

    def blocks(**kw) -> list[tuple[str, str | None]]:
        m = ac.messages.create(model=model, max_tokens=2000, messages=QUESTION, extra_body={"temperature": 0}, **kw)
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content]

    thought = [("thinking", "I reckon so."), ("text", "Paris it is!")]
    assert blocks(thinking={"type": "disabled"}) == [("text", "Paris it is!")]
    assert blocks(thinking={"type": "enabled", "budget_tokens": 1024}) == thought
    assert blocks(thinking={"type": "adaptive"}) == thought
    earlier = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Hmm.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Paris."},
            ],
        },
        {"role": "user", "content": "And Italy?"},
    ]
    plain = [*QUESTION, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    # this template leaves out past thinking, as most do: the same prompt as without the blocks
    counted = [ac.messages.count_tokens(model=model, messages=m).input_tokens for m in (earlier, plain)]
    assert counted[0] == counted[1]
    answer = ac.messages.create(model=model, max_tokens=40, messages=earlier, extra_body={"temperature": 0})
    assert answer.content[-1].text == "Paris it is!"
    # a prefill that opened the thinking: what follows is thinking until </think>, as chat reads it
    # (it came back as text, </think> and all)
    prefill = [*QUESTION, {"role": "assistant", "content": "<think> I"}]
    got = ac.messages.create(model=model, max_tokens=40, messages=prefill, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in got.content] == [
        ("thinking", " reckon so."),
        ("text", "Paris it is!"),
    ]
    refusals = [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024}, "budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens"),
        ({"thinking": {"type": "adaptive", "display": "omitted"}}, "display"),
        ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, "thinking blocks"),
    ]
    for body, why in refusals:
        r = httpx.post(
            srv.base_url + "/v1/messages",
            json={"model": model, "max_tokens": 2000, "messages": QUESTION, **body},
            timeout=30,
        )
        assert r.status_code == 400 and why in r.json()["error"]["message"], (body, r.text)


def test_a_call_cut_short_is_the_same_call_streamed_or_not(reasoning_servers, client: OpenAI) -> None:
    """A stop string (or max_tokens) inside a call's arguments: the stream had sent the call's
    header and its arguments so far, and then the raw call again as text, while the answer not
    streamed held only that text. Both now hold the call, its arguments as far as they go, as
    OpenAI returns a call cut by the length."""
    import anthropic

    full = _chat(client, tools=TOOLS, stop=["France"])
    msg = full.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_capital", '{"country": "')]
    assert not msg.content
    thoughts, content, calls, finish = _stream(client, tools=TOOLS, stop=["France"])
    assert content == "" and [c.function.name for c in calls if c.function.name] == ["get_capital"]
    assert "".join(c.function.arguments or "" for c in calls) == '{"country": "'
    assert finish == full.choices[0].finish_reason
    srv = reasoning_servers.get()
    ac = anthropic.Anthropic(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
    tool = {"name": "get_capital", "description": "x", "input_schema": {"type": "object", "properties": {}}}
    kw = dict(model=client.models.list().data[0].id, max_tokens=40, messages=QUESTION, tools=[tool])
    kw |= dict(stop_sequences=["France"], extra_body={"temperature": 0})
    plain = ac.messages.create(**kw)
    with ac.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for m in (plain, streamed):
        assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.content[1].input == {}, m.content
        assert m.stop_reason == "stop_sequence"
