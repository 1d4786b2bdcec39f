"""coserve.autoscaling.queries: the PromQL each pool's autoscaler runs."""

from __future__ import annotations

import pytest

from coserve.autoscaling.queries import DEFAULT_QUERIES, SIGNALS, fill_query, queries_for, range_s


def test_defaults_select_the_pool_by_namespace_and_pool_label() -> None:
    queries = queries_for("serving", "chat")
    assert set(queries) == set(DEFAULT_QUERIES) == set(SIGNALS)
    selector = 'namespace="serving",pool="chat"'
    assert queries["arrivalRate"] == f"sum(rate(coserve_router_conversations_total{{{selector}}}[2m]))"
    assert queries["decoderKvUsage"] == (
        'avg({__name__=~"vllm:kv_cache_usage_perc|vllm_kv_cache_usage_perc",namespace="serving",pool="chat",'
        'role="decoder"})'
    )


def test_overrides_and_selector_fill_placeholders_literally() -> None:
    queries = queries_for(
        "ns", "p", {"arrivalRate": "sum(rate(my_conversations{{selector}}[30s]))"}, 'kubernetes_namespace="{namespace}"'
    )
    assert queries["arrivalRate"] == 'sum(rate(my_conversations{kubernetes_namespace="ns"}[30s]))'
    assert queries["prefillerQueue"] == (
        'avg({__name__=~"vllm:num_requests_waiting|vllm_num_requests_waiting",kubernetes_namespace="ns",'
        'role="prefiller"})'
    )


def test_an_unknown_signal_is_named() -> None:
    with pytest.raises(KeyError, match=r"unknown signal.*arrivals"):
        queries_for("ns", "p", {"arrivals": "x"})


@pytest.mark.parametrize(
    ("template", "selector", "filled"),
    [
        ("up{{selector}}", None, 'up{namespace="ns",pool="p"}'),
        ("up{{selector}} / on() x{{selector},job=\"{pool}\"}", None,
         'up{namespace="ns",pool="p"} / on() x{namespace="ns",pool="p",job="p"}'),
        ("up{{selector}}", 'app="{pool}",ns="{namespace}"', 'up{app="p",ns="ns"}'),
        ("up{{selector}}", "", 'up{namespace="ns",pool="p"}'),  # an empty selector is the default one
        ("sum(up)", 'app="{pool}"', "sum(up)"),
    ],
)  # fmt: skip
def test_fill_query_fills_the_selector_then_the_pool(template: str, selector: str | None, filled: str) -> None:
    assert fill_query(template, "ns", "p", selector) == filled


@pytest.mark.parametrize(
    ("query", "seconds"),
    [
        (DEFAULT_QUERIES["arrivalRate"], 120.0),
        ("sum(rate(x[1m30s]))", 90.0),
        ("rate(x[5m:30s])", 300.0),  # a subquery's range, not its resolution
        ("rate(x[1m]) / rate(y[1m])", 60.0),
        ("rate(x[1m]) / rate(y[2m])", None),  # ranges that differ: no one window
        (DEFAULT_QUERIES["prefillerQueue"], None),  # a gauge: no range
    ],
)
def test_a_query_s_range_is_read_from_its_selectors(query: str, seconds: float | None) -> None:
    assert range_s(query) == seconds
