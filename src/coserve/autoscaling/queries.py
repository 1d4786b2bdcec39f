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

import re
from collections.abc import Mapping

__all__ = ["DEFAULT_QUERIES", "DEFAULT_SELECTOR", "SIGNALS", "fill_query", "queries_for", "range_s"]

DEFAULT_SELECTOR = 'namespace="{namespace}",pool="{pool}"'


def _vllm(metric: str, role: str) -> str:
    """A vLLM engine metric of one role's pods, under either of the names Prometheus may store it as.

    NOTE: vLLM names its metrics ``vllm:...``. prometheus_client (0.2x) answers a scrape that negotiates
    OpenMetrics (Prometheus' default) with the colon turned into an underscore in each sample's name, but not
    in HELP and TYPE (prometheus/client_python#1177), so the same engine's series are stored as ``vllm_...``
    there and as ``vllm:...`` where it is scraped as plain text. Matching both names finds either.
    """
    return f'{{__name__=~"vllm:{metric}|vllm_{metric}",{{selector}},role="{role}"}}'


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
    "prefillTokensRate": f"avg(rate({_vllm('prompt_tokens_total', 'prefiller')}[2m]))",
    "prefillerQueue": f"avg({_vllm('num_requests_waiting', 'prefiller')})",
    "decoderKvUsage": f"avg({_vllm('kv_cache_usage_perc', 'decoder')})",
    "decoderWaiting": f"sum({_vllm('num_requests_waiting', 'decoder')})",
    "prefillerRequests": (
        f"sum({_vllm('num_requests_running', 'prefiller')}) + sum({_vllm('num_requests_waiting', 'prefiller')})"
    ),
    "decoderRequests": (
        f"sum({_vllm('num_requests_running', 'decoder')}) + sum({_vllm('num_requests_waiting', 'decoder')})"
    ),
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
    "prefillerRequests": "prefiller_requests",
    "decoderRequests": "decoder_requests",
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


_RANGE = re.compile(r"\[((?:\d+(?:ms|s|m|h|d|w|y))+)(?::[^\]]*)?\]")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0, "y": 31_536_000.0}


def range_s(query: str) -> float | None:
    """The range, in seconds, every range selector of ``query`` uses (``[2m]``, ``[1m30s]``); ``None`` when it has
    none or they differ. The autoscaler reads how stale the arrival rate is from it: a rate over a window is
    the mean of that window, centred half of it ago."""
    ranges = {sum(float(n) * _UNIT_S[unit] for n, unit in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", found))
              for found in _RANGE.findall(query)}  # fmt: skip
    return ranges.pop() if len(ranges) == 1 else None
