"""aiolm.multimodal.media: images from data, http(s) and file URLs, and each way to refuse one.

The http(s) cases fetch from a real server on 127.0.0.1 (the standard library's, in a thread);
every fetch is loopback only and bounded by a timeout of a fraction of a second or a few seconds.
Every refusal is a ParamError on the request's field whose message says what was wrong.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image, ImageChops, ImageFile, ImageStat

from aiolm.multimodal.media import MediaLimits, _host_allowed, load_image
from aiolm.params import ParamError

FIELD = "messages[0].content[1].image_url"
SIZE = (37, 23)
HTTP = MediaLimits(fetch_timeout_s=3.0)  # generous for loopback, short enough to fail a hung test fast
SLOW_TIMEOUT_S = 0.4


def picture(size: tuple[int, int] = SIZE) -> Image.Image:
    """A smooth RGB gradient: every pixel known, and kind to lossy codecs."""
    w, h = size
    image = Image.new("RGB", size)
    image.putdata([(x * 6, y * 10, (x + y) * 3) for y in range(h) for x in range(w)])
    return image


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def load(url: str, limits: MediaLimits = HTTP) -> Image.Image:
    return asyncio.run(load_image(url, limits, FIELD))


def refusal(url: str, limits: MediaLimits = HTTP) -> str:
    """The message of the ParamError that loading ``url`` raises, its field checked."""
    with pytest.raises(ParamError) as caught:
        load(url, limits)
    assert caught.value.param == FIELD
    return caught.value.message


def mean_difference(a: Image.Image, b: Image.Image) -> float:
    return sum(ImageStat.Stat(ImageChops.difference(a, b)).mean) / 3


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds no pixel data: a header to refuse."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# --- data URLs and decoding ----------------------------------------------------------------


def test_png_data_url_decodes_to_the_exact_pixels() -> None:
    image = load(data_url(encode(picture(), "PNG")))
    assert image.mode == "RGB" and image.size == SIZE
    assert image.tobytes() == picture().tobytes()


@pytest.mark.parametrize(
    ("fmt", "media_type", "options"),
    [("JPEG", "image/jpeg", {"quality": 95}), ("WEBP", "image/webp", {"quality": 95}), ("GIF", "image/gif", {})],
)
def test_lossy_and_palette_formats_decode_to_their_size_and_colours(fmt: str, media_type: str, options: dict) -> None:
    image = load(data_url(encode(picture(), fmt, **options), media_type))
    assert image.mode == "RGB" and image.size == SIZE
    assert mean_difference(image, picture()) < 6


def test_transparent_images_become_rgb_over_white_as_transformers_makes_them() -> None:
    """As the model's own processor sees them (transformers' convert_to_rgb): a transparent
    pixel shows white, not the colour it holds (a logo's background reached the model black)."""
    import numpy as np
    from transformers.image_transforms import convert_to_rgb

    half = picture().convert("RGBA")
    half.putalpha(128)
    clear = picture().convert("RGBA")
    clear.putalpha(0)
    palette = picture().convert("P")
    palette.info["transparency"] = 0
    for original in (half, clear, picture().convert("LA"), palette, picture()):
        image = load(data_url(encode(original, "PNG")))
        want = convert_to_rgb(Image.open(io.BytesIO(encode(original, "PNG"))), return_numpy=True)
        assert image.mode == "RGB" and np.array_equal(np.array(image), want), original.mode
    assert load(data_url(encode(clear, "PNG"))).getextrema() == ((255, 255),) * 3


def test_the_declared_media_type_does_not_pick_the_decoder() -> None:
    assert load(data_url(encode(picture(), "PNG"), "image/jpeg")).size == SIZE


def test_decoding_runs_off_the_event_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    real_open = Image.open

    def recording_open(*args: object, **kwargs: object) -> Image.Image:
        threads.append(threading.get_ident())
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", recording_open)
    load(data_url(encode(picture(), "PNG")))
    assert threads and threads[0] != threading.get_ident()


@pytest.mark.parametrize(
    ("url", "phrase"),
    [
        ("data:text/plain;base64,aGVsbG8=", "media type is text/plain, not image/"),
        ("data:;base64,aGVsbG8=", "media type is missing"),
        ("data:image/png,%89PNG", "not base64"),
        ("data:image/png;base64,not*base64!", "base64 payload is invalid"),
        ("data:image/png;base64,aGVsbG8", "base64 payload is invalid"),  # bad padding
        ("data:image/png;base64", "no ','"),
    ],
)
def test_bad_data_urls_are_refused(url: str, phrase: str) -> None:
    assert phrase in refusal(url)


@pytest.mark.parametrize(
    ("url", "phrase"),
    [
        ("", "the image URL is empty"),
        ("ftp://127.0.0.1/cat.png", "not a ftp: URL"),
        ("javascript:alert(1)", "not a javascript: URL"),
        ("images/cat.png", "images/cat.png, which has no scheme"),
        ("/srv/images/cat.png", "which has no scheme"),
        ("http://[::1/cat.png", "is malformed"),
    ],
)
def test_urls_of_other_schemes_are_refused(url: str, phrase: str) -> None:
    assert phrase in refusal(url)


def test_bytes_that_are_no_image_are_refused() -> None:
    assert "not a PNG, JPEG, WebP, GIF or BMP image" in refusal(data_url(b"this is plain text, not pixels"))


def test_formats_outside_the_allowed_few_are_refused() -> None:
    tiff = encode(picture(), "TIFF")
    assert Image.open(io.BytesIO(tiff)).size == SIZE  # Pillow itself would open it
    assert "not a PNG, JPEG, WebP, GIF or BMP image" in refusal(data_url(tiff, "image/tiff"))


def test_corrupt_pixel_data_is_refused() -> None:
    png = bytearray(encode(picture(), "PNG"))
    start = png.index(b"IDAT") + 20
    png[start : start + 40] = bytes(b ^ 0xFF for b in png[start : start + 40])
    assert "the image is corrupt or truncated" in refusal(data_url(bytes(png)))


def test_a_truncated_png_is_refused_when_loaded() -> None:
    png = encode(picture(), "PNG")
    truncated = png[: len(png) * 6 // 10]
    assert Image.open(io.BytesIO(truncated)).size == SIZE  # the header alone still reads
    assert "the image is corrupt or truncated" in refusal(data_url(truncated))


@pytest.fixture(scope="module")
def fifty_megapixels() -> bytes:
    """A real 8000 x 6250 PNG of one colour: 50,000,000 pixels in a few KiB."""
    return encode(Image.new("1", (8000, 6250)), "PNG")


def test_too_many_pixels_are_refused_from_the_header(fifty_megapixels: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[object] = []
    real_load = ImageFile.ImageFile.load

    def recording_load(self: ImageFile.ImageFile) -> object:
        loads.append(self)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    assert len(fifty_megapixels) < 64 * 2**10
    started = time.monotonic()
    message = refusal(data_url(fifty_megapixels))
    assert time.monotonic() - started < 1.0
    assert message == "the image has 50000000 pixels, more than the server's limit of 20000000 (--max-image-pixels)"
    assert loads == []  # refused before any pixel was decoded


def test_the_pixel_limit_is_the_limits_own() -> None:
    url = data_url(encode(picture(), "PNG"))
    assert "has 851 pixels, more than the server's limit of 850" in refusal(url, MediaLimits(max_pixels=850))
    assert load(url, MediaLimits(max_pixels=851)).size == SIZE


def test_pillows_decompression_bomb_limit_becomes_the_pixel_refusal() -> None:
    # 200,000,000 pixels: past twice Image.MAX_IMAGE_PIXELS, so Pillow refuses it in open().
    assert 200_000_000 > 2 * (Image.MAX_IMAGE_PIXELS or 0)
    message = refusal(data_url(png_header_only(20_000, 10_000)), MediaLimits(max_pixels=10**12))
    assert "more pixels than the server's limit" in message and "--max-image-pixels" in message


def test_a_data_url_over_max_bytes_is_refused_before_decoding() -> None:
    png = encode(picture(), "PNG")
    message = refusal(data_url(png), MediaLimits(max_bytes=len(png) - 1))
    assert message == f"the image is {len(png)} bytes, more than the limit of {len(png) - 1} bytes"
    assert load(data_url(png), MediaLimits(max_bytes=len(png))).size == SIZE


# --- http(s) ------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[str]:
    """A loopback HTTP server with one route per case; yields its base URL, stops at teardown."""
    png = encode(picture(), "PNG")
    release = threading.Event()  # set at teardown: ends the handlers that wait or stream

    class Handler(BaseHTTPRequestHandler):
        timeout = 5  # a handler whose client stopped reading ends rather than blocking teardown

        def log_message(self, format: str, *args: object) -> None:
            pass

        def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {"Content-Length": str(len(body))}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            try:
                self.route()
            except OSError:  # the client hung up, as it does on a refused body
                pass

        def route(self) -> None:
            port = self.server.server_address[1]
            if self.path == "/image.png":
                self.reply(200, png)
            elif self.path == "/missing":
                self.reply(404, b"not here")
            elif self.path == "/slow":
                release.wait(5)
                self.reply(200, png)
            elif self.path == "/moved":
                self.reply(302, headers={"Location": "/image.png", "Content-Length": "0"})
            elif self.path == "/moved-absolute":
                self.reply(301, headers={"Location": f"http://127.0.0.1:{port}/image.png", "Content-Length": "0"})
            elif self.path == "/away":
                self.reply(302, headers={"Location": "http://evil.example/steal.png", "Content-Length": "0"})
            elif self.path == "/to-file":
                self.reply(302, headers={"Location": "file:///etc/passwd", "Content-Length": "0"})
            elif self.path == "/no-location":
                self.reply(302, headers={"Content-Length": "0"})
            elif self.path == "/to-nowhere":
                self.reply(302, headers={"Location": "http://[::1/x.png", "Content-Length": "0"})
            elif self.path == "/loop":
                self.reply(302, headers={"Location": "/loop", "Content-Length": "0"})
            elif self.path == "/declared-big":
                self.reply(200, b"\0" * (3 * 2**20))
            elif self.path == "/endless":  # no Content-Length: the body ends when the server closes
                self.send_response(200)
                self.end_headers()
                while not release.is_set():
                    self.wfile.write(b"\0" * 2**16)
            elif self.path == "/gzip":
                self.reply(200, gzip.compress(png), {"Content-Encoding": "gzip"})
            else:
                self.reply(500, b"no such route")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_an_http_image_is_fetched_and_decoded(server: str) -> None:
    assert load(f"{server}/image.png").tobytes() == picture().tobytes()


@pytest.mark.parametrize("path", ["/moved", "/moved-absolute"])
def test_redirects_within_the_allowed_hosts_are_followed(server: str, path: str) -> None:
    limits = MediaLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=3.0)
    assert load(server + path, limits).tobytes() == picture().tobytes()


def test_a_non_2xx_status_is_refused(server: str) -> None:
    assert refusal(f"{server}/missing") == f"fetching {server}/missing failed: HTTP 404"


def test_a_slow_server_times_out(server: str) -> None:
    started = time.monotonic()
    message = refusal(f"{server}/slow", MediaLimits(fetch_timeout_s=SLOW_TIMEOUT_S))
    assert time.monotonic() - started < SLOW_TIMEOUT_S + 1.5
    assert message == f"fetching {server}/slow timed out after {SLOW_TIMEOUT_S:g} s"


def test_a_host_outside_the_allowed_domains_is_refused_before_connecting(server: str) -> None:
    message = refusal(f"{server}/image.png", MediaLimits(allowed_domains=("example.com",)))
    assert message == "host 127.0.0.1 is not in --allowed-media-domains"


def test_a_redirect_to_a_host_outside_the_allowed_domains_is_refused(server: str) -> None:
    message = refusal(f"{server}/away", MediaLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=3.0))
    assert message == "host evil.example is not in --allowed-media-domains"


def test_a_redirect_to_a_file_url_is_refused(server: str) -> None:
    assert "redirects to file:///etc/passwd, which is not an http(s) URL" in refusal(f"{server}/to-file")


def test_a_redirect_to_a_malformed_url_is_refused(server: str) -> None:
    assert refusal(f"{server}/to-nowhere").startswith(f"fetching {server}/to-nowhere failed: ")


def test_a_redirect_without_a_location_is_refused(server: str) -> None:
    """It was a KeyError, a 500."""
    assert refusal(f"{server}/no-location") == f"fetching {server}/no-location failed: a redirect without a Location"


def test_a_redirect_loop_is_cut_short(server: str) -> None:
    assert "redirected more than 5 times" in refusal(f"{server}/loop")


def test_a_declared_oversized_body_is_refused_unread(server: str) -> None:
    message = refusal(f"{server}/declared-big", MediaLimits(max_bytes=2**20, fetch_timeout_s=3.0))
    assert message == "the image is 3 MiB, more than the limit of 1 MiB"


def test_an_endless_body_is_cut_off_at_max_bytes(server: str) -> None:
    # The body never ends: a reader that did not stop at the cap would time out instead.
    started = time.monotonic()
    message = refusal(f"{server}/endless", MediaLimits(max_bytes=100_000, fetch_timeout_s=3.0))
    assert message == "the image is larger than the limit of 97.7 KiB"
    assert time.monotonic() - started < 2.0


def test_a_compressed_body_is_refused(server: str) -> None:
    assert "gzip-encoded; it must send it uncompressed" in refusal(f"{server}/gzip")


def test_a_refused_connection_is_refused_with_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed below: nothing listens there
    url = f"http://127.0.0.1:{port}/image.png"
    assert refusal(url).startswith(f"fetching {url} failed: ")


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("example.com", True),
        ("img.example.com", True),
        ("IMG.Example.COM.", True),
        ("notexample.com", False),
        ("example.com.evil.net", False),
        ("com", False),
        ("", False),
    ],
)
def test_a_host_matches_an_allowed_domain_or_its_subdomains(host: str, allowed: bool) -> None:
    assert _host_allowed(host, ("example.com", "")) is allowed


