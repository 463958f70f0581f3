"""benchmarks/draft_block.py: both ways of drawing a block's randomness run side by side, give the same
tokens, and the JSON says how many operators each dispatched."""
from benchmarks import draft_block


def test_both_ways_give_the_same_tokens_and_up_front_dispatches_fewer_ops(tmp_path, capsys):
    out = tmp_path / "draft_block.json"
    result = draft_block.main(["--target", "tiny", "--rows", "1,8", "--reps", "1", "--warmup", "0",
                               "--out", str(out)])
    assert out.exists() and [r["rows"] for r in result["rows"]] == [1, 8]
    for row in result["rows"]:
        assert row["same_tokens"] and set(row["ms_per_pass"]) == {"per_position", "up_front"}
        assert row["per_position_over_up_front"] > 0
    ops = result["rows"][1]["ops_per_pass"]  # 8 requests × 4 positions: no generator call per position
    assert ops["up_front"] < ops["per_position"]
