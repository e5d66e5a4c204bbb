"""The images chat requests carry: fetched and decoded within limits, or refused with a reason.

An OpenAI ``image_url`` content part names its image by a data URL, an http(s) URL or, where
the operator allows it, a file URL. All three come from a client, so every step is bounded by
:class:`MediaLimits`: which hosts and which folder, how long a fetch may take, how many encoded
bytes and how many pixels. The pixel count is read from the image's header before anything is
decoded, so a small file that would expand to gigabytes costs no more than its header. Decoding
runs in a thread, so a large image never stalls the event loop.

Every failure is a :class:`~aiolm.params.ParamError` on the request's field with a message the
client can act on; no Pillow or httpx exception leaves this module as anything else.
"""

from __future__ import annotations

import asyncio
import base64
import io
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from aiolm.params import ParamError
from aiolm.timeouts import wait_for

# The formats a client may send: OpenAI's (PNG, JPEG, WebP, GIF) and BMP. Pillow opens many
# more, some of them through external programs (EPS runs Ghostscript); a client reaches none.
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_FORMAT_NAMES = "a PNG, JPEG, WebP, GIF or BMP image"
_MAX_REDIRECTS = 5
_SHOWN_URL_CHARS = 200  # a URL quoted in an error message is cut to this


@dataclass(frozen=True)
class MediaLimits:
    """What a client may make the server fetch and decode."""

    allowed_domains: tuple[str, ...] | None = None  # http(s) hosts allowed (and their subdomains); None: any host
    allowed_local_path: Path | None = None  # file URLs only under this folder; None: file URLs refused
    fetch_timeout_s: float = 10.0  # the whole http(s) fetch, redirects and body included
    max_bytes: int = 20 * 2**20  # encoded size: a data URL's payload, an HTTP body, a file
    max_pixels: int = 20_000_000  # width * height, checked from the header before decoding


async def load_image(url: str, limits: MediaLimits, field: str) -> Image.Image:
    """The image at ``url`` decoded to RGB, or a ParamError on ``field`` saying why not.

    ``url`` is a ``data:image/...;base64,`` URL, an http(s) URL or a file URL; fetching and
    decoding stay within ``limits``.
    """
    return await decode_image(await fetch_image(url, limits, field), limits, field)


async def fetch_image(url: str, limits: MediaLimits, field: str) -> bytes:
    """The encoded image at ``url`` (at most ``limits.max_bytes``), not decoded yet."""
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:  # e.g. an unclosed IPv6 bracket in the host
        raise ParamError(field, f"the image URL {_show(url)} is malformed") from None
    if scheme == "data":  # base64 of up to max_bytes: decoded off the loop
        return await asyncio.to_thread(_data_url_bytes, url, limits.max_bytes, field)
    elif scheme in ("http", "https"):
        return await _fetch(url, limits, field)
    elif scheme == "file":
        return await asyncio.to_thread(_read_file, url, limits, field)
    elif not url:
        raise ParamError(field, "the image URL is empty")
    got = f"a {scheme}: URL" if scheme else f"{_show(url)}, which has no scheme"
    raise ParamError(field, f"the image URL must be a data:image/...;base64, http(s) or file URL, not {got}")


async def decode_image(data: bytes, limits: MediaLimits, field: str) -> Image.Image:
    """``data`` decoded to RGB off the event loop, its pixel count checked first."""
    return await asyncio.to_thread(_decode, data, limits.max_pixels, field)


def _data_url_bytes(url: str, max_bytes: int, field: str) -> bytes:
    """The payload of ``data:image/<type>;base64,<payload>``."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ParamError(field, "the data URL has no ',' before its payload")
    media_type, *params = (part.strip().lower() for part in header.split(";"))
    if not media_type.startswith("image/"):
        raise ParamError(field, f"the data URL's media type is {media_type or 'missing'}, not image/...")
    if "base64" not in params:
        raise ParamError(field, "the data URL is not base64: send data:image/<type>;base64,<payload>")
    # The decoded size, known before decoding (exact for valid base64): refuse before allocating.
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if size > max_bytes:
        raise _too_big(field, size, max_bytes)
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:  # binascii.Error, or a non-ASCII character
        raise ParamError(field, "the data URL's base64 payload is invalid") from None


async def _fetch(url: str, limits: MediaLimits, field: str) -> bytes:
    """The body at an http(s) URL, within the time, size and host limits."""
    try:
        return await wait_for(_fetch_unbounded(url, limits, field), limits.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise _timed_out(field, url, limits.fetch_timeout_s) from None


async def _fetch_unbounded(url: str, limits: MediaLimits, field: str) -> bytes:
    # Redirects are followed here, not by httpx, so that each hop's host is checked. Only
    # uncompressed bodies are asked for and taken: the size cap then counts what is decoded,
    # and a small compressed body cannot expand in memory before the cap sees it.
    headers = {"Accept": "image/*", "Accept-Encoding": "identity"}
    timeout = httpx.Timeout(limits.fetch_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, follow_redirects=False) as client:
        for _ in range(_MAX_REDIRECTS + 1):
            try:
                _check_host(httpx.URL(url).host, limits.allowed_domains, field)
                async with client.stream("GET", url) as response:
                    if response.is_redirect:
                        if "location" not in response.headers:
                            raise ParamError(field, f"fetching {_show(url)} failed: a redirect without a Location")
                        url = _redirect_target(url, response.headers["location"], field)
                        continue
                    if not response.is_success:
                        raise ParamError(field, f"fetching {_show(url)} failed: HTTP {response.status_code}")
                    return await _read_body(response, limits.max_bytes, field)
            except httpx.TimeoutException:
                raise _timed_out(field, url, limits.fetch_timeout_s) from None
            except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as e:
                raise ParamError(field, f"fetching {_show(url)} failed: {str(e) or type(e).__name__}") from e
    raise ParamError(field, f"fetching the image URL was redirected more than {_MAX_REDIRECTS} times")


def _redirect_target(url: str, location: str, field: str) -> str:
    """Where a redirect from ``url`` leads, refused unless it is another http(s) URL."""
    try:
        target = urljoin(url, location)
        scheme = urlsplit(target).scheme.lower()
    except ValueError:
        raise ParamError(field, f"{_show(url)} redirects to a malformed URL") from None
    if scheme not in ("http", "https"):
        raise ParamError(field, f"the image URL redirects to {_show(target)}, which is not an http(s) URL")
    return target


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``host`` is an allowed domain or a subdomain of one (``img.example.com``)."""
    host = host.rstrip(".").lower()
    domains = (d.strip().strip(".").lower() for d in allowed)
    return any(host == d or host.endswith("." + d) for d in domains if d)


