"""The documentation runs as written.

- Every ```python block of README.md and docs/*.md runs (in a fresh temporary working folder).
- Every ``diffmm ...`` command in them parses: fenced shell lines are parsed by ``diffmm.cli.parse`` (the
  jsonargparse parser built from the commands' signatures; the Lightning subcommands with ``--print_config``, which
  parses the config and every option without building anything); inline ``diffmm ...`` spans, often fragments, may
  omit required arguments but every option they name must exist and take the value they give. The demo
  application's ``python -m diffmm_demo ...`` commands are parsed the same way, with its own command table.
- Every ``python scripts/X.py ...`` command names an existing script and only options that script defines.
- The generated tables in docs/results.md equal ``scripts/results_tables.py``'s output.
- No tracked file outside tests/ names a path of the machine it was made on.

A block is steered by an HTML comment on the line just above its fence (words may be combined):

    <!-- docs-test: skip (reason) -->     not run; the reason is the skip message
    <!-- docs-test: continue -->          runs in the namespace of the file's previous python block
    <!-- docs-test: demo-data -->         runs in a folder holding a toy copy of the demo data (data/...)
    <!-- docs-test: cuda -->              needs a CUDA GPU (skipped without one)
    <!-- docs-test: slow -->              marked slow (deselected by default)

and a shell line (a ``diffmm`` or ``python scripts/X.py`` command) by a trailing ``# docs-test: skip (reason)``
comment, e.g. the command of a removed study script that runs at an older commit.
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import io
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
SHELL_LANGS = ("", "bash", "sh", "shell", "console")


@dataclass
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    tags: set = field(default_factory=set)
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _blocks(doc: str) -> list[Block]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        tags, reason = set(), ""
        mk = MARKER.search(before)
        if mk:
            spec = mk.group(1)
            r = re.search(r"\((.*)\)", spec)
            reason = r.group(1) if r else ""
            tags = set(re.sub(r"\(.*\)", "", spec).replace(",", " ").split())
        out.append(Block(doc, line, m.group(1).lower(), m.group(2), tags, reason))
    return out


ALL_BLOCKS = [b for doc in DOCS for b in _blocks(doc)]
PY_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]


# ---------------------------------------------------------------------------------------- python blocks
def _toy_demo_data(root: str) -> None:
    """A small copy of the demo data layout of docs/data.md (same folder and shard names, random content)."""
    import numpy as np
    from PIL import Image

    from diffmm_demo.datasets import build_python_docs
    from diffmm.data.writer import ShardWriter

    rng = np.random.default_rng(0)
    for style in ("noto", "google", "twitter", "openmoji"):
        with ShardWriter(os.path.join(root, "emoji", style), f"emoji-{style}", maxcount=40) as w:
            for i in range(80):  # 2 shards of 40
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, "PNG")
                meta = {"name": f"emoji {i}", "group_id": i % 3, "subgroup_id": i % 5, "style": style}
                w.write(f"e{i:04d}", {"png": buf.getvalue(), "txt": f"an emoji of thing {i}", "json": json.dumps(meta)})
    with ShardWriter(os.path.join(root, "fashion-mnist", "test"), "fashion-mnist-test", maxcount=4) as w:
        for i in range(20):  # 5 shards of 4
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(buf, "PNG")
            w.write(f"t{i:05d}", {"png": buf.getvalue(), "cls": str(i % 10).encode(), "txt": "a photo of a thing."})
    src = os.path.join(root, "_sources", "library")
    os.makedirs(src)
    words = "python module function class method value list string file object return import error the a of".split()
    wr = random.Random(0)
    for i in range(24):
        text = " ".join(wr.choice(words) for _ in range(800))
        with open(os.path.join(src, f"mod{i}.rst.txt"), "w") as f:
            f.write(f"Module {i}\n========\n\n{text}\n")
    build_python_docs(root, source_dir=os.path.dirname(src), vocab_size=300, val_every=4, maxcount=3, progress=False)
    shutil.rmtree(os.path.dirname(src))


@pytest.fixture(scope="module")
def demo_data_dir(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("docs_demo_data")
    _toy_demo_data(str(work / "data"))
    return str(work)


_NAMESPACES: dict[str, dict] = {}  # doc -> namespace of its last python block (for `continue`)


def _py_param(b: Block):
    marks = []
    if "skip" in b.tags:
        marks.append(pytest.mark.skip(reason=f"{b.id}: {b.reason or 'marked skip'}"))
    if "slow" in b.tags:
        marks.append(pytest.mark.slow)
    if "cuda" in b.tags:
        marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{b.id}: needs a CUDA GPU"))
    return pytest.param(b, id=b.id, marks=marks)


@pytest.mark.parametrize("block", [_py_param(b) for b in PY_BLOCKS])
def test_python_block_runs(block: Block, tmp_path, monkeypatch, request):
    if "demo-data" in block.tags:
        monkeypatch.chdir(request.getfixturevalue("demo_data_dir"))
    else:
        monkeypatch.chdir(tmp_path)
    if "continue" in block.tags:
        if block.doc not in _NAMESPACES:
            pytest.fail(f"{block.id}: 'continue' but the previous python block of {block.doc} did not run")
        ns = _NAMESPACES[block.doc]
    else:
        ns = {"__name__": "__docs__"}
    _NAMESPACES.pop(block.doc, None)
    exec(compile(block.body, block.id, "exec"), ns)  # noqa: S102 - the documentation is the code under test
    _NAMESPACES[block.doc] = ns


# ------------------------------------------------------------------------------------- diffmm commands
@dataclass
class Command:
    where: str
    argv: list
    inline: bool
    skip: str = ""
    app: str = "diffmm"  # or "diffmm_demo": `python -m diffmm_demo ...`


def _strip_comment(line: str) -> tuple[str, str]:
    """(command, trailing comment) of a shell line; '#' inside quotes is kept."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


