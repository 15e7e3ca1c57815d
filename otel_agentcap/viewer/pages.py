"""The run page in its two forms: served (assets linked from ``/static``) and exported (one
self-contained file: style, script and the run's data inline, a Content-Security-Policy that
allows nothing else, so the file never reaches the network)."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Final

from .app import static_text

_CSP_MARK: Final = "<!--agentcap:csp-->"
_STYLE_MARK: Final = "<!--agentcap:style-->"
_DATA_MARK: Final = "<!--agentcap:data-->"
_SCRIPT_MARK: Final = "<!--agentcap:script-->"


def _fill(template: str, **parts: str) -> str:
    marks = {"csp": _CSP_MARK, "style": _STYLE_MARK, "data": _DATA_MARK, "script": _SCRIPT_MARK}
    for name, mark in marks.items():
        if template.count(mark) != 1:
            raise ValueError(f"run.html must hold {mark} once")
        # str.replace with a function-free replacement: the parts are inserted verbatim
        head, tail = template.split(mark)
        template = head + parts.get(name, "") + tail
    return template


def served_run_page() -> str:
    return _fill(
        static_text("run.html"),
        style='<link rel="stylesheet" href="/static/view.css">',
        script='<script src="/static/run.js"></script>',
    )


def script_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` (so
    neither ``</script>`` nor ``<!--`` can end or change the element), no U+2028/U+2029."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in (
        ("&", "\\u0026"),
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escape)
    return text


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def exported_run_page(data: Any) -> str:
    """The run page with ``data`` (the embedded document ``run.js`` reads) and every asset
    inline."""
    style = static_text("view.css")
    script = static_text("run.js")
    csp = (
        f"default-src 'none'; script-src '{_sha256(script)}'; style-src '{_sha256(style)}'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    return _fill(
        static_text("run.html"),
        csp=f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        style=f"<style>{style}</style>",
        data=f'<script type="application/json" id="agentcap-data">{script_json(data)}</script>',
        script=f"<script>{script}</script>",
    )
