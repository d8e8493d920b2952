"""Bugs that shipped: the release-history corpus (`defects.toml`) and its runner.

Each entry names a real bug of an engine, the last release that had it and the first that fixed
it, and the check and measure that must fail on the first and hold on the second. `kvconform
history` builds both releases' environments and runs the check on each (`corpus.py` reads the
corpus, `runner.py` runs and judges it, `table.py` writes docs/history.md).
"""
