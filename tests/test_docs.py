"""The maps in docs/ name files that exist, and every package has its line."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/architecture.md", "docs/structures.md", "CONTRIBUTING.md", "README.md")
# A path in backquotes: a file with an extension or a folder ending in "/".
PATH = re.compile(r"`((?:raypaged|tests|benchmarks|scripts|protos|deploy|docs|core|engine|executor|worker|model|"
                  r"kernels|text|frontend|serve|config|commands|simulator)/[\w./-]*)`")


def mentioned_paths(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    paths = []
    for match in PATH.finditer(text):
        path = match.group(1)
        if "<" in path or "*" in path:
            continue
        paths.append(path)
    return paths


def test_every_path_the_docs_name_exists():
    missing = [(doc, path) for doc in DOCS for path in mentioned_paths(doc)
               if not (ROOT / path).exists() and not _short_form_exists(path)]
    assert not missing, missing


def _short_form_exists(path: str) -> bool:
    """architecture.md names files inside raypaged/ without the prefix once the package is clear
    (`core/scheduler.py`)."""
    return (ROOT / "raypaged" / path).exists()


def test_every_package_has_its_line_in_structures():
    text = (ROOT / "docs/structures.md").read_text()
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "raypaged").glob("*/__init__.py"))
    missing = [p for p in packages if f"`{p}/`" not in text]
    assert not missing, missing


def test_the_request_path_names_a_file_for_each_layer():
    paths = mentioned_paths("docs/architecture.md")
    for layer in ("frontend", "engine", "core", "executor", "worker", "model", "kernels", "text"):
        assert any(p.startswith(f"raypaged/{layer}/") for p in paths), layer
