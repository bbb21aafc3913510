"""The API reference's examples run as written (docs/api.md is a doctest file): the docs stay true to the code."""

from __future__ import annotations

import doctest
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_api_reference_examples_run_as_written():
    results = doctest.testfile(str(DOCS / "api.md"), module_relative=False, verbose=False, report=True)
    assert results.attempted > 100  # the examples were found
    assert results.failed == 0, f"{results.failed} of docs/api.md's examples failed (printed above)"
