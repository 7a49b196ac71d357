"""The README and docs/ as a user reads them: every link leads somewhere, and their examples run as written
against a real server (the CLI's lines, the Python client's program)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from lmgate.client.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "engine/README.md", *(f"docs/{name}" for name in sorted(os.listdir(os.path.join(ROOT, "docs"))))]
# Lines that need what a test does not have (a checkpoint of the user's, a prompt file) or take minutes (a
# benchmark: `make bench-*` runs those); each is covered by a test of its own in test_client_cli.py.
NOT_RUN = ("/path/to/", "< prompt.txt", "lmgate bench", "lmgate chat")


def run(line: str) -> int:
    """One line through the CLI's `main`, as bash would split it (`$'\\n\\n'` included); --version exits."""
    try:
        return main(shlex.split(line.replace("$'\\n\\n'", "'\n\n'"))[1:])
    except SystemExit as done:
        return done.code


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", read(page), re.S)


def cli_lines(page: str) -> list[str]:
    """The `lmgate ...` commands of a page's shell blocks, without comments; `a && b` as two."""
    lines = []
    for block in blocks(page, "sh"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command.startswith("lmgate ") and not any(word in command for word in NOT_RUN):
                lines += [part.strip() for part in command.split("&&")]
    return lines


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_of_a_page_leads_to_a_file(page):
    base = os.path.dirname(os.path.join(ROOT, page))
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", read(page)) if "://" not in t]
    missing = [t for t in targets if t and not os.path.exists(os.path.join(base, t))]
    assert not missing, f"{page} links to files that are not there: {missing}"


def test_the_cli_examples_run_as_written(server, monkeypatch, capsys):
    """README's and docs/clients.md's `lmgate` lines (`$'...'` as bash reads it), against the shared server; a
    Sleep among them is woken again, whatever fails."""
    monkeypatch.setenv("LMGATE_TARGET", server.address)
    lines = cli_lines("README.md") + cli_lines("docs/clients.md")
    assert len(lines) >= 8 and "lmgate sleep --level 1" in lines
    try:
        for line in lines:
            assert run(line) == 0, line
            out = capsys.readouterr().out
            assert out.strip(), f"{line} printed nothing"
    finally:
        main(["wakeup"])
    stop = next(line for line in lines if "--stop" in line)
    run(stop)
    printed = capsys.readouterr()
    assert printed.out.strip() and "finish_reason=stop" in printed.err  # it stopped at a stop string, with text


def test_the_python_example_runs_as_written(server):
    """The README's program, with the shared server's address for the default one."""
    program = blocks("README.md", "python")[0].replace("127.0.0.1:50051", server.address)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(program, "README.md", "exec"), {"__name__": "readme"})
    assert len([line for line in out.getvalue().splitlines() if line.strip()]) >= 2
