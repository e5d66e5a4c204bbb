"""Images on the chat page in headless Chromium: attached with the file input (or pasted),
previewed and removable, sent as OpenAI ``image_url`` parts to a real `aiolm serve` of a tiny
random LLaVA (tests/vlm_models.py), and a text-only server's 400 shown as the page shows errors."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import ServerProcess, free_port, serve_cmd
from test_chat_page import Chat

from vlm_models import data_url, png_image, tiny_llava

pytestmark = [pytest.mark.browser, pytest.mark.slow]
expect = pytest.importorskip("playwright.sync_api", reason="playwright is not installed").expect

ANSWER_TIMEOUT_MS = 60_000
PNG, OTHER_PNG = png_image(7), png_image(8)
PASTE = """(b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], 'pasted.png', { type: 'image/png' }));
  document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', { clipboardData: data, bubbles: true }));
}"""


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory, real_source) -> Iterator[ServerProcess]:
    llava = tiny_llava(tmp_path_factory.mktemp("llava"), real_source.path)
    port = free_port()
    srv = ServerProcess(serve_cmd(port, str(llava)), port, tmp_path_factory.mktemp("vl-server") / "server.log")
    with srv.serving("vision server"):
        yield srv


def _chat(browser, server: ServerProcess) -> Iterator[Chat]:
    context = browser.new_context(viewport={"width": 1100, "height": 720}, color_scheme="light")
    c = Chat(context.new_page(), server)
    yield c
    context.close()
    assert not c.page_errors, c.page_errors


@pytest.fixture
def vision_chat(browser, vision_server) -> Iterator[Chat]:
    yield from _chat(browser, vision_server)


@pytest.fixture
def text_chat(browser, chat_server) -> Iterator[Chat]:
    yield from _chat(browser, chat_server)


@pytest.fixture
def png_file(tmp_path: Path) -> Path:
    path = tmp_path / "noise.png"
    path.write_bytes(PNG)
    return path


def test_an_attached_image_goes_as_an_image_url_part_and_stays_in_the_history(
    vision_chat: Chat, png_file: Path, artifacts: Path
):
    page = vision_chat.open()
    vision_chat.controls(temperature="0", max_tokens="8")
    page.set_input_files("#attach", str(png_file))
    attached = page.locator("#attachments img.thumb")
    expect(attached).to_have_count(1)
    assert attached.get_attribute("src") == data_url(PNG)

    page.fill("#prompt", "What is in this picture?")
    page.press("#prompt", "Enter")
    first = page.locator("article.assistant").first
    expect(first).to_have_attribute("data-state", "done", timeout=ANSWER_TIMEOUT_MS)
    assert first.locator(".body").inner_text().strip(), "an answer"
    expect(page.locator("#attachments")).to_be_hidden()  # sent with the message
    expect(page.locator("article.user img.thumb")).to_have_attribute("src", data_url(PNG))
    expect(page.locator("#error")).to_be_hidden()
    page.screenshot(path=str(artifacts / "chat-image.png"))
    image = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    question = {"type": "text", "text": "What is in this picture?"}
    assert vision_chat.requests[0]["messages"] == [{"role": "user", "content": [question, image]}]

    vision_chat.answer("And now?")  # a turn without images: plain text, the earlier image still sent
    history = vision_chat.requests[1]["messages"]
    assert [t["role"] for t in history] == ["user", "assistant", "user"]
    assert history[0]["content"] == [question, image] and history[2]["content"] == "And now?"
    expect(page.locator("article.user").nth(1).locator("img")).to_have_count(0)


def test_a_text_only_models_400_is_shown_and_the_images_kept(text_chat: Chat, png_file: Path, artifacts: Path):
    page = text_chat.open()
    text_chat.controls(temperature="0", max_tokens="8")
    page.set_input_files("#attach", str(png_file))
    page.evaluate(PASTE, base64.b64encode(OTHER_PNG).decode("ascii"))
    attached = page.locator("#attachments img.thumb")
    expect(attached).to_have_count(2)
    assert [attached.nth(i).get_attribute("src") for i in range(2)] == [data_url(PNG), data_url(OTHER_PNG)]
    page.locator("#attachments .remove").first.click()
    expect(attached).to_have_count(1)
    assert attached.get_attribute("src") == data_url(OTHER_PNG)

    text_chat.ask("What is in this picture?")
    error = page.locator("#error")
    expect(error).to_contain_text("400", timeout=ANSWER_TIMEOUT_MS)
    expect(error).to_contain_text("this model takes no images")
    assert page.locator("article").count() == 0  # the refused turn is not in the conversation
    assert page.input_value("#prompt") == "What is in this picture?"
    expect(attached).to_have_count(1)  # given back with the prompt, to remove or resend
    page.screenshot(path=str(artifacts / "chat-image-refused.png"))
    sent = text_chat.requests[0]["messages"][0]["content"]
    assert sent[1] == {"type": "image_url", "image_url": {"url": data_url(OTHER_PNG)}}

    page.locator("#attachments .remove").click()
    expect(page.locator("#attachments")).to_be_hidden()
    page.press("#prompt", "Enter")
    expect(page.locator("article.assistant").first).to_have_attribute("data-state", "done", timeout=ANSWER_TIMEOUT_MS)
    expect(error).to_be_hidden()
    assert text_chat.requests[1]["messages"] == [{"role": "user", "content": "What is in this picture?"}]
