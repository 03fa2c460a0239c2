"""The commands in README.md and docs/*.md run as written (issue 31 item 6).

Every command example (a fenced or indented code block's line, or an inline code span, that starts
with `ringserve`, `python -m ringserve.…`, `python3 tools/…` or `make`) is checked: its program
exists and its flags parse (argparse run on them, the command itself not run: most start servers
or benchmarks), a `make` target exists. Blocks marked `<!-- doc-check: run -->` are run as
written against a real server on the default model (its address put in for 127.0.0.1:8000).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:\.venv/bin/)?(?:ringserve |python3? -m ringserve\.|python3? tools/|make )")
RUN_MARK = "<!-- doc-check: run -->"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def _logical_lines(text: str) -> list[str]:
    """Commands: lines with their `\\` continuations joined, and a quoted string that spans
    lines (a JSON flag value) kept whole."""
    out: list[str] = []
    pending = ""
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        pending = f"{pending} {line.strip()}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the next line belongs to it
            continue
        out.append(pending)
        pending = ""
    return out + ([pending] if pending else [])


def examples() -> list[tuple[str, str]]:
    """(file, command) for every command example in the docs."""
    found: dict[tuple[str, str], None] = {}
    for doc in DOCS:
        text = doc.read_text()
        blocks = [m.group(2) for m in FENCE.finditer(text) if m.group(1) in ("sh", "bash", "console")]
        indented = re.findall(r"(?:^ {4}\S.*\n?)+", FENCE.sub("", text), re.M)
        lines = [line.strip() for b in blocks + [re.sub(r"^ {4}", "", i, flags=re.M) for i in indented]
                 for line in _logical_lines(b)]
        spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
        for cmd in lines + spans:
            if COMMAND.match(cmd):
                found[(doc.name, cmd)] = None
    return list(found)


def _argv(cmd: str) -> list[str]:
    """The command's words as a shell would pass them, with a synopsis made concrete: `[--opt X]`
    taken as given, `a|b` as a, `<placeholder>` as x, `...` dropped; cut at a pipe."""
    cmd = re.sub(r"<[^<>]+>", "x", cmd.replace("\\|", "|"))
    cmd = re.sub(r"\[((?:--|-)[^\[\]]*)\]", r"\1", cmd)        # [--flag V] -> --flag V
    cmd = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1).split("|")[0], cmd)  # [NAME|FILE] -> NAME
    words = shlex.split(cmd, comments=True)
    if "|" in words:
        words = words[:words.index("|")]
    out = []
    for w in words:
        if w in ("...", "...same...", "flags"):
            continue
        out.append(w.split("|")[0] if "|" in w and not w.startswith("{") else w)
    if out[0] == "ringserve" and len(out) == 2:  # the command named in prose: it exists
        out.append("--help")
    return out


class _Parsed(Exception):
    pass


def _parses(module: str, argv: list[str], monkeypatch) -> None:
    """Run `python -m module argv` in-process up to its argument parsing, and stop there: a
    bad flag is argparse's SystemExit(2)."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(_Parsed), warnings.catch_warnings():
        # runpy warns that an earlier test imported the module: it runs a fresh copy anyway
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=False)


def _module(argv: list[str]) -> tuple[str, list[str]]:
    """The Python module a command runs and its arguments."""
    head = argv[0].removeprefix(".venv/bin/")
    if head == "ringserve":
        return "ringserve.tools.cli", argv[1:]
    if argv[1] == "-m":
        return argv[2], argv[3:]
    path = argv[1]  # python3 tools/x.py
    return "ringserve." + path.removesuffix(".py").replace("/", "."), argv[2:]


@pytest.mark.parametrize(("doc", "cmd"), examples())
def test_the_command_exists_and_its_flags_parse(doc, cmd, monkeypatch, capsys):
    argv = _argv(cmd)
    if argv[0] == "make":
        target = argv[1]
        assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M), cmd
        return
    module, args = _module(argv)
    assert importlib.util.find_spec(module) is not None, f"{doc}: {cmd}: no module {module}"
    source = Path(importlib.util.find_spec(module).origin or "").read_text()
    if "argparse" not in source and module != "ringserve.tools.cli":
        assert not args, f"{doc}: {cmd}: {module} takes no arguments"
        return  # a process the server starts itself (grammar_compiler): it exists
    try:
        _parses(module, args, monkeypatch)
    except SystemExit as exc:  # argparse refused (or --help, which is fine): show why
        if exc.code == 0:
            return
        pytest.fail(f"{doc}: `{cmd}` does not parse ({exc.code}): {capsys.readouterr().err}")


def runnable() -> list[tuple[str, str, str]]:
    """(file, language, block) of every block marked to run."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if text[:m.start()].rstrip().endswith(RUN_MARK):
                out.append((doc.name, m.group(1), m.group(2)))
    return out


@pytest.fixture(scope="module")
def server(serve, default_model_dir, no_segment_left_behind):
    return serve(default_model_dir, "--workers", "1", "--max-model-len", "1024", timeout=300)


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> Path:
    """A `ringserve` on PATH that runs this checkout (as .venv/bin/ringserve does)."""
    d = tmp_path_factory.mktemp("bin")
    (d / "ringserve").write_text(f'#!/bin/sh\nexec {sys.executable} -m ringserve.tools.cli "$@"\n')
    (d / "ringserve").chmod(0o755)
    return d


def test_blocks_are_marked_to_run():
    assert {(doc, lang) for doc, lang, _ in runnable()} >= {
        ("README.md", "sh"), ("README.md", "python"), ("structured-outputs.md", "python"), ("trace.md", "sh")}


@pytest.mark.parametrize(("doc", "lang", "block"), runnable())
def test_the_marked_blocks_run(doc, lang, block, server, bin_dir):
    code = block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}").replace(
        "localhost:8000", f"localhost:{server.port}")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-eo", "pipefail", "-c", code]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), (doc, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
