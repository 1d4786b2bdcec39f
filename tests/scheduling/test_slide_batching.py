"""SlideBatching: urgency partition, density and EDF order, starvation, budgets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.scheduling import SchedRequest, SlideBatching, SlideConfig, StepCostModel
from sched_builders import COST, REGISTRY, decoding, make_request
from slide_reference import ReferenceSlideBatching

POLICY = SlideBatching(COST, SlideConfig(max_tokens_per_step=512, urgency_factor=2.0, max_wait_s=30.0))


def test_empty_queue() -> None:
    decision = POLICY.decide([], now_s=0.0)
    assert decision.order == () and decision.token_budget == 512


def test_urgent_requests_go_first_by_density() -> None:
    # Both interactive requests are 50 ms from their first-token deadline: urgent.
    long = make_request("long", "interactive", prompt=400, arrival_s=-0.95)
    short = make_request("short", "interactive", prompt=20, arrival_s=-0.95)
    relaxed = make_request("relaxed", "standard", prompt=20)
    decision = POLICY.decide([relaxed, long, short], now_s=0.0)
    assert decision.urgent_ids == {"long", "short"}
    assert decision.order == ("short", "long", "relaxed")  # same gain, short needs less time: denser


def test_normal_requests_are_earliest_deadline_first() -> None:
    a = make_request("a", "standard", arrival_s=0.0)  # due at 5.0
    b = make_request("b", "standard", arrival_s=-2.0)  # due at 3.0
    c = make_request("c", "interactive", arrival_s=0.0)  # due at 1.0
    decision = POLICY.decide([a, b, c], now_s=0.0)
    assert decision.urgent_ids == frozenset()
    assert decision.order == ("c", "b", "a")


def test_late_requests_follow_urgent_ones_and_never_starve_behind_offline_work() -> None:
    late = make_request("late", "interactive", arrival_s=-5.0)  # first token was due 4 s ago
    urgent = make_request("urgent", "interactive", arrival_s=-0.95, prompt=10)
    bulk = [make_request(f"bulk{i}", "offline", prompt=2000) for i in range(4)]
    decision = POLICY.decide([*bulk, late, urgent], now_s=0.0)
    assert decision.late_ids == {"late"}
    assert decision.order[:2] == ("urgent", "late")
    assert {"urgent", "late"} <= decision.selected_ids


def test_starving_requests_are_promoted_to_the_front() -> None:
    starving = make_request("starving", "offline", arrival_s=-31.0)
    urgent = make_request("urgent", "interactive", arrival_s=-0.99, prompt=10)
    decision = POLICY.decide([urgent, starving], now_s=0.0)
    assert decision.promoted_ids == {"starving"}
    assert decision.order[0] == "starving"


def test_only_the_oldest_starving_request_jumps_the_queue_and_with_a_share_of_the_step() -> None:
    # Sustained overload leaves many requests past max_wait_s; promoting all of them to the front would
    # hand every step to the lowest class. The oldest advances each step with at most a quarter of it.
    starving = [make_request(f"old{i}", "offline", arrival_s=-40.0 + i, prompt=1000) for i in range(5)]
    urgent = make_request("urgent", "interactive", arrival_s=-0.5, prompt=100)
    decision = POLICY.decide([*starving, urgent], now_s=0.0)
    assert decision.promoted_ids == {"old0"}
    assert decision.order[:2] == ("old0", "urgent")
    assert decision.allowances["old0"] == 128  # 0.25 x 512
    assert decision.allowances["urgent"] == 100


def test_a_long_answer_counts_not_only_its_first_token() -> None:
    # Counting only the next token, 20 tokens of standard prefill for a one-token answer earn more per
    # second than 700 tokens of interactive prefill; counting the 63 later tokens at weight 10 that follow
    # it, the interactive request is worth more per second of work.
    long = make_request("long", "interactive", prompt=700, arrival_s=-0.2, max_output_tokens=64)
    short = [make_request(f"s{i}", "standard", prompt=20, max_output_tokens=1) for i in range(30)]
    crowd = [make_request(f"c{i}", "offline", prompt=3000) for i in range(10)]  # overload: all urgent
    decision = POLICY.decide([*short, *crowd, long], now_s=0.0)
    assert {"long", "s0"} <= decision.urgent_ids
    assert decision.order[0] == "long"


def test_a_late_request_that_can_catch_up_competes_and_a_hopeless_one_goes_last() -> None:
    # First token due 0.5 s ago; 40 more tokens at 100 ms TPOT: decoding twice as fast catches up.
    behind = make_request("behind", "interactive", arrival_s=-1.5, prompt=10, max_output_tokens=41)
    # Only 3 tokens left and 10 s behind: none can be on time any more.
    hopeless = make_request("hopeless", "interactive", arrival_s=-11.0, prompt=10, max_output_tokens=3)
    normal = make_request("normal", "offline", prompt=10)
    decision = POLICY.decide([hopeless, normal, behind], now_s=0.0)
    assert decision.late_ids == {"behind", "hopeless"}
    assert decision.order == ("behind", "normal", "hopeless")


def test_boundary_slides_with_load() -> None:
    # 300 ms of slack: normal when alone, urgent once the queue predicts long steps.
    probe = make_request("probe", "interactive", arrival_s=-0.7, prompt=10)
    alone = POLICY.decide([probe], now_s=0.0)
    crowd = [make_request(f"bulk{i}", "offline", prompt=500) for i in range(8)]
    loaded = POLICY.decide([probe, *crowd], now_s=0.0)
    assert "probe" not in alone.urgent_ids
    assert "probe" in loaded.urgent_ids


def test_time_budget_follows_the_tightest_slack_and_bounds_the_tokens() -> None:
    running = [decoding(f"d{i}", "interactive", arrival_s=-0.9, output=1) for i in range(4)]
    # Token 1 of each is due at arrival + 1.0 + 0.1 = 0.2 s from now.
    bulk = make_request("bulk", "offline", prompt=5000)
    decision = POLICY.decide([*running, bulk], now_s=0.0)
    assert 0.01 <= decision.time_budget_s < 0.2
    by_id = {r.request_id: r for r in [*running, bulk]}
    pieces = [(n, by_id[i].num_computed_tokens) for i, n in decision.allowances.items()]
    assert COST.step_latency_s(pieces) <= decision.time_budget_s
    assert decision.token_budget == sum(decision.allowances.values())
    assert decision.allowances["bulk"] > 0 and decision.token_budget >= 4  # every urgent decode fits
    # the step's token cap binds here (512); below it, one more token of the chunk would not fit
    grown = [(n + 1, c) if n > 1 else (n, c) for n, c in pieces]
    assert decision.token_budget == 512 or COST.step_latency_s(grown) > decision.time_budget_s


def test_the_token_budget_charges_each_request_for_its_own_context() -> None:
    """64 decodes at 16k of context leave room for a chunk of prefill: each attends to its own KV only."""
    model = StepCostModel(k1=1.83e-5, k2=1.04e-9, k3=0.0, k4=2.61e-8, k5=0.00444)  # the H200 profile
    running = [decoding(f"d{i}", "standard", prompt=16_384, arrival_s=-0.5, output=20) for i in range(64)]
    bulk = make_request("bulk", "offline", prompt=8000)
    policy = SlideBatching(model, SlideConfig(max_tokens_per_step=2048, min_step_s=0.05, max_step_s=0.05))
    decision = policy.decide([*running, bulk], now_s=0.0)
    assert decision.time_budget_s == 0.05
    assert all(decision.allowances.get(f"d{i}") == 1 for i in range(64))
    chunk = decision.allowances.get("bulk", 0)
    decodes = [(1, r.num_computed_tokens) for r in running]
    assert model.step_latency_s([*decodes, (chunk, 0)]) <= 0.05 < model.step_latency_s([*decodes, (chunk + 1, 0)])
    # read over the batch's totals, the same step would have had no room for any prefill at all
    total_context = sum(r.num_computed_tokens for r in running)
    assert model.latency_s(64, total_context) > 0.05
    assert chunk > 500


requests_strategy = st.lists(
    st.builds(
        lambda i, cls, arrival, prompt, out, running: make_request(
            f"r{i}",
            cls,
            arrival_s=arrival,
            prompt=prompt,
            computed=prompt + out - 1 if running and out else 0,
            output=out if running else 0,
            running=running,
        ),
        st.integers(0, 10**6),
        st.sampled_from(["interactive", "standard", "offline"]),
        st.floats(-60, 0),
        st.integers(1, 4000),
        st.integers(1, 50),
        st.booleans(),
    ),
    max_size=40,
    unique_by=lambda r: r.request_id,
)


@settings(max_examples=200, deadline=None)
@given(requests=requests_strategy, now=st.floats(0, 10))
def test_decision_is_a_permutation_within_budgets(requests: list[SchedRequest], now: float) -> None:
    decision = POLICY.decide(requests, now_s=now)
    assert sorted(decision.order) == sorted(r.request_id for r in requests)
    assert 1 <= decision.token_budget <= 512
    assert 0.01 <= decision.time_budget_s <= 2.0
    assert decision.urgent_ids.isdisjoint(decision.late_ids)
    # The selection is a prefix of the order and never empty when there is work.
    assert set(decision.order[: len(decision.selected_ids)]) == decision.selected_ids
    assert bool(decision.selected_ids) == bool(requests)
    assert decision.promoted_ids.isdisjoint(decision.urgent_ids | decision.late_ids)


@settings(max_examples=100, deadline=None)
@given(requests=requests_strategy, extra=requests_strategy)
def test_more_load_never_shrinks_the_urgent_set(requests: list[SchedRequest], extra: list[SchedRequest]) -> None:
    ids = {r.request_id for r in requests}
    extra = [r for r in extra if r.request_id not in ids]
    base = POLICY.decide(requests, now_s=0.0).urgent_ids
    more = POLICY.decide(requests + extra, now_s=0.0).urgent_ids
    assert base <= more


def test_selection_stops_when_the_token_budget_is_spent() -> None:
    policy = SlideBatching(COST, SlideConfig(max_tokens_per_step=64, max_step_s=2.0))
    first = make_request("first", "interactive", prompt=40)
    second = make_request("second", "standard", prompt=40)  # gets the remaining 24 tokens as a chunk
    third = make_request("third", "offline", prompt=40)
    decision = policy.decide([third, second, first], now_s=0.0)
    assert decision.order == ("first", "second", "third")
    assert decision.selected_ids == {"first", "second"}


def test_waiting_requests_are_selected_only_into_free_slots() -> None:
    """With every running slot taken, an urgent arrival cannot start: the step runs the running requests
    (selecting it anyway left the engine running nothing at all, step after step, at overload)."""
    policy = SlideBatching(COST, SlideConfig(max_tokens_per_step=256, max_step_s=2.0))
    running = [decoding(f"r{i}", "offline") for i in range(3)]
    urgent = [make_request(f"u{i}", "interactive", prompt=200) for i in range(2)]
    unlimited = policy.decide([*running, *urgent], now_s=0.0)
    assert {"u0", "u1"} <= unlimited.selected_ids  # the urgent ones go first ...
    full = policy.decide([*running, *urgent], now_s=0.0, free_slots=0)
    assert full.selected_ids == {"r0", "r1", "r2"}  # ... but with no slot, only what runs can run
    assert full.order[:2] == unlimited.order[:2]  # the order still says who comes first
    one = policy.decide([*running, *urgent], now_s=0.0, free_slots=1)
    assert len(one.selected_ids & {"u0", "u1"}) == 1
    assert one.selected_ids & {"r0", "r1", "r2"}  # the budget the second one would have taken goes on


def test_a_top_class_request_about_to_miss_its_deadline_runs_first() -> None:
    # 600 tokens of interactive prefill, 0.2 s before its deadline, under overload: it must run now. By
    # density alone the short standard prompts (one-token answers) would go first and it would miss.
    critical = make_request("critical", "interactive", prompt=600, arrival_s=-0.9, max_output_tokens=4)
    short = [make_request(f"s{i}", "standard", prompt=10, arrival_s=-4.9, max_output_tokens=1) for i in range(20)]
    crowd = [make_request(f"c{i}", "offline", prompt=3000) for i in range(10)]
    decision = POLICY.decide([*short, *crowd, critical], now_s=0.0)
    assert decision.order[0] == "critical"
    assert "critical" in decision.selected_ids


def test_lower_class_requests_about_to_miss_keep_competing_by_density() -> None:
    # A standard request 40 ms from missing (one-token answer: little gain per second) and a denser standard
    # one with 2 s of slack. Only the top class jumps ahead when critical; putting every class's critical
    # requests first serves everyone at the last moment, in small steps, and loses gain under overload.
    edge = make_request("edge", "standard", prompt=400, arrival_s=-4.92, max_output_tokens=1)
    dense = make_request("dense", "standard", prompt=10, arrival_s=-3.0, max_output_tokens=64)
    top = make_request("top", "interactive", prompt=10)  # present and on time: the top class is interactive
    crowd = [make_request(f"c{i}", "offline", prompt=3000) for i in range(10)]
    decision = POLICY.decide([edge, dense, top, *crowd], now_s=0.0)
    assert {"edge", "dense"} <= decision.urgent_ids
    assert decision.order.index("dense") < decision.order.index("edge")


def test_a_hopeless_running_request_keeps_decoding_and_a_hopeless_waiting_one_goes_last() -> None:
    running = decoding("running", "interactive", output=2, arrival_s=-30.0, max_output_tokens=3)
    waiting = make_request("waiting", "interactive", prompt=10, arrival_s=-29.0, max_output_tokens=2)
    normal = make_request("normal", "offline", prompt=10)
    decision = POLICY.decide([waiting, normal, running], now_s=0.0)
    assert decision.late_ids == {"running", "waiting"}
    assert decision.order[-1] == "waiting"
    assert decision.order.index("running") < decision.order.index("waiting")
    assert "running" in decision.selected_ids


def test_with_an_offline_class_a_hopeless_online_request_goes_before_offline_work() -> None:
    """Without an offline class (above) a hopeless request goes last; with one, offline work only fills what
    online work leaves: the hopeless interactive request runs next, still after online work that can earn."""
    offline_rank = max(make_request("x", c).cls.rank for c in ("interactive", "standard", "offline"))
    policy = SlideBatching(COST, SlideConfig(max_tokens_per_step=512, max_wait_s=30.0), offline_rank=offline_rank)
    hopeless = make_request("hopeless", "interactive", arrival_s=-11.0, prompt=10, max_output_tokens=3)
    standard = make_request("standard", "standard", prompt=10)
    offline = [make_request(f"bulk{i}", "offline", prompt=10) for i in range(3)]
    decision = policy.decide([*offline, hopeless, standard], now_s=0.0)
    assert "hopeless" in decision.late_ids
    assert decision.order == ("standard", "hopeless", "bulk0", "bulk1", "bulk2")


def _same_decision(policy: SlideBatching, reference: ReferenceSlideBatching, requests: list[SchedRequest],
                   now: float, free_slots: int | None) -> None:  # fmt: skip
    assert policy.decide(requests, now, free_slots) == reference.decide(requests, now, free_slots)


@settings(max_examples=300, deadline=None)
@given(
    requests=requests_strategy,
    now=st.floats(0, 90),
    free_slots=st.none() | st.integers(0, 8),
    tokens=st.sampled_from([64, 512, 2048]),
    factor=st.sampled_from([0.0, 0.5, 2.0, 8.0]),
    offline=st.booleans(),
)
def test_the_pipeline_decides_exactly_as_the_function_it_replaced(
    requests: list[SchedRequest], now: float, free_slots: int | None, tokens: int, factor: float, offline: bool
) -> None:
    config = SlideConfig(max_tokens_per_step=tokens, urgency_factor=factor, max_wait_s=30.0)
    rank = REGISTRY.get("offline").rank if offline else None
    _same_decision(SlideBatching(COST, config, rank), ReferenceSlideBatching(COST, config, rank), requests, now,
                   free_slots)  # fmt: skip
