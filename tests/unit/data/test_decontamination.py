"""Word n-gram decontamination of training prompts against evaluation prompts."""
import pytest

from dspark.data.decontamination import Decontaminator, words


def test_shared_ngram_or_contained_short_text_is_contaminated():
    d = Decontaminator(["Janet's ducks lay 16 eggs per day. She eats three for breakfast!"], n=4)
    assert words("Janet's DUCKS, lay") == ["janet", "s", "ducks", "lay"]
    assert d.contaminated("Q: how many -- ducks lay 16 eggs? (per day)")  # 'ducks lay 16 eggs', case/punct aside
    assert not d.contaminated("ducks lay eggs 16 times")  # no shared 4-gram
    assert d.contaminated("eats three")  # shorter than n: contained in an eval prompt
    assert not d.contaminated("eats four") and not d.contaminated("")
    kept, dropped = d.split([{"t": "eats three"}, {"t": "a new question about geese"}], lambda r: r["t"])
    assert [r["t"] for r in kept] == ["a new question about geese"] and len(dropped) == 1
    # an instruction every eval prompt carries is a template, not content
    evals = [q + ". Please reason step by step now" for q in
             ("how many red apples fit in a box", "what is the area of a square garden", "solve x plus one")]
    d = Decontaminator(evals, n=4)
    assert not d.contaminated("count the pears. Please reason step by step now")
    assert d.contaminated("Tell me how many red apples fit in a crate")
    with pytest.raises(ValueError, match="n-gram"):
        Decontaminator([], n=0)
