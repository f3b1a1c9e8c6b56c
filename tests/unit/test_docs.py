"""The README and docs/*.md say only what is true of the repository: every epd-serve
command they show parses with the real command line, every path and relative link they
give exists, every deployment-file key the reference documents is one the file model
accepts (and every key it accepts is documented), and the README stays a short front
page. Each check is also shown failing on a made-up case, so none passes by seeing
nothing."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt
from pydantic import BaseModel, ValidationError

from epd_serve.cli.main import build_parser
from epd_serve.deployment.schema import Deployment
from tests.unit.test_packaging import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
KEY_REFERENCE = REPO / "docs" / "deployments.md"
CODE_MAP = REPO / "docs" / "code-map.md"
README_MAX_LINES = 150  # the front page; reference material lives in docs/
SETUP_COMMANDS = ("bash scripts/demo.sh", "bash scripts/test.sh")

# Words that run the command after them (`scripts/in-netns.sh epd-serve up ...`).
WRAPPERS = {"in-netns.sh", "sudo", "exec"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", ">&", "2>", "(", ")"}
# <name>, <this repository>: the reader fills them in (`<` then a letter: no redirection)
PLACEHOLDER = re.compile(r"<[A-Za-z][^<>\n]*>")
# Log lines the pages quote that start with the program's name but are no command.
LOG_LINES = ("epd-serve AMX tile permission", "epd-serve queue readers nap")
# Paths into the repository, as the pages name them (folder-relative module names are
# the code map's, checked below).
REPO_PATH = re.compile(
    r"(?<![\w./:-])((?:scripts|benchmarks|configs|docs|epd_serve|backends|proxy|tests)"
    r"/[\w.*+/@-]*[\w*/])")


@dataclass(frozen=True)
class Snippet:
    """Text from a page, with where it starts, for messages that point at the line."""

    page: Path
    line: int
    text: str
    info: str = ""

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def tokens_of(page: Path) -> list:
    return MarkdownIt().enable("table").parse(page.read_text())


def code_blocks(page: Path) -> list[Snippet]:
    """Fenced and indented code blocks; a fence's text starts the line after its fence."""
    blocks = []
    for token in tokens_of(page):
        if token.type == "fence":
            blocks.append(Snippet(page, token.map[0] + 2, token.content, token.info.strip()))
        elif token.type == "code_block":
            blocks.append(Snippet(page, token.map[0] + 1, token.content))
    return blocks


def inline_children(page: Path, kind: str) -> list[tuple[Snippet, object]]:
    """Every inline element of a kind (code_inline, link_open), with its paragraph's line."""
    found = []
    for token in tokens_of(page):
        for child in (token.children or []) if token.type == "inline" else []:
            if child.type == kind:
                found.append((Snippet(page, token.map[0] + 1, child.content), child))
    return found


# --- 1. commands -------------------------------------------------------------------


def shell_commands(text: str) -> list[tuple[int, list[str]]]:
    """The simple commands of a shell snippet, each with the offset of the line it starts
    on: continued lines joined, comments dropped, split at pipes, redirections and `&&`;
    a quoted argument may span lines."""
    commands, pending, start = [], "", 0
    for offset, line in enumerate(PLACEHOLDER.sub("x", text).splitlines()):
        start = offset if not pending else start
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # no closing quotation yet: the argument goes on
            pending += "\n"
            continue
        pending, current = "", []
        for word in words + [";"]:
            if word in SHELL_OPERATORS or re.fullmatch(r"\d?[<>]&?\d?", word):
                if current:
                    commands.append((start, current))
                current = []
            else:
                current.append(word)
    return commands


