"""HTML tables for the reports (evaluation, comparison, robustness, training run)."""

from __future__ import annotations

from collections.abc import Collection


def html_table(header: list[str], rows: list[list[str]], numeric: Collection[int] = ()) -> str:
    """Cells are HTML already (callers escape text); ``numeric`` columns are right-aligned."""
    def cls(i: int) -> str:
        return " class='num'" if i in numeric else ""

    head = "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
