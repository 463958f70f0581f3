"""benchmarks/decode_speed.py --dtypes: every mode decodes once per target dtype in one run, the speedups
are against the first dtype's target-only and against the fastest target-only."""
import pytest

from benchmarks.decode_speed import main


@pytest.mark.heavy
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


def test_modes_take_turns_and_speedups_carry_paired_intervals():
    from benchmarks.decode_speed import decode_interleaved

    calls = []

    def mode(name):
        def decode(ids, gen):
            calls.append(name)
            return ids
        return decode

    prompts = [("p", [i]) for i in range(4)]
    out = decode_interleaved(prompts, {m: mode(m) for m in "abc"})
    assert calls == list("abc" "bca" "cab" "abc")  # the order rotates prompt by prompt
    assert out == {m: [[0], [1], [2], [3]] for m in "abc"}  # per mode, in prompt order

    report = main(["--target", "tiny", "--quick", "--algo", "dspark", "--algo", "dflash", "--datasets",
                   "gsm8k,humaneval", "--max-new-tokens", "6", "--device", "cpu", "--dtypes", "float32,bfloat16"])
    modes = report["modes"]
    for name, m in modes.items():
        lo, hi = m["speedup_ci95"]
        assert lo <= m["speedup"] <= hi
        if not name.startswith("target"):
            assert m["tau_ci95"][0] <= m["tau"] <= m["tau_ci95"][1]
    assert modes["target"]["speedup_ci95"] == pytest.approx([1.0, 1.0])
    for suffix in ("", "@bfloat16"):  # each drafter is compared with the first drafter of its own dtype
        second = modes["dflash:untrained" + suffix]["vs_first_drafter"]
        assert second["drafter"] == "dspark:untrained" + suffix
        assert second["ci95"][0] <= second["ratio"] <= second["ci95"][1]
        assert "vs_first_drafter" not in modes["dspark:untrained" + suffix]


def test_paired_ratio_interval_is_the_ratio_when_every_prompt_agrees():
    from types import SimpleNamespace as R

    from benchmarks.decode_speed import paired_speed_ratio

    fast = [R(token_ids=[0] * 10, wall_s=1.0), R(token_ids=[0] * 20, wall_s=2.0)]
    slow = [R(token_ids=[0] * 10, wall_s=2.0), R(token_ids=[0] * 20, wall_s=4.0)]
    assert paired_speed_ratio(fast, slow) == pytest.approx([2.0, 2.0])


def test_dtype_suffix_only_takes_a_trailing_dtype():
    from benchmarks.decode_speed import dtype_suffix

    assert dtype_suffix("dspark:x@bfloat16") == "@bfloat16" and dtype_suffix("target") == ""
    assert dtype_suffix("dspark:models:/x@champion") == ""
    assert dtype_suffix("dspark:models:/x@champion@float32") == "@float32"


def test_several_gammas_are_modes_side_by_side():
    report = main(["--target", "tiny", "--quick", "--algo", "dspark", "--datasets", "gsm8k", "--gamma", "1,3"])
    assert set(report["modes"]) == {"target", "dspark:untrained:g1", "dspark:untrained:g3"}
    assert report["gamma"] == [1, 3]
    assert report["modes"]["dspark:untrained:g1"]["mean_verified"] <= 1.0
    assert "vs_first_drafter" in report["modes"]["dspark:untrained:g3"]
    assert main(["--target", "tiny", "--quick", "--algo", "dspark", "--datasets", "gsm8k", "--gamma", "2"])["gamma"] == 2
    with pytest.raises(SystemExit):
        main(["--target", "tiny", "--quick", "--algo", "dspark", "--gamma", "3,0"])


def test_engine_modes_decode_through_the_serving_engine_with_trees():
    """--engine: target-only, the chain and a tree all run through the engine (max_batch 1); the tree's
    rounds verify more nodes than the chain proposes, and every mode emits the asked tokens."""
    report = main(["--target", "tiny", "--quick", "--algo", "dspark", "--datasets", "gsm8k", "--engine",
                   "--gamma", "3", "--tree", "2x2", "--max-new-tokens", "8"])
    assert report["through"] == "engine"
    modes = report["modes"]
    assert set(modes) == {"target", "dspark:untrained", "dspark:untrained:t2x2"}
    assert all(0 < m["tokens"] <= 8 for m in modes.values())
    assert modes["dspark:untrained"]["rounds"] > 0 and modes["dspark:untrained"]["mean_verified"] == pytest.approx(3)
    assert modes["dspark:untrained:t2x2"]["rounds"] > 0
