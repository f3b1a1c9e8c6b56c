"""House rules a reader relies on: functions short enough to read in one screen, and the
README's map of the tree equal to the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.test_packaging import LAYERS, REPO

# No function longer than this, nested ones counted in, anywhere in the package (the
# serving path: the proxy, the connectors inside the engines, the launcher, first).
LONGEST_FUNCTION = 80
SHORT_FUNCTION_FOLDERS = ("proxy", "backends", "epd_serve")


def long_functions(folder: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} "
                                 f"({length} lines)")
    return found


def test_no_function_is_longer_than_a_screen():
    found = [f for folder in SHORT_FUNCTION_FOLDERS
             for f in long_functions(REPO / folder, LONGEST_FUNCTION)]
    assert found == []


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION - 1))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n")
    assert long_functions(tmp_path, LONGEST_FUNCTION) == []  # 80 lines with its def: allowed
    assert len(long_functions(tmp_path, LONGEST_FUNCTION - 1)) == 1


def readme_map() -> list[str]:
    """The folders the README's "Where things are" block lists under epd_serve/ (and
    backends/, proxy/, which install as epd_serve.backends and epd_serve.proxy), in
    the order it lists them."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^ {4}(?:  )?(\w+)/ ", block, flags=re.M)


def test_the_readme_maps_every_subpackage_bottom_up_as_the_layers_are():
    listed = [name for name in readme_map() if name not in ("epd_serve", "configs", "docs",
                                                            "benchmarks", "tests", "scripts")]
    assert listed == list(LAYERS)


def test_every_module_the_readme_names_exists():
    """The map names modules by their file stem after the folder; a renamed or removed
    module must leave the map too."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    folders = {"backends": REPO / "backends", "proxy": REPO / "proxy"}
    missing = []
    current = None
    for line in block.splitlines():
        match = re.match(r"^ {4}(?:  )?(\w+)/ +(.*)$", line)
        if match:
            current = folders.get(match[1], REPO / "epd_serve" / match[1])
            rest = match[2]
        elif current is not None and line.startswith(" " * 20):
            rest = line
        else:
            current = None if not line.strip() else current
            continue
        for name in re.findall(r"`(\w+(?:\.py|/))`", rest):
            if not (current / name).exists():
                missing.append(f"{current.relative_to(REPO)}/{name}")
    assert missing == []
