"""benchmarks/serve_load.py: how many requests each level sends (pure arithmetic, no server)."""
from benchmarks.serve_load import parse_args, rounds_at


def test_min_requests_gives_low_concurrency_levels_enough_requests():
    args = parse_args(["--requests-per-user", "2", "--min-requests", "16"])
    assert [rounds_at(args, c) for c in (1, 4, 16, 64)] == [16, 4, 2, 2]
    assert rounds_at(parse_args(["--requests-per-user", "3"]), 1) == 3  # default: no minimum


def test_each_dtype_gets_its_own_app_with_that_model_dtype():
    from benchmarks.serve_load import serve_config

    args = parse_args(["--dtypes", "float32,bfloat16", "--interleave", "--tiny"])
    cfg = serve_config(args, "/some/drafter", "dynamic", 4, 4, "bfloat16", "dynamic-bfloat16")
    assert cfg.model.dtype == "bfloat16" and cfg.deployment.name == "dspark-bench-dynamic-bfloat16"
    assert serve_config(args, "/d", "off", 4).model.dtype == "float32"  # one dtype: the plain app name
