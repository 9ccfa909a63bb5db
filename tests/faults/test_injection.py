"""Names that reach a terminal or a Markdown report are the data's author's text, never ours to act on: a task name
or an instruction with terminal escape sequences, HTML or Markdown links (issue 31: `eval compare` printed the
escapes raw and wrote them into compare.md; report.md carried raw `<script>`, `<img onerror>`, `javascript:` links
and ESC bytes). The HTML pages were escaped already."""

from __future__ import annotations

import re
from pathlib import Path

from roboscale.eval.compare import write_comparison
from roboscale.utils.text import markdown_code, markdown_text, printable
from tests.eval.test_report import make_report

# an OSC title change, a screen clear, a forged error line, a script, an image with a handler, a javascript: link
HOSTILE = ("x\x1b]0;pwned\x07\x1b[2J\nerror: forged <script>alert(1)</script> <img src=x onerror=alert(2)> "
           "[click](javascript:alert(3)) | cell")
INSTRUCTION = "open it <b>now</b> ![img](javascript:alert(4)) `code` *bold*"


def _hostile_report(out: Path, label: str) -> None:
    make_report(out, {HOSTILE: (3, 4), "reach-v3": (1, 4)}, label=label,
                instructions={HOSTILE: INSTRUCTION, "reach-v3": "Reach"})


def _assert_inert(markdown: str) -> None:
    assert not any(c in markdown for c in "\x1b\x07\r"), "a terminal control character reached the text"
    # what a Markdown renderer would read as an HTML tag, a link or a cell boundary of ours: none unescaped
    assert not re.search(r"(?<!\\)<[a-zA-Z/!]", markdown), "an HTML tag"
    assert not re.search(r"(?<!\\)\]\(", markdown), "a link"
    assert not re.search(r"(?<!\\)\| cell", markdown), "a table cell split"


def test_report_md_shows_hostile_names_as_text(tmp_path: Path) -> None:
    _hostile_report(tmp_path, "run")
    markdown = (tmp_path / "report.md").read_text()
    _assert_inert(markdown)
    assert markdown_text(HOSTILE) in markdown and markdown_text(INSTRUCTION) in markdown  # shown, not dropped
    assert "&lt;script&gt;" in (tmp_path / "report.html").read_text()  # the page was escaped already (held)


def test_eval_compare_prints_and_writes_hostile_names_as_text(tmp_path: Path, capsys) -> None:
    from roboscale.cli import main

    _hostile_report(tmp_path / "a", "a\x1b[31m")
    _hostile_report(tmp_path / "b", "b")
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), f"--output_dir={tmp_path / 'cmp'}"]) == 0
    printed = capsys.readouterr().out
    _assert_inert(printed)
    _assert_inert((tmp_path / "cmp" / "compare.md").read_text())
    assert markdown_text(HOSTILE) in printed


def test_write_comparison_returns_inert_markdown(tmp_path: Path) -> None:
    _hostile_report(tmp_path / "a", "a")
    _hostile_report(tmp_path / "b", "b")
    markdown, md_path, _ = write_comparison([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    _assert_inert(markdown)
    assert md_path.read_text().strip() == markdown.strip()


def test_the_escapes_are_reversible_text():
    assert printable("a\x1b[2Jb\n") == "a\\x1b[2Jb\\n"
    assert markdown_text("drawer-open v3.1") == "drawer-open v3.1"  # ordinary names stay readable
    assert markdown_text("<a|b>") == "\\<a\\|b\\>"
    assert markdown_code("a`b") == "``a`b``" and markdown_code("`x") == "`` `x ``"


def test_data_info_prints_a_string_tools_value_as_it_is(tmp_path: Path, capsys) -> None:
    """info.json's ``tools`` as a string was shown as one ``?`` per character."""
    import json
    import shutil

    from roboscale.cli import main

    root = tmp_path / "dataset"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "lerobot-0.6-mini", root)
    info = json.loads((root / "meta" / "info.json").read_text())
    for tools, shown in (("say\x1b[2J hello", "say\\x1b[2J hello"), (["plain", {"type": "function"}, 3],
                                                                    'plain, {"type": "function"}, 3')):
        info["tools"] = tools
        (root / "meta" / "info.json").write_text(json.dumps(info))
        assert main(["data", "info", str(root)]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("tools:")]
        assert lines == [f"  tools: {shown}"], lines
