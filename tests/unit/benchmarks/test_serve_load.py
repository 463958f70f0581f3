"""benchmarks/serve_load.py: how many requests each level sends (pure arithmetic, no server)."""
from benchmarks.serve_load import parse_args, rounds_at


def test_min_requests_gives_low_concurrency_levels_enough_requests():
    args = parse_args(["--requests-per-user", "2", "--min-requests", "16"])
    assert [rounds_at(args, c) for c in (1, 4, 16, 64)] == [16, 4, 2, 2]
    assert rounds_at(parse_args(["--requests-per-user", "3"]), 1) == 3  # default: no minimum
