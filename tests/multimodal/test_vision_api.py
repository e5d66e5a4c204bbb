"""Images over the OpenAI API: a real `aiolm serve` of a tiny random LLaVA, driven by the
real ``openai`` client: data, http and file URLs, and every kind of bad image a 400."""

from __future__ import annotations

import http.server
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServerProcess, free_port, serve_cmd

from vlm_models import data_url, hf_vlm_greedy, png_image, tiny_llava

MAX_NEW = 8
PNG = png_image(7)


class _Images(http.server.BaseHTTPRequestHandler):
    """/cat.png: the image; /slow: answers after the fetch timeout; anything else: 404."""

    stop = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow":
            self.stop.wait(5)
            return
        if self.path != "/cat.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _Images.stop.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def llava(tmp_path_factory, real_source) -> Path:
    return tiny_llava(tmp_path_factory.mktemp("llava"), real_source.path)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(PNG)
    (folder.parent / "outside.png").write_bytes(PNG)
    return folder


@pytest.fixture(scope="module")
def vl_server(llava, media, tmp_path_factory) -> Iterator[ServerProcess]:
    port = free_port()
    flags = [str(llava), "--allowed-local-media-path", str(media), "--limit-mm-per-prompt", "image=2"]
    flags += ["--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "0.5", "--max-image-pixels", "4000000"]
    srv = ServerProcess(serve_cmd(port, *flags), port, tmp_path_factory.mktemp("vl-server") / "server.log")
    with srv.serving("vision server"):
        yield srv


@pytest.fixture(scope="module")
def client(vl_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=vl_server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, *urls: str) -> openai.types.chat.ChatCompletion:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "What?"}]
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def test_data_http_and_file_urls_answer_as_transformers(client, llava, media, image_host):
    """The same image by each route: transformers' tokens every time."""
    want = hf_vlm_greedy(
        llava,
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
        [PNG],
        MAX_NEW,
    )
    for url in (data_url(PNG), f"{image_host}/cat.png", (media / "cat.png").as_uri()):
        out = ask(client, url)
        assert out.choices[0].token_ids == want[1], url  # type: ignore[attr-defined]
        assert out.usage.prompt_tokens == len(want[0])


def _refused(client: openai.OpenAI, *urls: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, *urls)
    assert time.monotonic() - t0 < 10
    return str(e.value)


def _png_of(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, format="PNG")
    return out.getvalue()


def test_bad_images_are_400s_naming_the_problem(client, media, image_host):
    assert "is not under --allowed-local-media-path" in _refused(client, (media.parent / "outside.png").as_uri())
    assert "corrupt or truncated" in _refused(client, data_url(PNG[: len(PNG) // 2]))
    assert "not a PNG" in _refused(client, "data:image/png;base64," + "QUJD" * 8)
    assert "pixels" in _refused(client, data_url(_png_of(8000, 6250)))  # 50 megapixels
    assert "at most 2" in _refused(client, data_url(PNG), data_url(PNG), data_url(PNG))
    assert "timed out" in _refused(client, f"{image_host}/slow")
    assert "HTTP 404" in _refused(client, f"{image_host}/missing.png")
    assert "allowed-media-domains" in _refused(client, "http://localhost:9/cat.png")
    assert "not a ftp: URL" in _refused(client, "ftp://127.0.0.1/cat.png")
    # nothing leaked: no request left in the engine, no KV block held, and the next one answers
    metrics = httpx.get(str(client.base_url).removesuffix("v1/") + "metrics", timeout=10).text
    gauges = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(("aiolm:num_requests_running", "aiolm:num_requests_waiting", "aiolm:kv_cache_usage_perc"))
    }
    assert gauges == {
        "aiolm:num_requests_running": 0.0,
        "aiolm:num_requests_waiting": 0.0,
        "aiolm:kv_cache_usage_perc": 0.0,
    }
    assert ask(client, data_url(PNG)).choices[0].finish_reason == "length"


def test_a_prompt_too_long_with_its_image_is_refused_as_a_text_one_is(client):
    """The context-length refusal names 'messages' with OpenAI's code, images or not (with an
    image it named 'prompt', without the code)."""
    model = client.models.list().data[0].id
    words = "word " * 1500
    with_image = [{"type": "image_url", "image_url": {"url": data_url(PNG)}}, {"type": "text", "text": words}]
    for content in (words, with_image):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=4)
        body = e.value.body
        assert body["param"] == "messages" and body["code"] == "context_length_exceeded", body


def test_tokenize_counts_what_the_chat_runs(client):
    """/tokenize of a chat with an image: the ids a chat completion runs, placeholders expanded."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}, {"type": "text", "text": "What?"}],
        }
    ]
    base = str(client.base_url).removesuffix("v1/")
    got = httpx.post(base + "tokenize", json={"messages": messages}, timeout=30).json()
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert got["count"] == out.usage.prompt_tokens
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    r = httpx.post(base + "tokenize", json={"messages": bad}, timeout=30)
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]


def test_beam_search_with_images_is_a_400(client):
    content = [{"type": "image_url", "image_url": {"url": data_url(PNG)}}, {"type": "text", "text": "What?"}]
    with pytest.raises(openai.BadRequestError, match="does not take images"):
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": content}],
            max_tokens=4,
            n=2,
            extra_body={"use_beam_search": True},
        )


def test_an_image_to_a_text_model_is_a_400(open_servers):
    srv = open_servers.get()
    text_only = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        ask(text_only, data_url(PNG))


def test_responses_input_image_answers_as_chat(client):
    """The Responses API's input_image: the same prompt, so the same greedy text as chat's."""
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(PNG)}},
                    {"type": "text", "text": "What?"},
                ],
            }
        ],
        max_tokens=MAX_NEW,
        temperature=0,
    )
    resp = client.responses.create(
        model=model,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(PNG)},
                    {"type": "input_text", "text": "What?"},
                ],
            }
        ],
        max_output_tokens=MAX_NEW,
        temperature=0,
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def _peak_rss_mb(pid: int) -> float:
    """The process's resident peak so far (VmHWM)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_burst_of_large_images_holds_few_decoded_at_once(client, vl_server):
    """Sixteen requests of two 4-megapixel images each, at once: decoded images (and the
    processor's float copies of them) are what a client can make the server hold before any
    admission, so only two requests hold them at a time. The server's resident peak grows by
    about 180 MB (by 700 MB when all sixteen held theirs, and by gigabytes at 20 MP)."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    url = "data:image/png;base64," + base64.b64encode(_png_of(1999, 2000)).decode()
    ask(client, url, url)  # the processor and the kernels warmed up
    before = _peak_rss_mb(vl_server.proc.pid)
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda _: ask(client, url, url), range(16)))
    grew = _peak_rss_mb(vl_server.proc.pid) - before
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    assert grew < 400, f"the resident peak grew by {grew:.0f} MB"
