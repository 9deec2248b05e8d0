"""docs/troubleshooting.md documents every error message eagle_hf raises.

Pure text: the package sources are parsed with `ast` (nothing is imported, no model is loaded). For every
`raise SomeError(<message>)` whose message is a str constant or an f-string, the longest literal piece of the
message (the text between `{...}` placeholders) must appear in the troubleshooting page, so that a user can
search the page for what they see. Implicit concatenation of several string pieces (multi-line messages) is
already joined into one node by the parser.

Raises whose message is not a literal (`raise err`, `raise SomeError(variable)`, bare `raise`) are skipped; at
the time of writing eagle_hf has none with a message worth documenting.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eagle_hf"
DOC = ROOT / "docs" / "troubleshooting.md"
MIN_FRAGMENT = 12  # shorter longest-literal pieces fall back to the message's constant prefix
PREFIX_MATCH = 30  # a fragment also counts as documented when its first 30 characters are quoted
STRIP = " \t\n.,;:()-"  # punctuation glued to a placeholder (`{n}-wide`, `({v});`) need not be quoted


def _message_parts(node: ast.expr) -> list[str] | None:
    """The literal pieces of a str constant or f-string message, in order; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        # A FormattedValue becomes a None separator: constants on either side of it are separate pieces.
        return [v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None for v in node.values]
    return None


def _fragment(parts: list[str | None]) -> str:
    literals = [p.strip(STRIP) for p in parts if p is not None]
    longest = max(literals, key=len, default="")
    if len(longest) >= MIN_FRAGMENT:
        return longest
    prefix = []
    for p in parts:
        if p is None:
            break
        prefix.append(p)
    return "".join(prefix).strip(STRIP) or longest


def raised_messages() -> tuple[list[tuple[str, int, str]], list[tuple[str, int]]]:
    """`(file, line, fragment)` of every literal-message raise, and `(file, line)` of the skipped ones."""
    found, skipped = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue  # bare re-raise
            exc = node.exc
            parts = _message_parts(exc.args[0]) if isinstance(exc, ast.Call) and exc.args else None
            if parts is None:
                skipped.append((rel, node.lineno))  # `raise err`, a class without a message, a non-literal message
                continue
            fragment = _fragment(parts)
            if fragment:
                found.append((rel, node.lineno, fragment))
    return found, skipped


def test_every_raised_message_is_in_troubleshooting_md():
    doc = DOC.read_text(encoding="utf-8")
    searchable = (doc, doc.replace("\\|", "|"))  # a `|` inside a Markdown table cell is written `\|`
    found, _skipped = raised_messages()
    assert len(found) >= 30, f"the ast scan found only {len(found)} raise sites: is the scan broken?"
    missing = [
        f"{rel}:{line}: {fragment!r}"
        for rel, line, fragment in found
        if not any(fragment in text or fragment[:PREFIX_MATCH] in text for text in searchable)
    ]
    assert not missing, (
        f"{len(missing)} error message(s) raised by eagle_hf are not documented in docs/troubleshooting.md "
        "(quote this literal piece of each message in the table's first column):\n" + "\n".join(missing)
    )