def epd_serve_argv(command: list[str]) -> list[str] | None:
    """The arguments after `epd-serve` when it is the program the command runs (behind
    env assignments and wrappers such as scripts/in-netns.sh), doc placeholders filled."""
    words = list(command)
    while words and (ENV_ASSIGNMENT.match(words[0]) or Path(words[0]).name in WRAPPERS):
        words.pop(0)
    if not words or Path(words[0]).name != "epd-serve":
        return None
    argv = []
    for word in words[1:]:
        if word in ("...", "[", "]"):
            continue
        word = word.removeprefix("[").removesuffix("]")  # [--json]: optional, shown
        argv.append(word)
    return argv


def command_error(argv: list[str]) -> str | None:
    """What the real parser says about argv, or None when it parses."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code not in (0, None):  # 0: --help, which parses
            return stderr.getvalue().strip().splitlines()[-1]
    return None


def shown_commands() -> list[tuple[Snippet, list[str]]]:
    shown = []
    for page in PAGES:
        for block in code_blocks(page):
            if block.info not in ("", "sh", "bash", "shell", "console"):
                continue
            for offset, command in shell_commands(block.text):
                argv = epd_serve_argv(command)
                if argv is not None:
                    shown.append((Snippet(page, block.line + offset, block.text), argv))
    return shown


def subcommand_error(words: list[str]) -> str | None:
    """Whether `epd-serve WORDS...` names a command (and a sub-command where the command
    has them) that exists; the rest of a command mentioned in prose is not parsed."""
    parser = build_parser()
    for word in words[:2]:
        choices = next((a.choices for a in parser._actions  # argparse keeps them here
                        if isinstance(a, argparse._SubParsersAction)), None)
        if choices is None or word.startswith("-"):
            return None
        if word not in choices:
            return f"no command {word!r} (known: {', '.join(choices)})"
        parser = choices[word]
    return None


def mentioned_commands() -> list[tuple[Snippet, list[str]]]:
    mentioned = []
    for page in PAGES:
        for snippet, _ in inline_children(page, "code_inline"):
            match = re.match(r"^(?:\S*/)?epd-serve(?:\s+(.*))?$", snippet.text)
            if match and not snippet.text.startswith(LOG_LINES):
                mentioned.append((snippet, (match[1] or "").split()))
    return mentioned


def test_every_command_shown_parses_with_the_real_cli():
    shown = shown_commands()
    assert len(shown) > 20, "the pages show epd-serve commands; none were found"
    failures = [f"{block.where()}: epd-serve {shlex.join(argv)}: {error}"
                for block, argv in shown if (error := command_error(argv))]
    assert failures == []


def test_every_command_mentioned_in_prose_exists():
    mentioned = mentioned_commands()
    assert len(mentioned) > 10
    failures = [f"{snippet.where()}: `{snippet.text}`: {error}"
                for snippet, words in mentioned if (error := subcommand_error(words))]
    assert failures == []


def test_the_command_checks_can_fail():
    block = ("scripts/in-netns.sh .venv/bin/epd-serve doctor configs/cpu/e-p-d.yaml [--json]\n"
             "FOO=1 .venv/bin/epd-serve bench run --url http://x --model m \\\n"
             "    --rate 1  # a comment\n"
             "git clone <repo> epd-serve && cd epd-serve\n"
             "epd-serve up configs/cpu/e-p-d.yaml > up.log 2>&1 &\n")
    shown = [(offset, argv) for offset, command in shell_commands(block)
             if (argv := epd_serve_argv(command)) is not None]
    assert shown == [(0, ["doctor", "configs/cpu/e-p-d.yaml", "--json"]),
                     (1, ["bench", "run", "--url", "http://x", "--model", "m", "--rate", "1"]),
                     (4, ["up", "configs/cpu/e-p-d.yaml"])]
    assert all(command_error(argv) is None for _, argv in shown)
    assert "frobnicate" in command_error(["frobnicate"])
    assert command_error(["bench", "run", "--rate", "1"]) is not None  # --url is required
    assert subcommand_error(["bench", "sweep"]) is None
    assert subcommand_error(["frobnicate"]) is not None
    assert subcommand_error(["model", "huge"]) is not None


# --- 2. paths ------------------------------------------------------------------------


def missing_paths(text: str) -> list[str]:
    """Repository paths in text that do not exist; a glob must match something."""
    missing = []
    for path in REPO_PATH.findall(text):
        exists = any(REPO.glob(path.rstrip("/"))) if "*" in path else (REPO / path).exists()
        if not exists:
            missing.append(path)
    return missing


def map_modules(text: str) -> list[str]:
    """The code map's module names (`notation.py` under `topology/`), as repository paths:
    a folder line at 4 or 6 spaces, continued at 20."""
    roots = {"backends": "backends", "proxy": "proxy", "configs": "configs", "docs": "docs",
             "benchmarks": "benchmarks", "tests": "tests", "scripts": "scripts"}
    paths, folder = [], None
    for line in text.splitlines():
        match = re.match(r"^ {4}(?:  )?(\w+)/ +(.*)$", line)
        if match:
            folder, rest = roots.get(match[1], f"epd_serve/{match[1]}"), match[2]
        elif folder and line.startswith(" " * 20):
            rest = line
        else:
            continue
        paths += [f"{folder}/{name}" for name in re.findall(r"`(\w[\w.-]*(?:\.\w+|/))`", rest)]
    return paths


def test_every_repository_path_named_exists():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for lineno, line in enumerate(text.splitlines(), 1):
            missing += [f"{page.relative_to(REPO)}:{lineno}: {p}" for p in missing_paths(line)]
    for page in (README, CODE_MAP):
        missing += [f"{page.relative_to(REPO)} map: {path}" for path in
                    map_modules(page.read_text()) if not (REPO / path).exists()]
    assert missing == []


def test_the_path_checks_can_fail():
    assert missing_paths("run `scripts/demo.sh` then scripts/nope.sh") == ["scripts/nope.sh"]
    assert missing_paths("see epd_serve/runtime/preflight_*.py and configs/<platform>/") == []
    assert missing_paths("epd_serve/runtime/nothing_*.py") == ["epd_serve/runtime/nothing_*.py"]
    assert missing_paths("http://example.org/docs/x.md, .epd/docs/y.md") == []
    block = ("    epd_serve/\n      topology/     `notation.py`, `gone.py`\n"
             "                    `placement.py`\n    backends/       `hal.py`\n")
    assert map_modules(block) == ["epd_serve/topology/notation.py", "epd_serve/topology/gone.py",
                                  "epd_serve/topology/placement.py", "backends/hal.py"]


# --- 3. links ------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped,
    each space a `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    tokens = tokens_of(page)
    for opening, inline in itertools.pairwise(tokens):
        if opening.type != "heading_open":
            continue
        text = "".join(c.content for c in inline.children if c.type in ("text", "code_inline"))
        slug, n = github_slug(text), 0
        while (slug if n == 0 else f"{slug}-{n}") in found:
            n += 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def link_error(page: Path, href: str) -> str | None:
    """Why a relative link from page does not resolve, or None; web links are not
    followed."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", href):
        return None
    path, _, anchor = href.partition("#")
    target = (page.parent / path).resolve() if path else page
    if not target.exists():
        return f"{href}: no file {path}"
    if anchor and (target.suffix != ".md" or anchor not in anchors(target)):
        return f"{href}: no heading #{anchor} in {target.name}"
    return None