LAUNCHERS = ("srun", "torchrun", "mpirun", "env", "nice", "time", "sudo", "python", "python3")


def _diffmm_argv(words: list[str]) -> tuple[str, list[str]] | None:
    """``(app, arguments)`` of a command line: the arguments after ``diffmm`` / ``python -m diffmm.cli`` (app
    ``diffmm``) or after ``python -m diffmm_demo`` (app ``diffmm_demo``), else None.

    The line must start with the command (after ``VAR=value`` words) or with a launcher (``srun``, ``torchrun``,
    ``python -m ...``); a ``diffmm`` later in other text (a diagram, a sentence) is not a command.
    """
    while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
        words = words[1:]
    if not words or not (os.path.basename(words[0]) == "diffmm" or os.path.basename(words[0]).startswith(LAUNCHERS)):
        return None
    for i, w in enumerate(words):
        if os.path.basename(w) == "diffmm" and i + 1 < len(words) and re.fullmatch(r"[a-z][\w-]*", words[i + 1]):
            return "diffmm", words[i + 1:]
        if w == "-m" and i + 1 < len(words) and words[i + 1] in ("diffmm.cli", "diffmm_demo"):
            return words[i + 1].removesuffix(".cli"), words[i + 2:]
    return None


def _optional_groups(cmd: str) -> str:
    return re.sub(r"\s\[[^\]]*\]", "", cmd)  # `[--arrangement grouped]`: usage notation for optional arguments


PLACEHOLDER = re.compile(r"^(<[^>]+>|[A-Z]|\.\.\.|.*\|.*)$")  # <task>, X, ..., a|b


def _commands() -> list[Command]:
    out = []
    for doc in DOCS:
        for b in _blocks(doc):
            if b.lang not in SHELL_LANGS:
                continue
            lines = b.body.replace("\\\n", " ").split("\n")
            for k, raw in enumerate(lines):
                cmd, comment = _strip_comment(raw.strip().removeprefix("$ "))
                if not cmd:
                    continue
                try:
                    words = shlex.split(_optional_groups(cmd))
                except ValueError:
                    continue
                found = _diffmm_argv(words)
                if found is None:
                    continue
                skip = "skip" in b.tags and (b.reason or "marked skip")
                m = re.search(r"docs-test:\s*skip\s*\((.*)\)", comment)
                out.append(Command(f"{doc}:{b.line + 1 + k}", found[1], False, m.group(1) if m else skip or "",
                                   found[0]))
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), f.read())
        for m in re.finditer(r"`((?:\.venv/bin/)?(?:diffmm|python -m diffmm_demo) [a-z][^`]*)`", text):
            line = text.count("\n", 0, m.start()) + 1
            try:
                words = shlex.split(_optional_groups(m.group(1)))
            except ValueError:
                continue
            found = _diffmm_argv(words)
            if found is None or re.search(r":(\s|$)", m.group(1)):  # a quoted message (`diffmm eval x: error: ...`)
                continue
            out.append(Command(f"{doc}:{line}", found[1], True, app=found[0]))
    return out


COMMANDS = _commands()