def test_a_look_alike_host_is_refused_before_connecting() -> None:
    limits = MediaLimits(allowed_domains=("example.com",))
    assert refusal("http://example.com.evil.net/a.png", limits) == (
        "host example.com.evil.net is not in --allowed-media-domains"
    )
    assert refusal("http://example.com@evil.net/a.png", limits) == "host evil.net is not in --allowed-media-domains"


# --- file URLs ----------------------------------------------------------------------------


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """An allowed folder holding an image, and a folder beside it holding another."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(encode(picture(), "PNG"))
    (outside / "secret.png").write_bytes(encode(picture(), "PNG"))
    return allowed, outside


def test_a_file_inside_the_allowed_folder_is_read(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    limits = MediaLimits(allowed_local_path=allowed)
    assert load((allowed / "cat.png").as_uri(), limits).tobytes() == picture().tobytes()
    assert load(f"file://localhost{allowed}/cat.png", limits).size == SIZE


def test_file_urls_are_refused_without_an_allowed_folder(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    message = refusal((allowed / "cat.png").as_uri(), MediaLimits())
    assert "file URLs are only allowed under --allowed-local-media-path" in message


@pytest.mark.parametrize("how", ["beside", "dotdot", "relative"])
def test_a_file_outside_the_allowed_folder_is_refused(folders: tuple[Path, Path], how: str) -> None:
    allowed, outside = folders
    url = {
        "beside": (outside / "secret.png").as_uri(),
        "dotdot": f"file://{allowed}/../outside/secret.png",
        "relative": "file:cat.png",  # would be read from wherever the server runs
    }[how]
    assert "is not under --allowed-local-media-path" in refusal(url, MediaLimits(allowed_local_path=allowed))


def test_a_symlink_inside_the_folder_to_a_file_outside_is_refused(folders: tuple[Path, Path]) -> None:
    allowed, outside = folders
    (allowed / "link.png").symlink_to(outside / "secret.png")
    message = refusal((allowed / "link.png").as_uri(), MediaLimits(allowed_local_path=allowed))
    assert message == f"{allowed}/link.png is not under --allowed-local-media-path"


def test_a_symlink_to_a_file_inside_the_folder_is_read(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    (allowed / "alias.png").symlink_to(allowed / "cat.png")
    assert load((allowed / "alias.png").as_uri(), MediaLimits(allowed_local_path=allowed)).size == SIZE


def test_missing_and_non_regular_files_are_refused(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    limits = MediaLimits(allowed_local_path=allowed)
    assert refusal((allowed / "dog.png").as_uri(), limits) == f"there is no file {allowed}/dog.png"
    assert refusal(allowed.as_uri(), limits) == f"{allowed} is not a regular file"


def test_a_file_url_naming_another_host_is_refused(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    message = refusal(f"file://fileserver{allowed}/cat.png", MediaLimits(allowed_local_path=allowed))
    assert "names host fileserver" in message


def test_a_file_over_max_bytes_is_refused(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    size = (allowed / "cat.png").stat().st_size
    message = refusal((allowed / "cat.png").as_uri(), MediaLimits(allowed_local_path=allowed, max_bytes=size - 1))
    assert message == f"the image is {size} bytes, more than the limit of {size - 1} bytes"
