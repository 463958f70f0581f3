"""benchmarks/engine_thread.py: variants summed over their runs, and the ratios (arithmetic, no model)."""
from benchmarks.engine_thread import parse_args, summarize


def row(mode, pool, tokens, wall, cpu):
    return {"mode": mode, "openmp_pool": pool, "tokens": tokens, "wall_s": wall, "cpu_per_wall": cpu}


def test_variants_sum_tokens_over_wall_and_ratios_compare_like_with_like():
    args = parse_args(["--drafter", "d", "--modes", "off,dynamic"])
    rows = [row("off", "released", 100, 10.0, 2.0), row("off", "kept", 100, 12.5, 1.5),
            row("dynamic", "released", 100, 10.0, 2.0), row("dynamic", "kept", 300, 50.0, 1.5),
            row("off", "released", 300, 30.0, 1.9)]
    report = summarize(args, rows)
    assert report["variants"]["off/released"] == {"tokens_per_s": 10.0, "cpu_per_wall": 1.95, "runs": 2}
    assert report["variants"]["dynamic/kept"]["tokens_per_s"] == 6.0
    assert report["ratios"]["off: released/kept"] == 10.0 / 8.0
    assert report["ratios"]["dynamic/off (released)"] == 1.0
    assert report["ratios"]["dynamic/off (kept)"] == 6.0 / 8.0
