"""/tokenize with messages renders them exactly as a chat request does: with its tools, and
continuing the final assistant message. A real server on the embedded model's weights,
behind a chat template that writes the tools into the prompt (the model's own ignores them)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServerProcess, free_port, serve_cmd

TIMEOUT = 120.0
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    " ({{ t.function.description }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% if documents %}Documents:{% for d in documents %} {{ d.title }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.mood is defined %} (mood: {{ m.mood }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
PARTIAL = [*QUESTION, {"role": "assistant", "content": "Let me look that up"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from aiolm.checkpoint.source import resolve_model

    src = Path(resolve_model(None).path)
    folder = tmp_path_factory.mktemp("tool-template")
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            os.symlink(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    port = free_port()
    proc = ServerProcess(serve_cmd(port, "--model", str(folder)), port, folder.parent / "server.log")
    with proc.serving("tool-template server"):
        yield proc


def _tokenize(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/tokenize", json=body, timeout=TIMEOUT)


def _chat_prompt_ids(server: ServerProcess, extra: dict | None = None, **kw) -> list[int]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    model = client.models.list().data[0].id
    body = {"return_token_ids": True, **(extra or {})}
    return client.chat.completions.create(model=model, max_tokens=1, extra_body=body, **kw).prompt_token_ids


def test_tools_are_rendered_as_a_chat_request_renders_them(server):
    plain = _tokenize(server, {"messages": QUESTION}).json()["tokens"]
    r = _tokenize(server, {"messages": QUESTION, "tools": TOOLS, "return_token_strs": True})
    assert r.status_code == 200, r.text
    with_tools = r.json()["tokens"]
    assert len(with_tools) > len(plain)
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": with_tools}, timeout=TIMEOUT).json()["prompt"]
    assert "Tools: get_weather (The weather in a city)" in text
    assert with_tools == _chat_prompt_ids(server, messages=QUESTION, tools=TOOLS, tool_choice="none")


def test_the_final_assistant_message_is_continued_as_chat_continues_it(server):
    body = {"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": False}
    r = _tokenize(server, body)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == _chat_prompt_ids(
        server, {"continue_final_message": True, "add_generation_prompt": False}, messages=PARTIAL
    )
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()["prompt"]
    assert text.endswith("Let me look that up")  # no end of turn, no new assistant turn


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "tools": TOOLS}, "tools"),
        ({"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
        (
            {"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        (
            {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        ({"messages": QUESTION, "tools": "get_weather"}, "tools"),
    ],
)
def test_bad_tokenize_bodies_are_400s_naming_the_field(server, body, param):
    r = _tokenize(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_custom_roles_extra_message_fields_and_template_kwargs_reach_the_template(server):
    """As vLLM does: a role the template knows, a message's own extra fields, and
    chat_template_kwargs all go to the template, on chat and /tokenize alike."""
    messages = [
        {"role": "observation", "content": "It rains.", "mood": "gloomy"},
        {"role": "user", "content": "Should I take an umbrella?"},
    ]
    kwargs = {"greeting": "Hello from the kwargs"}
    r = _tokenize(server, {"messages": messages, "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()["prompt"]
    assert text.startswith("Hello from the kwargs\n<|im_start|>observation\nIt rains. (mood: gloomy)<|im_end|>")
    assert _chat_prompt_ids(server, {"chat_template_kwargs": kwargs}, messages=messages) == ids


def test_chat_echo_prepends_the_continued_assistant_message(server):
    """vLLM's chat echo: with continue_final_message (or add_generation_prompt false) the
    answer starts with the final assistant message's content, streamed or not."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=PARTIAL, max_tokens=6, temperature=0)
    for flags in ({"continue_final_message": True}, {"add_generation_prompt": False}):
        plain = client.chat.completions.create(**kw, extra_body=flags).choices[0].message.content
        echoed = client.chat.completions.create(**kw, extra_body={**flags, "echo": True}).choices[0].message.content
        assert echoed == "Let me look that up" + plain and plain
        chunks = client.chat.completions.create(**kw, stream=True, extra_body={**flags, "echo": True})
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    asked = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0)
    again = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    assert again.choices[0].message.content == asked.choices[0].message.content  # a new turn echoes nothing


