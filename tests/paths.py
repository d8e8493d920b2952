"""Where the checkout's parts are, for tests at any depth under tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
