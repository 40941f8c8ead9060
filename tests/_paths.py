"""Where the suite's files are, for tests at any depth of ``tests/``."""

from __future__ import annotations

from pathlib import Path

#: the ``tests`` directory (its helpers, ``fixtures``, ``golden``)
TESTS = Path(__file__).resolve().parent
#: the repository's root
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
