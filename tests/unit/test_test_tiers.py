"""`make test` runs the integration modules named in the Makefile's FAST_INTEGRATION: every module that
holds an integration test not marked slow must be named there, or CI would silently skip it."""
import re
import subprocess
import sys

from tests.paths import REPO


def test_every_fast_integration_module_runs_in_make_test():
    makefile = (REPO / "Makefile").read_text()
    block = re.search(r"^FAST_INTEGRATION := (.*?)\n\n", makefile, re.S | re.M).group(1)
    listed = set(re.findall(r"tests/integration/test_\w+\.py", block))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "integration and not slow", "tests/integration"],
                         cwd=REPO, capture_output=True, text=True, timeout=300).stdout
    fast = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    assert fast, out[-2000:]
    assert fast <= listed, f"add to FAST_INTEGRATION in the Makefile (or mark slow): {sorted(fast - listed)}"