def _parse(argv: list[str], app: str = "diffmm") -> tuple[int, str]:
    """Parse ``diffmm argv`` (or ``python -m diffmm_demo argv``) without running it: (exit status, captured
    output)."""
    from jsonargparse import ArgumentError

    from diffmm.cli import LIGHTNING_SUBCOMMANDS, main, parse
    from diffmm_demo.__main__ import COMMANDS as DEMO_COMMANDS
    from diffmm_demo.__main__ import PROG as DEMO_PROG

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            if app == "diffmm_demo":
                parse(argv, DEMO_COMMANDS, DEMO_PROG)
                rc = 0
            elif argv[0] in LIGHTNING_SUBCOMMANDS:
                rc = main([*argv, "--print_config"])
            else:
                parse(argv)
                rc = 0
        except ArgumentError as e:
            print(e)
            rc = 2
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return int(rc or 0), buf.getvalue()


def _cmd_param(c: Command):
    marks = [pytest.mark.skip(reason=f"{c.where}: {c.skip}")] if c.skip else []
    placeholders = [w for w in c.argv if PLACEHOLDER.match(w)]
    if placeholders:
        marks = [pytest.mark.skip(reason=f"{c.where}: placeholder {placeholders[0]!r}")]
    return pytest.param(c, id=f"{c.where} {c.app} {' '.join(c.argv)[:60]}", marks=marks)


def test_docs_name_diffmm_commands():
    assert len([c for c in COMMANDS if not c.inline]) >= 10, "the command collector found too few commands"
    assert [c for c in COMMANDS if c.app == "diffmm_demo" and not c.inline], "no python -m diffmm_demo command found"


@pytest.mark.parametrize("cmd", [_cmd_param(c) for c in COMMANDS])
def test_diffmm_command_parses(cmd: Command, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/... paths are relative to the repository
    monkeypatch.setattr(sys, "argv", ["diffmm", *cmd.argv])  # LightningCLI compares its args with sys.argv
    rc, out = _parse(cmd.argv, cmd.app)
    if rc != 0 and cmd.inline and ("the following arguments are required" in out or "it was not provided" in out):
        rc = 0  # an inline fragment: named options are checked, omitted required ones are not
    assert rc == 0, f"{cmd.where}: `{cmd.app} {' '.join(cmd.argv)}` does not parse:\n{out[-2000:]}"


# ------------------------------------------------------------------------------------- script commands
def _script_commands() -> list[tuple[str, str, list[str]]]:
    out = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read().replace("\\\n", " ")
        for m in re.finditer(r"python\s+(scripts/[\w./-]+\.py)([^\n`#]*)(#[^\n]*)?", text):
            if m.group(3) and re.search(r"docs-test:\s*skip", m.group(3)):
                continue
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{doc}:{line}", m.group(1), re.findall(r"(?<!\S)(--[\w-]+)", m.group(2))))
    return out


@pytest.mark.parametrize("where,script,options", _script_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_script_command_names_real_options(where, script, options):
    path = os.path.join(ROOT, script)
    assert os.path.isfile(path), f"{where}: {script} does not exist"
    with open(path, encoding="utf-8") as f:
        src = f.read()
    for module in re.findall(r"^(?:from|import) (\w+)", src, re.M):  # options a sibling script defines for it
        sibling = os.path.join(ROOT, "scripts", module + ".py")
        if os.path.isfile(sibling):
            with open(sibling, encoding="utf-8") as f:
                src += f.read()
    missing = [o for o in options if f'"{o}"' not in src and f"'{o}'" not in src]
    assert not missing, f"{where}: {script} defines no option {', '.join(missing)}"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted({s for _, s, _ in _script_commands()}))
def test_script_help_runs(script):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{script} --help failed:\n{r.stderr[-2000:]}"


# ------------------------------------------------------------------------------------------ generated
def test_generated_tables_match_their_results(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    results_tables = importlib.import_module("results_tables")
    stale = results_tables.check(ROOT)
    assert not stale, ("generated sections differ from their committed results (run "
                       "`python scripts/results_tables.py`): " + ", ".join(stale))


# ------------------------------------------------------------------------------------- machine paths
MACHINE_PATH = r"/work/|/tmp/|/root/|/home/"


def test_no_tracked_file_names_a_machine_path():
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(
            os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "grep", "-nIE", MACHINE_PATH, "--", ".", ":!tests"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    assert r.stdout == "", ("tracked files name machine paths (use paths relative to the repository):\n"
                            + r.stdout[:3000])
