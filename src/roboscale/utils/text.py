"""Text from a dataset, a checkpoint or an evaluation, made safe for where we show it.

A task name, an instruction or a file name is the data's author's, not ours: on a terminal it must not act
(escape sequences that clear the screen, set the title through OSC, or forge an ``error:`` line), and in a
Markdown report it must not become markup (``<script>``, ``<img onerror=...>``, a ``javascript:`` link, a table
cell split by ``|``). HTML pages escape with ``html.escape``.
"""

from __future__ import annotations

# ASCII punctuation that Markdown (CommonMark and GitHub's) reads as markup in running text or a table cell; each
# may be backslash-escaped. '-', '.', '+' and ':' only act at a line's start or inside a link, which the escaped
# brackets rule out, '(' and ')' only after a link's ']', and '_' never inside a word, so names like "drawer-open",
# "max_steps" and "reset(seed)" stay readable.
_MARKDOWN = frozenset("\\`*{}[]<>#!|&~")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, newlines, bidi controls) written
    as its escape, ``\\x1b``: a dataset's strings can then neither clear the screen nor forge a line of output."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def markdown_text(text: object) -> str:
    """``text`` as literal Markdown: printable (above), with every markup character backslash-escaped."""
    return "".join(f"\\{c}" if c in _MARKDOWN else c for c in printable(str(text)))


def markdown_code(text: object) -> str:
    """``text`` as a Markdown code span (shown as it is, nothing inside it is markup): printable, fenced with more
    backticks than its longest run of them; a ``|`` escaped, which GitHub's tables read even inside a span."""
    body = printable(str(text)).replace("|", "\\|")
    run, longest = 0, 0
    for c in body:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"
