"""Implementation choices per batch size (graphc/choices.py): the grammar, its refusals, and
how a choice resolves for an op against its kind's entry and the default."""

import pytest

from graphc.choices import Choices, Term, parse_choice, parse_spans
from graphc.errors import GraphcError


class FakeOp:
    def __init__(self, name, kind):
        self.name, self.kind = name, kind


def test_spans_parse_in_order_and_apart():
    assert parse_spans("1-96+192+224") == ((1, 96), (192, 192), (224, 224))
    assert parse_spans("7") == ((7, 7),)
    for bad in ("", "0-8", "8-1", "1-8+8", "1-8+9", "1-", "-4", "a", "1-8+", "1--8", "\uff11-8"):
        with pytest.raises(ValueError):
            parse_spans(bad)


def test_a_value_is_a_name_or_terms_with_an_optional_bare_name_last():
    assert parse_choice("linear", "cublas") == (Term("cublas"),)
    assert parse_choice("linear", "cute@1-160+192,cublas") == (Term("cute", ((1, 160), (192, 192))),
                                                               Term("cublas"))
    assert str(Term("cute", ((1, 160), (192, 192)))) == "cute@1-160+192"
    with pytest.raises(GraphcError, match=r"implementations\['linear'\] = 'cublas,cute@1-8': only the "
                                          r"last term may be a bare name"):
        parse_choice("linear", "cublas,cute@1-8")
    with pytest.raises(GraphcError, match=r"implementations\['L03.attn.qkv'\] = '@1-8': an implementation "
                                          r"name is missing.*e\.g\. 'cute@1-160\+192,cublas'"):
        parse_choice("L03.attn.qkv", "@1-8")
    with pytest.raises(GraphcError, match="'1-' is not N or N-M"):
        parse_choice("linear", "cute@1-")


def test_terms_of_one_choice_may_not_overlap():
    with pytest.raises(GraphcError, match=r"implementations\['linear'\] = 'cute@1-8,cublas@1-8': 'cublas@1-8' "
                                          r"covers sizes 'cute@1-8' already takes"):
        parse_choice("linear", "cute@1-8,cublas@1-8")
    with pytest.raises(GraphcError, match="'cublas@64-200' covers sizes 'cute@1-16\\+128' already takes"):
        parse_choice("linear", "cute@1-16+128,cublas@64-200")
    assert len(parse_choice("linear", "cute@1-16+128,cublas@17-127+129,torch")) == 3


def test_idle_names_the_terms_that_cover_no_built_size():
    choices = Choices({"linear": "cute@16+300,cublas", "L*.attn.qkv": "cute@1-4"})
    assert choices.idle([1, 8]) == ["linear=cute@16+300"]
    assert choices.idle([1, 16]) == []
    assert Choices({"linear": "cublas"}).idle([1]) == []


def test_the_node_entry_then_the_kind_entry_then_the_default_decide():
    qkv, down = FakeOp("L03.attn.qkv", "linear"), FakeOp("L03.mlp.down", "linear")
    choices = Choices({"L03.attn.qkv": "cute@1-192", "linear": "cute@1-8,cublas"})
    assert [choices.for_op(qkv, b) for b in (1, 192, 193)] == ["cute", "cute", "cublas"]
    assert [choices.for_op(down, b) for b in (8, 9)] == ["cute", "cublas"]
    assert choices.everywhere(qkv) and choices.everywhere(down)
    # No kind entry: a size no term covers is left to the default (None), as is "no size".
    only_node = Choices({"L03.attn.qkv": "cute@1-192"})
    assert only_node.for_op(qkv, 200) is None and only_node.for_op(qkv, None) is None
    assert only_node.for_op(down, 1) is None
    assert not only_node.everywhere(qkv)
    assert only_node.names_for(qkv) == ["cute"] and only_node.names_for(down) == []
    assert not Choices(None) and Choices({"linear": "cublas"})


def test_a_pattern_reaches_every_node_it_matches_after_the_nodes_own_entry():
    qkv3, qkv4, down = FakeOp("L03.attn.qkv", "linear"), FakeOp("L04.attn.qkv", "linear"), FakeOp("L03.mlp.down", "linear")
    choices = Choices({"L*.attn.qkv": "cute@1-192", "L04.attn.qkv": "cublas@100-200", "linear": "cublas"})
    assert [choices.for_op(qkv3, b) for b in (150, 193)] == ["cute", "cublas"]
    assert [choices.for_op(qkv4, b) for b in (99, 150, 201)] == ["cute", "cublas", "cublas"]
    assert choices.for_op(down, 1) == "cublas"
    assert Choices({"L*.attn.qkv": "cute"}).for_op(down, 1) is None
    nodes = ["L03.attn.qkv", "L04.attn.qkv", "L03.mlp.down"]
    assert Choices({"L*.attn.qkv": "cute", "L*.attn.qkvx": "cute", "linear": "cute", "conv": "x"}).unmatched(
        nodes, {"linear"}) == ["L*.attn.qkvx", "conv"]