def test_text_parts_are_joined_a_line_apart_as_vllm_joins_them(server):
    """A message's text parts render as their texts joined by newlines, on chat, /tokenize and
    Anthropic's blocks alike (they ran together: "Hello" "World" was "HelloWorld")."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    for joined, content in (("Hello\nWorld", parts), ("Hello", parts[:1])):
        want = _tokenize(server, {"messages": [{"role": "user", "content": joined}]}).json()["tokens"]
        assert _tokenize(server, {"messages": [{"role": "user", "content": content}]}).json()["tokens"] == want
        assert _chat_prompt_ids(server, messages=[{"role": "user", "content": content}]) == want
    model = httpx.get(server.base_url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    counted, plain = (
        httpx.post(
            server.base_url + "/v1/messages/count_tokens",
            json={"model": model, "messages": [{"role": "user", "content": content}]},
            timeout=TIMEOUT,
        )
        for content in (parts, "Hello\nWorld")
    )
    assert counted.status_code == 200 and counted.json() == plain.json(), (counted.text, plain.text)


def _rendered(server: ServerProcess, messages: list[dict]) -> str:
    r = _tokenize(server, {"messages": messages, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    return httpx.post(server.base_url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=TIMEOUT).json()[
        "prompt"
    ]


def test_developer_messages_and_cut_tool_calls_reach_the_template_as_vllm_gives_them(server):
    """A template that knows no developer role gets it as system (Qwen2.5's dropped the message,
    SmolLM2's showed an unknown role); a call whose arguments an answer cut by max_tokens left
    unfinished, or an empty tool_calls, is sent back as no arguments instead of a 400."""
    text = _rendered(server, [{"role": "developer", "content": "Answer in French."}, *QUESTION])
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")
    cut = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}}
    for turn in ({"role": "assistant", "content": None, "tool_calls": [cut]}, {"role": "assistant", "tool_calls": []}):
        messages = [*QUESTION, turn, {"role": "user", "content": "And now?"}]
        assert _rendered(server, messages).endswith("<|im_start|>user\nAnd now?<|im_end|>\n")


def test_templates_that_loop_over_content_parts_get_parts():
    """LLaVA's template (and many vision models') renders only the text parts it loops over:
    a string content rendered an empty user turn ("USER: ASSISTANT:"), as vLLM's detection of
    the template's content format avoids."""
    from aiolm.engine.chat_messages import shaped_for, template_traits

    llava = (
        "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
        "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
        "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    )
    assert template_traits(llava) == (True, False) and template_traits(TEMPLATE) == (False, False)
    lines = "{% for m in messages %}{% for line in m.content.split('\\n') %}[{{ line }}]{% endfor %}{% endfor %}"
    assert template_traits(lines) == (False, False)  # a loop over a string's lines, not over parts
    shaped = shaped_for(llava, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert shaped == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    import jinja2

    out = jinja2.Environment().from_string(llava).render(messages=shaped, add_generation_prompt=True)
    assert out == "Be brief. USER: Hi ASSISTANT:"


def test_documents_reach_the_template_on_chat_and_tokenize(server):
    """vLLM's documents field, for retrieval templates (it was a 400, and chat_template_kwargs
    may not set the variable: the request's own fields do)."""
    docs = [{"title": "Paris weather", "text": "Sunny."}, {"title": "Lyon", "text": "Rain."}]
    r = _tokenize(server, {"messages": QUESTION, "documents": docs})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()["prompt"]
    assert text.startswith("Documents: Paris weather Lyon<|im_start|>user")  # (trim_blocks ate the newline)
    assert _chat_prompt_ids(server, {"documents": docs}, messages=QUESTION) == ids
