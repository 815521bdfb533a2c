"""Text made safe for each place a view puts it: HTML, SVG (XML), plotly's text markup, JSON in a script.

A cell's source, a variable's or a class's name, an exception's message, a snapshot's file and
frame names: any of it may hold ``<a href=...>``, ``</svg><script>`` or a lone ``&``. Each target
reads different characters as markup, so each has one function here, applied once, where the
string is placed into that target:

    esc(value)            HTML text and attribute values, quotes included
    xml_text(value)       SVG text and attribute values: as ``esc``, less what XML 1.0 forbids
    plotly_text(value)    any text field of a plotly figure: hover text, trace names, titles, tick
                          labels, annotations, hovertemplates
    script_json(value)    a value as JSON inside an HTML ``<script>`` element

Strings of our own markup (plotly's ``<br>``, an ``<extra>`` in a hovertemplate) are added
around the escaped text, never passed through these functions.
"""
from __future__ import annotations

import html
import json
import re

__all__ = ["esc", "xml_text", "plotly_text", "script_json"]

#: What XML 1.0 forbids in a document (C0 controls but tab, newline, carriage return; lone surrogates),
#: and DEL, which no chart needs.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
_NEWLINE = re.compile(r"\r\n?|\n")


def esc(value) -> str:
    """``value`` as text, escaped for HTML (quotes included, for attributes)."""
    return html.escape(str(value), quote=True)


def xml_text(value) -> str:
    """``value`` for SVG text and attribute values: escaped as for HTML (``&quot;`` and ``&#x27;`` are
    XML too), without the characters XML 1.0 forbids, so the picture always parses."""
    return esc(_NOT_XML.sub("", str(value)))


def plotly_text(value) -> str:
    """``value`` for a plotly text field, shown as it is written.

    plotly.js reads its text fields as a small HTML: tags (``<a href>``, ``<b>``, ``<span style>``,
    ``<br>``) and entities (``&amp;``, ``&#60;``), and it fills ``%{...}`` in a hovertemplate. So
    ``&``, ``<`` and ``>`` become entities it decodes, ``%{`` becomes ``&#37;{`` (shown as ``%{``,
    never filled in), and line breaks become its ``<br>`` (it would show a newline as a space).
    Quotes stay as they are: without a ``<`` no tag, so no attribute, can start.

    Examples:
        >>> plotly_text("a<b and c>d & e\\n%{x}")
        'a&lt;b and c&gt;d &amp; e<br>&#37;{x}'
    """
    text = html.escape(str(value), quote=False).replace("%{", "&#37;{")
    return _NEWLINE.sub("<br>", text)


def script_json(value) -> str:
    """``value`` as JSON to write inside an HTML ``<script>``: no ``<``, ``>`` or ``&`` appears raw (so no
    ``</script>`` or ``<!--`` can end or bend the element), nor a line separator a script reads as a line end."""
    text = json.dumps(value)  # ASCII only: U+2028 and U+2029 come out as \u escapes
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
