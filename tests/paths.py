"""Where tests find the repository and their fixtures, wherever the test module sits."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
