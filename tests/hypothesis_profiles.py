"""Hypothesis settings profiles, loaded by conftest.py before any test module builds its @settings.

- "ci" (the default): derandomized, so every run draws the same examples and a red CI run is red
  again on any machine; no example database (nothing carried between runs); no deadline (the Triton
  interpreter's first call compiles); a failure prints the blob that reproduces it.
- "fuzz" (HYPOTHESIS_PROFILE=fuzz, or --hypothesis-profile=fuzz): new draws each run, or those of
  --hypothesis-seed=N (which ci ignores: derandomize wins), and FUZZ_SCALE times as many of them;
  failures are kept in .hypothesis/ and replayed first. `pytest -m hypothesis` picks the property tests.

A test's own @settings override the profile's values but inherit the rest (derandomize above all)
from the profile loaded when the decorator runs, which is why conftest loads it at import. A test
that sets max_examples for its cost states it through examples(n), so fuzz scales it too.
"""
import os

from hypothesis import settings

FUZZ_SCALE = 5
DEFAULT_EXAMPLES = 100  # hypothesis's own default, which the ci profile keeps

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True, database=None,
                          max_examples=DEFAULT_EXAMPLES)
settings.register_profile("fuzz", derandomize=False, deadline=None, print_blob=True,
                          max_examples=DEFAULT_EXAMPLES * FUZZ_SCALE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


def examples(n: int) -> int:
    """A test's max_examples: n under ci, scaled as the loaded profile scales hypothesis's default."""
    return max(1, n * settings.default.max_examples // DEFAULT_EXAMPLES)
