"""The fault-injectable reference engine (the suite's proving ground)."""

VERSION = "kvref-1.0"
