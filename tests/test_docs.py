"""The README and docs/: every relative link and #anchor resolves, the README stays a front page, and every agent has
its page. Pure text: no torch, no envs (well under a second)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
AGENTS = ("csf", "metra", "diayn", "visr", "cic", "dads")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target), ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text):
    """The text outside fenced code blocks and inline code, where links are links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading):
    """GitHub's anchor for a heading: lowercase, markup and punctuation other than '-' and '_' dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(path):
    """Every heading's anchor on a page, repeated headings numbered -1, -2, ... as GitHub does."""
    seen, result = {}, set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path):
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


def test_slug_follows_github():
    assert slug("CSF on Ant (width 256, two seeds side by side, one torch thread each)") == \
        "csf-on-ant-width-256-two-seeds-side-by-side-one-torch-thread-each"
    assert slug("The host's part of a gradient step (what a GPU waits for)") == \
        "the-hosts-part-of-a-gradient-step-what-a-gpu-waits-for"
    assert slug("Flags every agent shares") == "flags-every-agent-shares"
    assert slug("`--compile` vs eager_path") == "--compile-vs-eager_path"


def test_repeated_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n## Results\n```\n# not a heading\n```\n## Results\n### Results\n")
    assert anchors(page) == {"a", "results", "results-1", "results-2"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        destination = (page.parent / file).resolve() if file else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading of {destination.name} has the anchor #{anchor}")
        elif destination.exists() and ROOT not in destination.parents and destination != ROOT:
            broken.append(f"{target}: outside the repository")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_is_a_front_page_that_links_every_docs_page():
    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 250
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(readme)}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"README.md does not link docs/{missing}"


def test_the_commands_that_ci_runs_are_in_the_readme():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install -r requirements.txt && python csf.py --env-id Ant" in text
    assert "python -m pytest -q" in text
    assert "libosmesa6" in text and "libegl1" in text and "MUJOCO_GL" in text


def test_every_script_has_its_page():
    """Each agent script, goal_reaching.py, hierarchical.py and envs.py: docs/<script>.md."""
    scripts = {p.stem for p in ROOT.glob("*.py")}
    assert set(AGENTS) <= scripts, f"agent scripts missing: {set(AGENTS) - scripts}"
    missing = [name for name in sorted(scripts) if not (ROOT / "docs" / f"{name}.md").is_file()]
    assert not missing, f"no docs page for {missing}"


def table_rows_of_another_width(text):
    """Rows of a markdown table whose number of cells differs from its header's: a '|' left unescaped inside a cell
    (in code or not, GitHub splits there) shifts the rest of the row."""
    wrong, width = [], None
    for number, line in enumerate(FENCE.sub(lambda block: "\n" * block.group().count("\n"), text).splitlines(), 1):
        if not line.startswith("|"):
            width = None
            continue
        cells = len(re.split(r"(?<!\\)\|", line.strip())) - 2
        if width is None:
            width = cells
        elif cells != width:
            wrong.append(f"line {number}: {cells} cells, the header has {width}")
    return wrong


def test_table_widths_are_checked():
    assert table_rows_of_another_width("| a | b |\n|---|---|\n| 1 | 2 |\n\n| c |\n|---|\n| 3 |\n") == []
    assert table_rows_of_another_width("| a | b |\n|---|---|\n| H ≥ −\\|A\\|/2 | 2 |\n") == []
    assert table_rows_of_another_width("| a | b |\n|---|---|\n| H ≥ −|A|/2 | 2 |\n") == ["line 3: 4 cells, the header has 2"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_table_row_has_its_headers_cells(page):
    wrong = table_rows_of_another_width(page.read_text(encoding="utf-8"))
    assert not wrong, f"{page.name}: {wrong}"
