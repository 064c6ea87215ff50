"""Check the built site: it loads nothing from another host, and its API signatures fit the page.

``nox -s docs`` runs it on what ``mkdocs build`` wrote::

    python docs/check_site.py SITE_DIR

A page that makes the browser fetch a script, a stylesheet, a font or an
image from another host does not work offline, and tells that host who reads
it: mkdocs-material asks Google Fonts for Roboto on every page unless
``theme.font`` is off. A signature that mkdocstrings could not format (it
needs ruff or black installed beside it) is one line of 300 characters or
more, scrolled sideways in a column that shows some 80.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

#: The attributes by which a tag makes the browser fetch something, by tag.
FETCHED: Final = {
    "script": ("src",),
    "link": ("href",),
    "img": ("src", "srcset"),
    "source": ("src", "srcset"),
    "iframe": ("src",),
    "video": ("src", "poster"),
    "audio": ("src",),
    "embed": ("src",),
    "object": ("data",),
}
#: Tags that have no end tag: they open nothing inside a signature.
VOID: Final = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"})
#: Hosts that serve only fonts: named anywhere, in a page, a stylesheet or a script, they are a font to fetch.
FONT_HOSTS: Final = ("fonts.googleapis.com", "fonts.gstatic.com")
#: What a stylesheet fetches: ``url(...)`` and ``@import "..."``.
CSS_URL: Final = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""")
#: Characters of a signature line that the content column shows without scrolling, beside both sidebars.
WIDEST: Final = 80


def elsewhere(url: str) -> bool:
    """Whether ``url`` names another host (``https://host/...`` or ``//host/...``); paths and data are local."""
    return bool(urlsplit(url.strip()).netloc)


class Page(HTMLParser):
    """One page's fetches from other hosts, and the text of its API signatures."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        #: ``tag attribute=url`` of each fetch from another host.
        self.fetches: list[str] = []
        #: One string per ``<div class="doc-signature">``, its lines as rendered.
        self.signatures: list[str] = []
        #: Open tags inside the signature being read; ``None`` outside any.
        self._depth: int | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Note what ``tag`` fetches from another host; begin a signature, or go one tag deeper in one."""
        values = {name: value or "" for name, value in attrs}
        for name in FETCHED.get(tag, ()):
            value = values.get(name, "")
            # A srcset lists candidates, ``url 1x, url 2x``; a URL may hold commas.
            urls = [part.split()[0] for part in value.split(",") if part.split()] if name == "srcset" else [value]
            self.fetches += [f"<{tag} {name}={url}>" for url in urls if elsewhere(url)]
        self.fetches += [f'<{tag} style="url({url})">' for url in stylesheet_urls(values.get("style", ""))]
        if self._depth is not None:
            if tag not in VOID:
                self._depth += 1
        elif tag == "div" and "doc-signature" in values.get("class", "").split():
            self._depth = 0
            self.signatures.append("")

    def handle_endtag(self, tag: str) -> None:
        """Come one tag out of a signature; its own ``</div>`` ends it."""
        if self._depth is None:
            return
        if self._depth == 0:
            self._depth = None
        else:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        """Text inside a signature is the signature's."""
        if self._depth is not None:
            self.signatures[-1] += data


def stylesheet_urls(css: str) -> Iterator[str]:
    """The URLs on other hosts that ``css`` fetches."""
    for match in CSS_URL.finditer(css):
        url = match.group(1) or match.group(2)
        if elsewhere(url):
            yield url


def problems(site: Path) -> Iterator[str]:
    """Every fetch from another host in ``site``, and every API signature line too wide for the page."""
    signatures = 0
    for path in sorted(site.rglob("*")):
        where = path.relative_to(site)
        if path.suffix not in {".html", ".css", ".js"}:
            continue
        text = path.read_text(encoding="utf-8")
        yield from (f"{where}: names {host}" for host in FONT_HOSTS if host in text)
        if path.suffix == ".css":
            yield from (f"{where}: fetches {url}" for url in stylesheet_urls(text))
        if path.suffix != ".html":
            continue
        page = Page()
        page.feed(text)
        yield from (f"{where}: fetches {fetch}" for fetch in page.fetches)
        for style in re.findall(r"<style[^>]*>(.*?)</style>", text, flags=re.DOTALL):
            yield from (f"{where}: <style> fetches {url}" for url in stylesheet_urls(style))
        for signature in page.signatures:
            signatures += 1
            widest = max(signature.splitlines(), key=len, default="")
            if len(widest) > WIDEST:
                yield f"{where}: a signature line of {len(widest)} characters (at most {WIDEST}): {widest[:60]}..."
    if not signatures:
        yield f"{site}: no API signature at all (no <div class='doc-signature'>): is it the built site?"


def main(argv: Sequence[str] | None = None) -> int:
    """Check the site at the one argument; exit with every problem found, one a line."""
    arguments = sys.argv[1:] if argv is None else argv
    if len(arguments) != 1 or not Path(arguments[0]).is_dir():
        sys.exit("usage: python docs/check_site.py SITE_DIR")
    found = list(problems(Path(arguments[0])))
    if found:
        sys.exit("\n".join([*found, f"{len(found)} problems in the built site"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
