"""MkDocs hook: pages generated at build time, so they never fall behind the code.

- ``api/<module>.md``: one API page per module of every package (mkdocstrings), listed
  under "API reference" by package; a package's page shows its docstring only.
- ``packages/<folder>.md``: each distribution's README.
- ``cli.md``: the ``<!-- megamoe-help -->`` marker becomes ``megamoe --help`` and every
  command's ``--help``, from the argument parser itself (``megamoe.core.cli.main``, which needs
  no torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "megamoe.core": "core",
    "megamoe.transformers": "core",  # the optional transformers integration (its extra)
    "megamoe.qwen4exp": "qwen4exp",
    "megamoe.glm5next": "glm5next",
}
READMES = {
    "core": "core/README.md",
    "qwen4exp": "qwen4exp/README.md",
    "glm5next": "glm5next/README.md",
    "megamoe": "packages/megamoe/README.md",
}
CLI_MARKER = "<!-- megamoe-help -->"
WIDTH = 96  # help text columns, as a terminal of that width shows it


def modules(package: str) -> list[str]:
    """Dotted names of ``package`` and its modules, the package first, then sorted."""
    return sorted(_sources(package), key=lambda name: (name != package, name))


def _sources(package: str) -> dict[str, bool]:
    """Each dotted module name of ``package`` -> whether it is a package (an ``__init__``)."""
    src = ROOT / PACKAGES[package] / "src"
    found = {}
    for path in sorted((src / package.replace(".", "/")).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = is_package
    return found


def _api_page(module: str, package: str) -> str:
    # A package's page is its docstring (what it holds, how data flows); its modules have
    # their own pages.
    options = "    options:\n      members: false\n" if _sources(package)[module] else ""
    return f"# `{module}`\n\n::: {module}\n{options}"


def _nav(package: str) -> list[Any]:
    """The package's pages, a sub-package's modules grouped under it (its page first)."""
    sources = _sources(package)
    entries: list[Any] = []
    for module in modules(package):
        rel = module.removeprefix(f"{package}.")
        page = f"api/{module}.md"
        if module == package:
            entries.append({"(package)": page})
        elif sources[module]:
            members = [m for m in modules(package) if m.startswith(f"{module}.")]
            group = [{"(package)": page}, *({m.rsplit(".", 1)[1]: f"api/{m}.md"} for m in members)]
            entries.append({f"{rel}/": group})
        elif "." not in rel:
            entries.append({rel: page})
    return entries


def on_config(config: Any) -> Any:
    """Add the package and API pages to the navigation."""
    nav = config["nav"]
    nav.append({"Packages": [{name: f"packages/{name}.md"} for name in READMES]})
    nav.append({"API reference": [{package: _nav(package)} for package in PACKAGES]})
    return config


def on_files(files: Files, config: Any) -> Files:
    """Generate the API and package pages."""
    for package in PACKAGES:
        for module in modules(package):
            files.append(
                File.generated(config, f"api/{module}.md", content=_api_page(module, package))
            )
    for name, readme in READMES.items():
        text = (ROOT / readme).read_text()
        source = f"\n\n*From `{readme}` in the repository.*\n"
        files.append(File.generated(config, f"packages/{name}.md", content=text + source))
    return files


def _help_texts() -> str:
    sys.path.insert(0, str(ROOT / "core" / "src"))
    from megamoe.core.cli.main import build_parser

    parser = build_parser()
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    sections = [("megamoe --help", parser.format_help())]
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                sub.formatter_class = parser.formatter_class
                sections.append((f"megamoe {name} --help", sub.format_help()))
    return "\n".join(f"## `{title}`\n\n```text\n{text.rstrip()}\n```\n" for title, text in sections)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Fill the CLI reference from the parser."""
    if CLI_MARKER in markdown:
        return markdown.replace(CLI_MARKER, _help_texts())
    return markdown
