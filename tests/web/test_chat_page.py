"""The chat page in headless Chromium against a real `aiolm serve` on the embedded model.

Everything here goes through the page as a person would use it (typing, Enter,
the buttons), and the server side is checked through its own /metrics.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.slow]
expect = pytest.importorskip("playwright.sync_api", reason="playwright is not installed").expect

ANSWER_TIMEOUT_MS = 120_000  # generous: shared CPU cores
WATCH_STREAM = """() => {
  window.__streamed = [];
  new MutationObserver(() => {
    const art = document.querySelector('article.assistant[data-state="streaming"]');
    if (art) window.__streamed.push(art.querySelector('.body').textContent);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true});
}"""


class Chat:
    """One browser tab on the chat page, recording the chat requests it sends."""

    def __init__(self, page, server: ServerProcess) -> None:
        self.page = page
        self.server = server
        self.requests: list[dict] = []
        self.page_errors: list[str] = []
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        page.on("request", self._record)

    def _record(self, request) -> None:
        if request.url.endswith("/v1/chat/completions") and request.method == "POST":
            self.requests.append(json.loads(request.post_data))

    def open(self, connected: bool = True):
        """Loads the page and waits until it has asked the server for the model; returns the page."""
        self.page.goto(self.server.base_url + "/")
        model = self.page.locator("#model")
        if connected:
            expect(model).to_have_text(model_id(self.server, API_KEY))
        else:
            expect(model).to_have_text("not connected")
        return self.page

    def controls(self, temperature: str = "0", max_tokens: str = "64", system: str = "") -> None:
        self.page.fill("#temperature", temperature)
        self.page.fill("#max-tokens", max_tokens)
        self.page.fill("#system", system)

    def ask(self, text: str):
        """Types ``text`` and presses Enter; returns the new answer's element."""
        before = self.page.locator("article.assistant").count()
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")
        return self.page.locator("article.assistant").nth(before)

    def answer(self, text: str):
        el = self.ask(text)
        expect(el).to_have_attribute("data-state", "done", timeout=ANSWER_TIMEOUT_MS)
        return el


