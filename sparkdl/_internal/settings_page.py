"""Keep the docs' generated settings table in step with ``TrainConfig``.

The table lives in docs/reference/settings.md, between the settings markers; run from the
repository root (``make settings`` runs the first):

    python -m sparkdl._internal.settings_page            # rewrite the block in ./docs/reference/settings.md
    python -m sparkdl._internal.settings_page --check    # exit 1 when the block is out of date
    python -m sparkdl._internal.settings_page PATH       # the same for another Markdown file with the markers
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparkdl.config import settings_markdown

START = "<!-- settings:start -->"
END = "<!-- settings:end -->"
#: what the page tells a contributor to run (the Makefile runs this module)
REGENERATE = "make settings"
#: the page that holds the settings table, relative to the repository root
SETTINGS_PAGE = Path("docs") / "reference" / "settings.md"


def settings_block() -> str:
    """The text between the markers: a note on its origin, then the generated table."""
    return (f"<!-- generated from TrainConfig in sparkdl/config.py; edit there and run `{REGENERATE}` -->\n"
            f"{settings_markdown()}")


def replace_settings_block(text: str) -> str:
    """``text`` with the part between the settings markers replaced by :func:`settings_block`."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} block found")
    return f"{text[:start + len(START)]}\n{settings_block()}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` only compare) the settings block of a Markdown page."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", type=Path, default=SETTINGS_PAGE, help=f"default: ./{SETTINGS_PAGE}")
    parser.add_argument("--check", action="store_true", help="only report whether the block is up to date")
    args = parser.parse_args(argv)
    text = args.path.read_text(encoding="utf-8")
    updated = replace_settings_block(text)
    if args.check:
        if updated != text:
            print(f"{args.path}: the settings table is out of date; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.path.write_text(updated, encoding="utf-8")
        print(f"{args.path}: settings table updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
