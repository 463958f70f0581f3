"""benchmarks/decode_speed.py --dtypes: every mode decodes once per target dtype in one run, the speedups
are against the first dtype's target-only and against the fastest target-only."""
import pytest

from benchmarks.decode_speed import main


def test_modes_per_dtype_and_both_speedups():
    report = main(["--target", "tiny", "--quick", "--algo", "dspark", "--datasets", "gsm8k",
                   "--dtypes", "float32,bfloat16", "--max-new-tokens", "6", "--device", "cpu"])
    modes = report["modes"]
    assert set(modes) == {"target", "dspark:untrained", "target@bfloat16", "dspark:untrained@bfloat16"}
    assert report["dtypes"] == ["float32", "bfloat16"] and modes["target"]["speedup"] == pytest.approx(1.0)
    fastest = max(modes["target"]["tokens_per_s"], modes["target@bfloat16"]["tokens_per_s"])
    for m in modes.values():
        assert m["tokens"] > 0 and m["speedup_vs_fastest_target"] == pytest.approx(m["tokens_per_s"] / fastest)


def test_unknown_dtype_is_refused():
    with pytest.raises(SystemExit, match="float16"):
        main(["--target", "tiny", "--quick", "--algo", "dspark", "--dtypes", "float16"])


def test_drafters_are_named_by_what_tells_them_apart():
    from benchmarks.decode_speed import distinct_names

    assert distinct_names(["results/drafter-cpu-p24", "runs/x"]) == ["drafter-cpu-p24", "x"]
    two = ["runs/e01-L1/dspark/drafter", "runs/e01-L2/dspark/drafter"]
    named = ["e01-L1/dspark/drafter", "e01-L2/dspark/drafter"]
    assert distinct_names(two) == named
    assert distinct_names(["results/drafter-cpu-p24", *two]) == ["drafter-cpu-p24", *named]