def model_id(server: ServerProcess, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.base_url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def scrape(server: ServerProcess) -> dict[str, float]:
    """/metrics as {name{labels}: value}, labels without the model name and engine index."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_metrics(server: ServerProcess, ok, what: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        if ok(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen in /metrics within {timeout}s: {m}")
        time.sleep(0.2)


@pytest.fixture
def chat(browser, chat_server) -> Iterator[Chat]:
    context = browser.new_context(viewport={"width": 1100, "height": 720}, color_scheme="light")
    c = Chat(context.new_page(), chat_server)
    yield c
    context.close()
    assert not c.page_errors, c.page_errors


def test_conversation_streams_markdown_and_usage(chat: Chat, artifacts: Path):
    page = chat.open()
    expect(page.locator("#key-form")).to_be_hidden()  # no key on this server
    chat.controls(temperature="0", max_tokens="200")
    page.fill("#prompt", "")
    page.type("#prompt", "a")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("b")
    assert page.input_value("#prompt") == "a\nb" and page.locator("article").count() == 0

    page.evaluate(WATCH_STREAM)
    first = chat.answer("What is the capital of France?")
    text = first.locator(".body").inner_text()
    assert "Paris" in text
    streamed = [s for s in page.evaluate("window.__streamed") if s]
    assert len(set(streamed)) >= 2 and all(text.startswith(s) for s in streamed), streamed  # grew in place
    meta = first.locator(".meta").inner_text()
    m = re.fullmatch(r"(\d+) prompt \+ (\d+) completion tokens · [\d.]+ tokens/s · first token \d+ ms", meta)
    assert m and int(m.group(1)) > 5 and int(m.group(2)) >= 2, meta
    sent = chat.requests[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (sent["temperature"], sent["max_tokens"], sent["top_p"]) == (0, 200, 1)
    assert sent["model"] == model_id(chat.server)
    assert sent["messages"] == [{"role": "user", "content": "What is the capital of France?"}]

    second = chat.answer("Write a Python function that adds two numbers.")
    history = chat.requests[1]["messages"]
    assert [t["role"] for t in history] == ["user", "assistant", "user"] and "Paris" in history[1]["content"]
    code = second.locator("pre code").first
    expect(code).to_contain_text("def ")  # the embedded model answers with a fenced block at temperature 0
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=chat.server.base_url)
    copy = second.locator("pre .copy").first
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == code.text_content()

    page.screenshot(path=str(artifacts / "chat-light.png"))
    light = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=str(artifacts / "chat-dark.png"))
    dark = page.evaluate("getComputedStyle(document.body).backgroundColor")

    def brightness(rgb: str) -> int:
        return sum(int(v) for v in re.findall(r"\d+", rgb)[:3])

    assert brightness(light) > 600 and brightness(dark) < 150, (light, dark)  # follows prefers-color-scheme


def test_stop_aborts_the_request_and_frees_its_kv(chat: Chat):
    page = chat.open()
    chat.controls(temperature="0", max_tokens="900", system="You are a storyteller.")
    aborted_before = scrape(chat.server).get('aiolm:request_success_total{finished_reason="abort"}', 0.0)
    el = chat.ask("Write a very long story about a dragon who learns to cook.")
    expect(el.locator(".body")).not_to_be_empty(timeout=ANSWER_TIMEOUT_MS)
    wait_metrics(chat.server, lambda m: m["aiolm:num_requests_running"] == 1, "a running request")
    expect(el).to_have_attribute("data-state", "streaming")  # 900 tokens are far away
    page.click("#stop")
    expect(el).to_have_attribute("data-state", "stopped")
    expect(el.locator(".meta")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    after = wait_metrics(
        chat.server,
        lambda m: m["aiolm:num_requests_running"] == 0 and m["aiolm:kv_cache_usage_perc"] == 0,
        "running 0 and KV usage 0",
    )
    assert after['aiolm:request_success_total{finished_reason="abort"}'] == aborted_before + 1
    assert chat.requests[0]["messages"][0] == {"role": "system", "content": "You are a storyteller."}


def test_server_errors_are_shown_and_the_prompt_kept(chat: Chat, artifacts: Path):
    page = chat.open()
    error = page.locator("#error")
    # out of the input's own range ("0,5" reads as 5 in some locales): named, not sent
    chat.controls(temperature="5")
    chat.ask("What is the capital of France?")
    expect(error).to_contain_text("temperature: ")
    expect(page.locator("#temperature")).to_have_attribute("aria-invalid", "true")
    assert chat.requests == [] and page.input_value("#prompt") == "What is the capital of France?"
    chat.controls(max_tokens="5000")  # beyond --max-model-len 1024
    chat.ask("What is the capital of France?")
    expect(error).to_be_visible()
    expect(error).to_contain_text("400 (max_tokens): ")
    expect(error).to_contain_text("maximum context length is 1024")
    expect(page.locator("#max-tokens")).to_have_attribute("aria-invalid", "true")
    page.screenshot(path=str(artifacts / "chat-error.png"))
    assert page.locator("article").count() == 0  # the refused turn is not in the conversation
    assert page.input_value("#prompt") == "What is the capital of France?"
    page.fill("#max-tokens", "16")
    page.press("#prompt", "Enter")
    answer = page.locator("article.assistant").first
    expect(answer).to_have_attribute("data-state", "done", timeout=ANSWER_TIMEOUT_MS)
    expect(error).to_be_hidden()
    assert page.get_attribute("#max-tokens", "aria-invalid") is None
    assert [len(r["messages"]) for r in chat.requests] == [1, 1]  # the retry carries no trace of the failure


def test_api_key_is_asked_for_and_kept_in_the_tab_only(browser, keyed_server, artifacts: Path):
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    chat = Chat(context.new_page(), keyed_server)
    page = chat.open(connected=False)
    key_form, error = page.locator("#key-form"), page.locator("#error")
    expect(key_form).to_be_visible()
    expect(error).to_contain_text("needs an API key")
    page.screenshot(path=str(artifacts / "chat-key.png"))
    page.fill("#api-key", "wrong-key")
    page.press("#api-key", "Enter")
    expect(error).to_contain_text("refused this API key")
    expect(page.locator("#model")).to_have_text("not connected")
    assert page.evaluate("sessionStorage.getItem('aiolm.apiKey')") is None  # a refused key is not kept

    page.fill("#api-key", API_KEY)
    page.click("#key-save")
    expect(page.locator("#model")).to_have_text(model_id(keyed_server, API_KEY))
    expect(error).to_be_hidden()
    chat.controls(max_tokens="16")
    assert "Paris" in chat.answer("What is the capital of France?").locator(".body").inner_text()
    assert page.evaluate("sessionStorage.getItem('aiolm.apiKey')") == API_KEY
    assert page.evaluate("localStorage.length") == 0 and context.cookies() == []

    page.reload()  # same tab: the key is remembered, and the field stays
    expect(page.locator("#model")).to_have_text(model_id(keyed_server, API_KEY))
    expect(page.locator("#key-hint")).to_contain_text("Key accepted")
    fresh = browser.new_context()  # another session: asked again
    try:
        other = Chat(fresh.new_page(), keyed_server).open(connected=False)
        expect(other.locator("#key-form")).to_be_visible()
    finally:
        fresh.close()
        context.close()
    assert not chat.page_errors, chat.page_errors


def test_markdown_renderer_builds_only_its_own_tags(chat: Chat):
    page = chat.open()
    out = page.evaluate("""async () => {
      const { renderMarkdown } = await import('/web/markdown.js');
      const src = [
        '# Title', 'Some **bold**, *it*, `a<b>` and snake_case_name.',
        '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 1">',
        '[bad](javascript:window.__pwned=1) [good](https://example.org/a_b) [proto](//evil.example)',
        '', '- one', '- two', '', '3. three', '4. four', '', '> quoted', '',
        '```html', '<b onclick="x">"&"</b>', '```', '```js', 'unclosed while streaming',
      ].join('\\n');
      const div = document.createElement('div');
      div.innerHTML = renderMarkdown(src);
      document.body.append(div);
      const attrs = [...div.querySelectorAll('*')].flatMap((el) => [...el.attributes].map((a) => a.name));
      const tags = [...new Set([...div.querySelectorAll('*')].map((el) => el.tagName.toLowerCase()))];
      const hrefs = [...div.querySelectorAll('a')].map((a) => a.getAttribute('href'));
      return { html: div.innerHTML, attrs, tags, hrefs };
    }""")
    html = out["html"]
    assert page.evaluate("window.__pwned") is None
    assert set(out["tags"]) <= {"h1", "p", "strong", "em", "code", "br", "a", "ul", "ol", "li", "blockquote", "pre"}
    assert set(out["attrs"]) <= {"href", "target", "rel", "start", "class"}
    assert out["hrefs"] == ["https://example.org/a_b"]
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html and "<em>it</em>" in html
    assert "<code>a&lt;b&gt;</code>" in html and "snake_case_name" in html
    assert '<a href="https://example.org/a_b" target="_blank" rel="noopener noreferrer">good</a>' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html and '<ol start="3"><li>three</li><li>four</li></ol>' in html
    assert "<blockquote>quoted</blockquote>" in html
    assert '<pre><code class="language-html">&lt;b onclick="x"&gt;"&amp;"&lt;/b&gt;</code></pre>' in html
    assert '<pre><code class="language-js">unclosed while streaming</code></pre>' in html
    more = page.evaluate("""async () => {
      const { renderMarkdown } = await import('/web/markdown.js');
      const cases = ['[`code`](https://x.org)', '[wiki](https://en.wikipedia.org/wiki/Foo_(bar))',
        '**bold *it* bold**', '**2 * 3 = 6**', '***x***', '# Title ##', '# C#'];
      const rendered = cases.map(renderMarkdown);
      // a long run of spaces in a heading, or of "[": the patterns backtracked (seconds a render)
      const t0 = performance.now();
      renderMarkdown('# a' + ' '.repeat(3000) + 'b');
      renderMarkdown('['.repeat(30000));
      return { rendered, ms: performance.now() - t0 };
    }""")
    assert more["rendered"] == [
        '<p><a href="https://x.org" target="_blank" rel="noopener noreferrer"><code>code</code></a></p>',
        '<p><a href="https://en.wikipedia.org/wiki/Foo_(bar)" target="_blank" rel="noopener noreferrer">wiki</a></p>',
        "<p><strong>bold <em>it</em> bold</strong></p>",
        "<p><strong>2 * 3 = 6</strong></p>",
        "<p><em><strong>x</strong></em></p>",
        "<h1>Title</h1>",
        "<h1>C#</h1>",
    ]
    assert more["ms"] < 2000, more["ms"]  # linear: about a millisecond; it was 7 s and more


def test_a_reasoning_models_thinking_is_shown_folded_above_the_answer(browser, reasoning_servers, artifacts: Path):
    """The scripted thinking model (tests/scripted_model.py) behind --reasoning-parser qwen3."""
    context = browser.new_context(viewport={"width": 1100, "height": 720}, color_scheme="light")
    c = Chat(context.new_page(), reasoning_servers.get())
    try:
        page = c.open()
        c.controls(temperature="0", max_tokens="64")
        el = c.answer("What is the capital of France?")
        expect(el.locator(".body")).to_have_text("Paris it is!")
        thoughts = el.locator("details.reasoning")
        expect(thoughts).to_be_visible()
        assert thoughts.get_attribute("open") is None, "folded until opened"
        expect(thoughts.locator(".thoughts")).to_be_hidden()
        expect(thoughts.locator("summary")).to_have_text("Thought")
        thoughts.locator("summary").click()
        expect(thoughts.locator(".thoughts")).to_have_text("I reckon so.")
        page.screenshot(path=str(artifacts / "chat-reasoning.png"))
        c.answer("And of Italy?")  # the thinking is not sent back with the history
        assert c.requests[1]["messages"][1] == {"role": "assistant", "content": "Paris it is!"}
        expect(c.page.locator("article.assistant").nth(1).locator(".body")).to_have_text("Paris it is!")
    finally:
        context.close()
    assert not c.page_errors, c.page_errors
