"""The PromQL the autoscaler runs for a pool: defaults matching the router's and vLLM's metric names.

Who calls it: the operator's autoscaler renders ``queries_for`` once per
evaluation and runs each query; ``spec.autoscaling.queries`` overrides any of
them by name. Templates may use ``{selector}`` (``spec.autoscaling.selector``,
by default ``namespace="<ns>",pool="<pool>"``), ``{namespace}`` and ``{pool}``.

The default selector assumes the usual Kubernetes scrape relabelling: the
namespace as ``namespace`` and the pods' ``coserve.dev/pool`` and
``coserve.dev/role`` labels as ``pool`` and ``role`` (the README shows a scrape
config that does this); ``spec.autoscaling.selector`` adapts it to others.

Placeholders are replaced literally (no escaping of PromQL's own braces).
Each query must return one number (a scalar, or an instant vector of one
sample); an empty result or NaN is "no data".
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["DEFAULT_QUERIES", "DEFAULT_SELECTOR", "SIGNALS", "fill_query", "queries_for"]

DEFAULT_SELECTOR = 'namespace="{namespace}",pool="{pool}"'

# signal name -> PromQL template; the names are Signals' fields (coserve.autoscaling.policy)
DEFAULT_QUERIES: dict[str, str] = {
    "arrivalRate": "sum(rate(coserve_router_conversations_total{{selector}}[2m]))",
    "inputTokens": (
        "sum(rate(coserve_router_conversation_input_tokens_sum{{selector}}[5m]))"
        " / sum(rate(coserve_router_conversation_input_tokens_count{{selector}}[5m]))"
    ),
    "outputTokens": (
        "sum(rate(coserve_router_output_tokens_total{{selector}}[5m]))"
        " / sum(rate(coserve_router_conversations_total{{selector}}[5m]))"
    ),
    "lifetime": (
        "sum(rate(coserve_router_conversation_lifetime_seconds_sum{{selector}}[10m]))"
        " / sum(rate(coserve_router_conversation_lifetime_seconds_count{{selector}}[10m]))"
    ),
    "prefillTokensRate": 'avg(rate(vllm:prompt_tokens_total{{selector},role="prefiller"}[2m]))',
    "prefillerQueue": 'avg(vllm:num_requests_waiting{{selector},role="prefiller"})',
    "decoderKvUsage": 'avg(vllm:kv_cache_usage_perc{{selector},role="decoder"})',
    "decoderWaiting": 'sum(vllm:num_requests_waiting{{selector},role="decoder"})',
}

# query name -> Signals field
SIGNALS: dict[str, str] = {
    "arrivalRate": "arrival_rate_per_s",
    "inputTokens": "input_tokens",
    "outputTokens": "output_tokens",
    "lifetime": "lifetime_s",
    "prefillTokensRate": "prefill_tokens_per_s",
    "prefillerQueue": "prefiller_queue",
    "decoderKvUsage": "decoder_kv_usage",
    "decoderWaiting": "decoder_waiting",
}


def queries_for(
    namespace: str, pool: str, overrides: Mapping[str, str] | None = None, selector: str | None = None
) -> dict[str, str]:
    """Every signal's PromQL for one pool; ``KeyError`` names an override that is not a signal."""
    unknown = sorted(set(overrides or {}) - set(DEFAULT_QUERIES))
    if unknown:
        raise KeyError(f"unknown signal(s) {', '.join(unknown)}; known: {', '.join(DEFAULT_QUERIES)}")
    templates = {**DEFAULT_QUERIES, **(overrides or {})}
    return {name: fill_query(template, namespace, pool, selector) for name, template in templates.items()}


def fill_query(template: str, namespace: str, pool: str, selector: str | None = None) -> str:
    """``template`` for one pool: ``{selector}`` becomes ``selector`` (by default ``DEFAULT_SELECTOR``), then
    ``{namespace}`` and ``{pool}`` become the pool's, in the selector too; all replaced literally.

    The autoscaler's signals (``queries_for``) and the pinned-conversations query of
    ``coserve.operator.deletion_cost`` are both filled here, so they select the same series.
    """
    where = _fill_pool(selector or DEFAULT_SELECTOR, namespace, pool)
    return _fill_pool(template.replace("{selector}", where), namespace, pool)


def _fill_pool(template: str, namespace: str, pool: str) -> str:
    return template.replace("{namespace}", namespace).replace("{pool}", pool)
