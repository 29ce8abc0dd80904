"""The documentation's code blocks (Markdown fences), as tests/docs checks them: each with its page, line,
language and text, and the reason a ``<!-- not run: why -->`` comment before it gives."""
import os
import re
from typing import List, NamedTuple

from helpers import ROOT

DOCS = os.path.join(ROOT, "docs")


class Block(NamedTuple):
    page: str
    line: int
    language: str
    text: str
    not_run: str  # the reason given in <!-- not run: ... -->, or ""

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def guide_pages() -> List[str]:
    pages = []
    for folder, _, files in os.walk(DOCS):
        if "_build" in folder:
            continue
        pages += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".md")]
    return sorted(pages)


def code_blocks(path: str) -> List[Block]:
    text = open(path, encoding="utf-8").read()
    page = os.path.relpath(path, ROOT)
    blocks = []
    fences = r"^(?:<!-- not run: (.+?) -->\n)?```(\{[\w-]+\}[^\n]*|\w*)\n(.*?)^```\s*$"
    for match in re.finditer(fences, text, re.M | re.S):
        if match.group(2).startswith("{"):  # a MyST directive ({toctree}, {eval-rst}), not code
            continue
        line = text.count("\n", 0, match.start(2)) + 1
        blocks.append(Block(page, line, match.group(2), match.group(3), match.group(1) or ""))
    return blocks
