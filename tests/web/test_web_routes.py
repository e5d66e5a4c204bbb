"""The chat page's routes on a fake engine (no browser, no model): served, open without a key,
off with --no-web-ui, and every file of it shipped as package data."""

from __future__ import annotations

import fnmatch
import re

import pytest
from server_helpers import ROOT, FakeEngine
from starlette.testclient import TestClient

from aiolm.server import build_app
from aiolm.server.settings import ServerSettings, from_environment, parse_serve_args
from aiolm.server.webui import WEB_DIR


def _client(**settings) -> TestClient:
    return TestClient(build_app(FakeEngine(), ServerSettings(**settings)), raise_server_exceptions=False)


def test_page_and_its_assets_are_served_same_origin_only():
    with _client() as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
        refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
        assert refs and all(u.startswith(("/web/", "data:")) for u in refs), refs  # nothing from elsewhere
        types = {"js": "text/javascript", "css": "text/css"}
        for path in WEB_DIR.iterdir():
            if path.suffix[1:] in types:
                asset = c.get(f"/web/{path.name}")
                assert asset.status_code == 200 and asset.headers["content-type"].startswith(types[path.suffix[1:]])
                for imp in re.findall(r'from "\./([^"]+)"', asset.text):
                    assert (WEB_DIR / imp).is_file(), f"{path.name} imports a missing {imp}"
        # the same page under /web/ has the same CSP; scripts are revalidated (an upgrade's
        # page must not run the last version's modules)
        same = c.get("/web/index.html")
        assert same.headers["content-security-policy"] == csp and "frame-ancestors 'none'" in csp
        assert c.get("/web/app.js").headers["cache-control"] == "no-cache"
        assert c.get("/web/nothing.js").status_code == 404
        for escape in ("/web/%2e%2e/webui.py", "/web/..%2fwebui.py"):  # the Python file beside web/
            assert c.get(escape).status_code == 404, escape


def test_page_loads_without_the_key_the_api_still_needs_it():
    with _client(api_key="k") as c:
        assert c.get("/").status_code == 200
        assert c.get("/web/app.js").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get("/webx").status_code == 401  # only the page's own prefix is open


def test_no_web_ui_turns_it_off():
    assert parse_serve_args([])[1].web_ui is True
    assert parse_serve_args(["--no-web-ui"])[1].web_ui is False
    assert from_environment({"AIOLM_ARGS": "--no-web-ui"})[1].web_ui is False
    with _client(web_ui=False) as c:
        r = c.get("/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert c.get("/web/app.js").status_code == 404
        assert c.get("/health").status_code == 200


def test_every_page_file_is_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["aiolm.server"]
    files = sorted(p.name for p in WEB_DIR.iterdir() if p.is_file())
    assert files, "no page files"
    missing = [f for f in files if not any(fnmatch.fnmatch(f"web/{f}", g) for g in globs)]
    assert not missing, f"not shipped in the wheel: {missing}"


@pytest.mark.parametrize("flag", ["--web-ui", "--no-web-ui"])
def test_flag_is_in_serve_help(flag):
    from aiolm.server.settings import build_parser

    assert flag in build_parser().format_help()
