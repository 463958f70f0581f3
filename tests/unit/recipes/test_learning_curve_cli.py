"""The learning-curve command line refuses flag combinations that would be silently ignored."""
import pytest


def test_refresh_vocab_without_a_drafter_to_move_is_refused(capsys):
    from recipes.learning_curve import parse_args

    with pytest.raises(SystemExit):
        parse_args(["epochs", "--epochs", "1", "--refresh-vocab"])
    assert "needs --init-from" in capsys.readouterr().err
    assert parse_args(["epochs", "--epochs", "1", "--init-from", "e01", "--refresh-vocab"]).refresh_vocab
