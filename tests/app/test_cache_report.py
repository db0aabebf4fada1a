"""The tenant cache report's core (app/diagnostics/cache_report.py) and RecentPrompts'
bounds, on token ids with a stub tokenizer: exact offsets, the finding, and when there is none."""

from __future__ import annotations

import pytest

from app.diagnostics.cache import RecentPrompt, RecentPrompts, Segment, first_difference_index
from app.diagnostics.cache_report import build_report
from app.errors import APIError


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)


HEADER = [1, 2, 3, 4]  # shared opening (4 tokens)
STATIC = list(range(100, 140))  # 40 static tokens
SEGMENTS = [Segment(0, "system", 0, "system"), Segment(60, "message", 1, "user")]


def dynamic_first(n: int) -> list[int]:
    return [*HEADER, 500 + n, 600 + n, 700 + n, *STATIC, 9, 9]


def test_per_request_content_before_static_content_is_found() -> None:
    prompts = [dynamic_first(n) for n in range(6)]
    report = build_report(prompts, SEGMENTS, StubTokenizer(), block_size=4)
    assert report["divergence_offsets"] == [{"from_token": 4, "to_token": 7, "prompts": 5}]
    (finding,) = report["findings"]
    assert (finding["from_token"], finding["to_token"]) == (4, 6)
    assert finding["segment"] == {"kind": "system", "message_index": 0, "role": "system"}
    assert finding["message"] == (
        "the system prompt carries per-request content at tokens 4-6 "
        "(e.g. 't505 t605 t705'); move it after the static part"
    )


def test_static_content_first_has_no_finding() -> None:
    prompts = [[*HEADER, *STATIC, 500 + n, 600 + n] for n in range(6)]
    report = build_report(prompts, SEGMENTS, StubTokenizer(), block_size=4)
    assert report["divergence_offsets"] == [{"from_token": 44, "to_token": 47, "prompts": 5}]
    assert report["findings"] == []  # they never agree again after the divergence


def test_too_few_prompts_have_no_finding() -> None:
    prompts = [dynamic_first(n) for n in range(3)]
    assert build_report(prompts, SEGMENTS, StubTokenizer(), block_size=4)["findings"] == []


def test_recent_prompts_are_bounded_per_tenant_and_in_tenants() -> None:
    recent = RecentPrompts(num_per_tenant=2, num_tenants=2)
    a, b, c = ("a", None), ("b", None), ("c", None)
    for i in range(3):
        recent.remember(a, f"id{i}", RecentPrompt([i]))
    assert [p.token_ids for p in recent.prompts_of(a)] == [[1], [2]]
    recent.remember(b, "x", RecentPrompt([7]))
    recent.remember(c, "y", RecentPrompt([8]))
    assert recent.prompts_of(a) == []  # least recently used tenant dropped
    with pytest.raises(APIError) as refused:
        recent.lookup(c, "x")  # b's id, asked by c: the same 404 as an unknown id
    assert refused.value.status_code == 404


def test_a_tenants_salts_share_its_bound_and_never_push_out_another_tenant() -> None:
    recent = RecentPrompts(num_per_tenant=2, num_tenants=2)
    recent.remember(("b", None), "b0", RecentPrompt([9]))
    for salt in range(65):  # a's salts: a flood of scopes, one tenant
        recent.remember(("a", str(salt)), f"a{salt}", RecentPrompt([salt]))
    assert [p.token_ids for p in recent.prompts_of(("b", None))] == [[9]]
    assert [p.token_ids for p in recent.prompts_of(("a", "64"))] == [[64]]
    assert recent.lookup(("a", "63"), "a63") == [63]
    with pytest.raises(APIError):
        recent.lookup(("a", "64"), "a63")  # another salt's id: unknown here


def test_recent_prompts_off_keeps_nothing() -> None:
    recent = RecentPrompts(num_per_tenant=0)
    recent.remember(("a", None), "id", RecentPrompt([1]))
    assert recent.prompts_of(("a", None)) == []


@pytest.mark.parametrize(
    ("a", "b", "index"),
    [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [1], 0)],
)
def test_first_difference_index(a, b, index) -> None:
    assert first_difference_index(a, b) == index