def _check_host(host: str, allowed: tuple[str, ...] | None, field: str) -> None:
    if allowed is not None and not _host_allowed(host, allowed):
        raise ParamError(field, f"host {host or '(none)'} is not in --allowed-media-domains")


async def _read_body(response: httpx.Response, max_bytes: int, field: str) -> bytes:
    """The body, read until it passes ``max_bytes`` at most."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise ParamError(field, f"the server sent the image {encoding}-encoded; it must send it uncompressed")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_big(field, int(declared), max_bytes)
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > max_bytes:
            raise _too_big(field, None, max_bytes)
    return bytes(body)


def _read_file(url: str, limits: MediaLimits, field: str) -> bytes:
    """The bytes of a file URL's file, which must lie (symlinks resolved) in the allowed folder."""
    if limits.allowed_local_path is None:
        raise ParamError(field, "file URLs are only allowed under --allowed-local-media-path, which is not set")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ParamError(field, f"the file URL names host {parts.netloc}; use file:///<absolute path>")
    requested = unquote(parts.path)
    try:
        path = Path(requested).resolve()
        inside = requested.startswith("/") and path.is_relative_to(limits.allowed_local_path.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte in the path
        inside = False
    if not inside:
        raise ParamError(field, f"{requested} is not under --allowed-local-media-path")
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise ParamError(field, f"{requested} is not a regular file")
        if st.st_size > limits.max_bytes:
            raise _too_big(field, st.st_size, limits.max_bytes)
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)  # the file may have grown since stat
    except FileNotFoundError:
        raise ParamError(field, f"there is no file {requested}") from None
    except OSError as e:
        raise ParamError(field, f"cannot read {requested}: {e.strerror or e}") from None
    if len(data) > limits.max_bytes:
        raise _too_big(field, None, limits.max_bytes)
    return data


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as RGB the way transformers' processors make it: what is transparent shows
    the white behind it (``convert("RGB")`` alone keeps the colour a transparent pixel holds,
    black in most files)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _decode(data: bytes, max_pixels: int, field: str) -> Image.Image:
    """``data`` decoded to RGB, its pixel count checked from the header before decoding."""
    try:
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise _too_many_pixels(field, width * height, max_pixels)
            image.load()  # all of it now: a truncated file fails here, not in a later step
            return to_rgb(image)
    except ParamError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own limit, met in open() before the check above: past twice
        # Image.MAX_IMAGE_PIXELS always, past it too where warnings are errors.
        raise _too_many_pixels(field, None, max_pixels) from None
    except UnidentifiedImageError:
        raise ParamError(field, f"the data is not {_FORMAT_NAMES}") from None
    except Exception as e:
        # Pillow's decoders report bad data as OSError, SyntaxError, ValueError, EOFError,
        # struct.error, zlib.error and more, with no common base class but Exception.
        raise ParamError(field, "the image is corrupt or truncated") from e


def _too_many_pixels(field: str, pixels: int | None, limit: int) -> ParamError:
    has = f"has {pixels} pixels, more than" if pixels is not None else "has more pixels than"
    return ParamError(field, f"the image {has} the server's limit of {limit} (--max-image-pixels)")


def _too_big(field: str, size: int | None, limit: int) -> ParamError:
    is_ = f"is {_size(size)}, more than" if size is not None else "is larger than"
    return ParamError(field, f"the image {is_} the limit of {_size(limit)}")


def _timed_out(field: str, url: str, timeout_s: float) -> ParamError:
    return ParamError(field, f"fetching {_show(url)} timed out after {timeout_s:g} s")


def _size(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + " " + unit
    return f"{n} bytes"


def _show(url: str) -> str:
    return url if len(url) <= _SHOWN_URL_CHARS else url[:_SHOWN_URL_CHARS] + "..."