def test_every_relative_link_resolves():
    links = [(snippet, child.attrs["href"]) for page in PAGES
             for snippet, child in inline_children(page, "link_open")]
    assert len(links) > 20
    failures = [f"{snippet.where()}: {error}" for snippet, href in links
                if (error := link_error(snippet.page, href))]
    assert failures == []


def test_the_link_checks_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## KV hand-off (prefill -> decode)\n\n## Roles that move (`~`)\n"
                    "\n## Notes\n\n## Notes\n")
    assert anchors(page) == {"a-page", "kv-hand-off-prefill---decode", "roles-that-move-",
                             "notes", "notes-1"}
    assert link_error(page, "page.md#kv-hand-off-prefill---decode") is None
    assert link_error(page, "#notes-1") is None
    assert link_error(page, "https://example.org/nowhere") is None
    assert "no file" in link_error(page, "missing.md")
    assert "no heading" in link_error(page, "page.md#no-such-heading")


# --- 4. deployment-file keys ---------------------------------------------------------


def models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field holds: itself, or inside Optional, unions, lists and
    dict values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def schema_keys(model: type[BaseModel] = Deployment, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        for inner in models_in(field.annotation):
            keys |= schema_keys(inner, f"{prefix}{name}.")
    return keys


def key_error(dotted: str) -> str | None:
    """Why a dotted key (`mm_store.capacity`) is not one of the file model's, or None."""
    models: list[type[BaseModel]] = [Deployment]
    for depth, part in enumerate(dotted.split(".")):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            where = ".".join(dotted.split(".")[:depth]) or "the top level"
            return f"{dotted}: no key {part!r} in {where}"
        models = [m for field in fields for m in models_in(field.annotation)]
    return None


def documented_keys(page: Path = KEY_REFERENCE) -> list[tuple[int, str]]:
    """The keys the reference's tables list: a row whose first cell is a key in backticks."""
    return [(lineno, match[1]) for lineno, line in enumerate(page.read_text().splitlines(), 1)
            if (match := re.match(r"^\| `([\w.]+)` \|", line))]


def test_every_documented_key_is_in_the_schema_and_every_key_is_documented():
    documented = documented_keys()
    failures = [f"docs/deployments.md:{lineno}: {error}"
                for lineno, key in documented if (error := key_error(key))]
    assert failures == []
    names = {key for _, key in documented}
    assert set(Deployment.model_fields) - names == set(), "top-level keys not documented"
    assert schema_keys() - names == set(), "keys of the file model the reference leaves out"


def test_the_key_checks_can_fail():
    assert key_error("mm_store.capacity") is None
    assert key_error("proxy.routing.video_chunk_frames") is None
    assert key_error("supervision.rapid_restarts") is None
    assert key_error("cluster.nodes.stages") is None  # Optional model, then a list of models
    assert "'nope'" in key_error("mm_store.nope")
    assert "'capacity'" in key_error("name.capacity")
    assert "mm_store.capacity" in schema_keys()
    assert documented_keys(README) == []


def yaml_deployments() -> list[Snippet]:
    return [block for page in PAGES for block in code_blocks(page)
            if block.info == "yaml" and isinstance(data := yaml.safe_load(block.text), dict)
            and "deployment" in data]


def test_every_deployment_shown_in_yaml_validates():
    blocks = yaml_deployments()
    assert blocks, "docs/deployments.md shows a whole deployment file"
    failures = []
    for block in blocks:
        try:
            Deployment.model_validate(yaml.safe_load(block.text))
        except ValidationError as err:
            failures.append(f"{block.where()}: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}")
    assert failures == []


# --- 5. the README -------------------------------------------------------------------


def readme_problems(text: str) -> list[str]:
    problems = [f"missing `{command}`" for command in SETUP_COMMANDS if command not in text]
    lines = len(text.splitlines())
    if lines >= README_MAX_LINES:
        problems.append(f"{lines} lines; the README stays under {README_MAX_LINES}")
    return problems


def test_the_readme_is_a_short_front_page_with_the_two_set_up_commands():
    assert readme_problems(README.read_text()) == []


def test_the_readme_checks_can_fail():
    assert readme_problems("\n".join(SETUP_COMMANDS)) == []
    assert len(readme_problems("bash scripts/demo.sh\n" * README_MAX_LINES)) == 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_opens_with_a_title_and_a_summary(page):
    """Someone who lands on a page reads in its first paragraph what it answers."""
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2].strip(), page.name
