"""The inline reStructuredText of the suites' docstrings, rendered for a reader.

An invariant's text is its test's docstring (its first paragraph), written for Sphinx: ``code`` in
double backquotes, cross-references as ``:func:`name```. The report keeps that text as written (the
JSON document carries it verbatim) and renders it here: plain text in the terminal, ``<code>`` in
the HTML page. A cross-reference shows its title (``:func:`title <target>```) or, with ``~``, the
target's last component, as Sphinx does.
"""

from __future__ import annotations

import html
import re

__all__ = ["html_text", "plain_text"]

_INLINE = re.compile(r"``(?P<literal>.+?)``|:(?P<role>[a-z]+):`(?P<target>[^`]+)`")

_CODE_ROLES = frozenset({"attr", "class", "const", "data", "exc", "func", "meth", "mod", "obj"})
"""Roles that name code (shown as ``<code>``); others (``:ref:``, ``:doc:``, ``:term:``) are words."""


def _title(target: str) -> str:
    """What Sphinx shows for a cross-reference: its explicit title, or the last component with ``~``."""
    titled = re.fullmatch(r"(?P<title>.+?)\s*<[^<>]+>", target)
    if titled:
        return titled["title"]
    return target[1:].rsplit(".", 1)[-1] if target.startswith("~") else target


def plain_text(text: str) -> str:
    """``text`` without inline markup: ``x`` for ````x```` and for a cross-reference to ``x``."""
    return _INLINE.sub(lambda m: m["literal"] if m["literal"] is not None else _title(m["target"]), text)


def html_text(text: str) -> str:
    """``text`` as escaped HTML, inline literals and code cross-references as ``<code>``."""
    out, last = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[last : m.start()]))
        if m["literal"] is not None:
            out.append(f"<code>{html.escape(m['literal'])}</code>")
        elif m["role"] in _CODE_ROLES:
            out.append(f"<code>{html.escape(_title(m['target']))}</code>")
        else:
            out.append(html.escape(_title(m["target"])))
        last = m.end()
    out.append(html.escape(text[last:]))
    return "".join(out)
