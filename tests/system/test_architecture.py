"""docs/architecture.md matches the code: the folder import graph, every module named, and the layout's rules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_async_ckpt"
DOC = ROOT / "docs" / "architecture.md"
# Top-level modules count as their own "folder" in the graph.
_FORBIDDEN = {
    "core": ("lightning", "accelerate", "argparse", "matplotlib"),
    "storage": ("lightning", "accelerate", "argparse", "matplotlib"),
}


def _folder(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names imported from it) for every import in ``path``, relative ones resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        here = _folder(path)
        for name, _ in _imports(path):
            parts = name.split(".")
            if parts[0] == "lightning_async_ckpt" and len(parts) > 1 and parts[1] != here:
                graph.setdefault(here, set()).add(parts[1])
    return graph


def _documented_graph() -> dict[str, set[str]]:
    text = DOC.read_text()
    table = text[text.index("<!-- import-graph -->") : text.index("<!-- /import-graph -->")]
    graph = {}
    for line in table.splitlines():
        cells = [c.strip(" `") for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("folder", "") and not cells[0].startswith("-"):
            graph[cells[0].rstrip("/")] = {c.strip(" `/") for c in cells[1].split(",") if c.strip(" `/-–")}
    return graph


def test_the_documented_import_graph_is_the_code_s():
    actual = {k: v for k, v in _graph().items() if v}
    assert _documented_graph() == actual


def test_every_module_is_named_in_the_architecture_page():
    text = DOC.read_text()
    missing = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "__init__.py" and f"`{p.relative_to(PACKAGE)}`" not in text and f"`{p.name}`" not in text
    ]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_core_and_storage_import_no_framework_and_storage_nothing_from_core():
    for folder, forbidden in _FORBIDDEN.items():
        for path in (PACKAGE / folder).rglob("*.py"):
            for name, _ in _imports(path):
                top = name.split(".")[0]
                assert top not in forbidden or (folder == "core" and top == "torch"), f"{path} imports {name}"
                if folder == "storage":
                    assert not name.startswith("lightning_async_ckpt.core"), f"{path} imports {name}"


def test_no_private_name_is_imported_across_packages():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        here = _folder(path)
        for name, names in _imports(path):
            parts = name.split(".")
            if parts[0] != "lightning_async_ckpt" or len(parts) < 2 or parts[1] == here:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [p for p in parts[2:] if re.match(r"_[a-z]", p)]
            if private:
                offenders.append(f"{path.relative_to(PACKAGE)}: {name} {private}")
    assert not offenders
