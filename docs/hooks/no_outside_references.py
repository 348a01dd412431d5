"""MkDocs hook: the site refers to nothing outside the repository and loads nothing remote.

Some docstrings still cite sections of a design document that is not in the repository
("(SPEC §3.2)"); the API pages leave those citations out. Every built page is checked for
scripts, stylesheets or images from another host (the site must work offline).
"""

from __future__ import annotations

import re
from typing import Any

from mkdocs.exceptions import PluginError

OUTSIDE_CITATION = re.compile(r"\s*\(SPEC §[^)]*\)")
REMOTE_ASSET = re.compile(r"""<(?:script|img|link)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Drop citations of documents outside the repository."""
    return OUTSIDE_CITATION.sub("", html)


def on_post_page(output: str, page: Any, config: Any) -> str:
    """Refuse a page that loads a remote asset.

    Raises:
        PluginError: naming the page and the tag.
    """
    found = REMOTE_ASSET.search(output)
    if found:
        raise PluginError(f"{page.file.src_uri}: loads a remote asset ({found.group(0)}...)")
    return output
