"""The API docs pages work offline: every asset /docs and /redoc reference is served by the service."""

from __future__ import annotations

import json
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlparse

import pytest

pytestmark = pytest.mark.timeout(120)

# Places a docs page names a URL: tag attributes, and the URL strings of Swagger UI's config.
_URL_ATTRIBUTES = ("src", "href", "spec-url")
_JS_URLS = re.compile(r"""\b(?:url|oauth2RedirectUrl)\s*:\s*(?:window\.location\.origin\s*\+\s*)?['"]([^'"]+)['"]""")
_CSS_URLS = re.compile(r"""url\(\s*['"]?([^'")]+)['"]?\s*\)""")


class _Refs(HTMLParser):
    """Every URL a page's tags point to, and the text of its inline scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in _URL_ATTRIBUTES and value]
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


def _references(html: str) -> list[str]:
    parser = _Refs()
    parser.feed(html)
    return parser.urls + [m for script in parser.scripts for m in _JS_URLS.findall(script)]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_page_assets_come_from_the_service(server_factory: Any, page: str) -> None:
    server = server_factory(token=None).start()
    response = server.request("GET", page)
    assert response.status_code == 200, response.text
    refs = _references(response.text)
    # Swagger UI: stylesheet, favicon, bundle, spec, OAuth2 redirect; ReDoc: favicon, spec, bundle.
    assert len(refs) >= (5 if page == "/docs" else 3), refs
    seen: set[str] = set()
    queue = [urljoin(server.url + page, ref) for ref in refs]
    while queue:
        url = queue.pop()
        if url in seen:
            continue
        seen.add(url)
        assert urlparse(url).netloc == urlparse(server.url).netloc, f"{page} loads {url} from elsewhere"
        asset = server.request("GET", urlparse(url).path)
        assert asset.status_code == 200, f"{page}: {url} -> {asset.status_code}"
        assert asset.content, f"{page}: {url} is empty"
        if url.endswith(".css"):  # images and fonts a stylesheet pulls in must be local too
            queue += [urljoin(url, ref) for ref in _CSS_URLS.findall(asset.text)
                      if not ref.startswith("data:")]
    assert any(url.endswith("/openapi.json") for url in seen)
    assert any(url.endswith(".js") for url in seen)


CHROMIUM = Path("/usr/bin/chromium")


def _page_requests(net_log: Path, origin: str) -> list[str]:
    """URLs the page itself asked for (Chromium's net log: requests whose initiator is the page's
    origin; the browser's own update and account checks have none)."""
    log = json.loads(net_log.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [event["params"]["url"] for event in log["events"]
            if event["type"] == start_job and event.get("params", {}).get("initiator") == origin]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)")
def test_redoc_in_a_browser_requests_nothing_off_the_service(server_factory: Any, tmp_path: Path) -> None:
    # ReDoc's bundle draws its side menu's logo from cdn.redoc.ly: the one external request left.
    server = server_factory(token=None).start()
    net_log = tmp_path / "net.json"
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=20000", f"--log-net-log={net_log}",
         "--dump-dom", f"{server.url}/redoc"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "API docs by Redocly" in done.stdout  # ReDoc rendered its side menu (where the logo is)
    requested = _page_requests(net_log, server.url)
    assert any(url.endswith("/openapi.json") for url in requested), requested
    assert any(url.endswith("logo-mini.svg") for url in requested), requested
    off = [url for url in requested if urlparse(url).netloc != urlparse(server.url).netloc]
    assert not off, f"/redoc requested {off}"
    for url in requested:
        assert server.request("GET", urlparse(url).path).status_code == 200, url
