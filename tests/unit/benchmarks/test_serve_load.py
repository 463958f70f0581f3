"""benchmarks/serve_load.py: how many requests each level sends and what each asks for (pure arithmetic, no server)."""
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


def test_a_tree_mode_serves_its_draft_tree_under_its_scheduler():
    from benchmarks.serve_load import serve_config

    args = parse_args(["--interleave", "--tiny", "--tree-max-rows", "3"])
    cfg = serve_config(args, "/d", "dynamic+t4x2", 4, 2, label="dynamic+t4x2")
    assert cfg.engine.scheduler.mode == "dynamic" and cfg.engine.scheduler.draft_gate
    assert cfg.engine.draft_tree == [4, 2] and cfg.engine.tree_max_rows == 3
    assert cfg.deployment.name == "dspark-bench-dynamic-t4x2"
    assert serve_config(args, "/d", "dynamic", 4).engine.draft_tree is None


def test_request_budgets_are_seeded_per_user_and_request_and_the_same_in_every_mode():
    from benchmarks.serve_load import request_budget

    budgets = [request_budget(64, 0.5, u, k) for u in range(8) for k in range(3)]
    assert budgets == [request_budget(64, 0.5, u, k) for u in range(8) for k in range(3)]  # any mode, any run
    assert all(32 <= b <= 96 for b in budgets) and len(set(budgets)) > 5
    assert request_budget(64, 0.0, 3, 1) == 64
