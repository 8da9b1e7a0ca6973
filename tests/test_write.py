"""The fenced write without sockets or a store: what the reader makes of a request's
head, and every transition of an attempt with what it asks the store to record."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from fenceproxy.config import FenceSpec, RouteSpec
from fenceproxy.errors import (
    FencingHeaderMalformed,
    FencingHeaderMissing,
    IdempotencyKeyMalformed,
    IllegalMove,
    InvariantError,
    JobQuarantined,
    MethodOverrideMalformed,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from fenceproxy.fence.fencing import SHARED_SCOPE, FencedWrite, StoredResponse
from fenceproxy.fence.write import (
    SETTLING,
    TRANSITIONS,
    TURN_SLACK,
    Attempt,
    Event,
    KeyFate,
    Reading,
    RecordFate,
    Settling,
    State,
    read_write,
)
from fenceproxy.http.routes import Route

ROUTE = Route.compile(
    RouteSpec(
        name="r", path="/", upstream="http://127.0.0.1:9", timeout=3, connect_timeout=1,
        quarantine=7,
    )
)  # fmt: skip
UNFENCED = Route.compile(RouteSpec(name="u", path="/", upstream="http://127.0.0.1:9", fence=False))
ADMITTED_AT = 100.0
HEADERS = (("Content-Type", "application/json"),)


def read(
    method: str = "POST", route: Route = ROUTE, path_job: str | None = None, **headers: str
) -> Reading:
    fields = CIMultiDictProxy(CIMultiDict((n.replace("_", "-"), v) for n, v in headers.items()))
    return read_write(route, method, fields, path_job, None)


def attempt(key: str | None = "k", route: Route = ROUTE) -> Attempt:
    write = FencedWrite("r", "job", 7, key=key, fingerprint=None if key is None else b"f")
    return Attempt(write, route, ADMITTED_AT)


def sending(key: str | None = "k") -> Attempt:
    a = attempt(key)
    a.send(ADMITTED_AT + TURN_SLACK)
    return a


# -- the reader ------------------------------------------------------------------


def test_a_route_without_a_fence_reads_nothing() -> None:
    assert read(route=UNFENCED, Fencing_Job="j", Fencing_Token="1") == Reading(fenced=False)


def test_a_safe_method_is_not_fenced() -> None:
    assert not read("GET", Fencing_Job="j", Fencing_Token="1").fenced


def test_a_get_that_overrides_to_a_fenced_method_is_fenced() -> None:
    reading = read("GET", X_HTTP_Method_Override="delete", Fencing_Job="j", Fencing_Token="1")
    assert (reading.fenced, reading.override) == (True, "DELETE")
    assert reading.write is not None


def test_an_unreadable_override_is_refused_before_anything_is_known() -> None:
    reading = read("POST", X_HTTP_Method_Override="a b")
    assert not reading.fenced
    assert isinstance(reading.refusal, MethodOverrideMalformed)


def test_a_write_read_whole_holds_its_job_for_the_timeouts_quarantine_and_slack() -> None:
    reading = read(Fencing_Job="j", Fencing_Token="7")
    assert reading.write is not None
    assert reading.refusal is None
    assert (reading.job, reading.generation, reading.key) == ("j", 7, None)
    write = reading.write
    assert (write.route, write.job, write.generation, write.key) == ("r", "j", 7, None)
    assert write.hold == 1 + 3 + 7 + TURN_SLACK
    assert write.scope == SHARED_SCOPE  # unkeyed: nobody's


def test_a_keyed_write_is_scoped_to_its_callers_credentials() -> None:
    mine = read(Fencing_Job="j", Fencing_Token="7", Idempotency_Key="k", Authorization="a")
    theirs = read(Fencing_Job="j", Fencing_Token="7", Idempotency_Key="k", Authorization="b")
    assert mine.write is not None
    assert theirs.write is not None
    assert mine.write.scope not in (theirs.write.scope, SHARED_SCOPE)


def test_a_refusal_keeps_what_was_read_before_it() -> None:
    missing = read(Fencing_Job="j")
    assert isinstance(missing.refusal, FencingHeaderMissing)
    assert (missing.fenced, missing.job, missing.write) == (True, None, None)
    bad_key = read(Fencing_Job="j", Fencing_Token="7", Idempotency_Key=" k")
    assert isinstance(bad_key.refusal, IdempotencyKeyMalformed)
    assert (bad_key.job, bad_key.generation, bad_key.key) == ("j", 7, None)


def test_an_underscored_field_counts_as_the_field_it_spells() -> None:
    headers = CIMultiDictProxy(CIMultiDict([("Fencing_Job", "j"), ("Fencing-Token", "1")]))
    reading = read_write(ROUTE, "POST", headers, None, None)
    assert reading.job == "j"


def test_the_methods_a_route_fences_are_its_own() -> None:
    route = Route.compile(
        RouteSpec(name="p", path="/", upstream="http://h", fence=FenceSpec(methods=("PUT",)))
    )
    assert not read("POST", route, Fencing_Job="j", Fencing_Token="1").fenced
    assert read("PUT", route, Fencing_Job="j", Fencing_Token="1").fenced


def test_a_job_header_on_a_route_with_the_job_in_its_path_must_name_the_same_job() -> None:
    """The upstream may read the job from either: one naming another job than the path
    is refused, so a write is never fenced as one job and applied as another."""
    route = Route.compile(RouteSpec(name="o", path="/orders/{job}/", upstream="http://h"))
    other = read("POST", route, "inv-7", Fencing_Job="inv-8", Fencing_Token="4")
    assert isinstance(other.refusal, FencingHeaderMalformed)
    assert other.refusal.extensions["header"] == "Fencing-Job"
    assert other.write is None
    for agreeing in (
        read("POST", route, "inv-7", Fencing_Job="inv-7", Fencing_Token="4"),
        read("POST", route, "inv-7", Fencing_Token="4"),
    ):
        assert agreeing.refusal is None
        assert agreeing.write is not None
        assert (agreeing.write.job, agreeing.write.generation) == ("inv-7", 4)


# -- the attempt -----------------------------------------------------------------


def test_an_admitted_write_sent_within_the_slack_is_sending() -> None:
    a = attempt()
    a.send(ADMITTED_AT + TURN_SLACK)
    assert a.state is State.SENDING
    assert a.timeout == 1 + 3  # connecting, then the answer


def test_a_keyed_answer_is_stored_and_the_record_cleared() -> None:
    a = sending()
    a.answered(201, HEADERS, b"{}", whole=True)
    ending = a.end()
    assert (ending.state, ending.key, ending.unknown_for, ending.cut) == (
        State.ANSWERED, StoredResponse(201, HEADERS, b"{}"), None, False,
    )  # fmt: skip


def test_an_answer_too_large_to_store_is_kept_without_its_body() -> None:
    a = sending()
    a.answered(200, HEADERS, b"x" * 10, whole=False)
    assert a.end().key == StoredResponse(200, HEADERS, None)


def test_an_unkeyed_answer_records_nothing_and_clears_the_record() -> None:
    a = sending(key=None)
    a.answered(200)
    ending = a.end()
    assert (ending.state, ending.key, ending.unknown_for) == (State.ANSWERED, None, None)


def test_an_error_after_the_answer_keeps_the_answer() -> None:
    a = sending()
    a.answered(200, HEADERS, b"ok")
    ending = a.end(asyncio.CancelledError())
    assert (ending.state, ending.key, ending.cut) == (
        State.ANSWERED, StoredResponse(200, HEADERS, b"ok"), False,
    )  # fmt: skip


def test_a_write_that_never_left_releases_its_key_and_the_record() -> None:
    ending = sending().end(UpstreamUnreachable("refused"))
    assert (ending.state, ending.key, ending.unknown_for, ending.cut) == (
        State.NOT_SENT, "forget", None, False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "error",
    [
        UpstreamTimeout("no answer in time"),
        UpstreamFailed("reset after sending"),
        asyncio.CancelledError(),
        TimeoutError(),
        None,
    ],
    ids=["timeout", "broken-after-sending", "cancelled", "bare-timeout", "no-answer-given"],
)
def test_a_write_in_doubt_is_unknown_cut_and_held_for_the_quarantine(error: Any) -> None:
    ending = sending().end(error)
    assert (ending.state, ending.key, ending.unknown_for, ending.cut) == (
        State.UNKNOWN, "unknown", 7, True,
    )  # fmt: skip


def test_an_unkeyed_write_in_doubt_holds_the_record_with_no_key_to_mark() -> None:
    ending = sending(key=None).end(UpstreamTimeout("no answer in time"))
    assert (ending.state, ending.key, ending.unknown_for) == (State.UNKNOWN, None, 7)


def test_a_route_without_quarantine_still_cuts_a_write_in_doubt() -> None:
    route = Route.compile(
        RouteSpec(name="q", path="/", upstream="http://h", quarantine=0)
    )  # fmt: skip
    a = attempt(route=route)
    a.send(ADMITTED_AT)
    ending = a.end(asyncio.CancelledError())
    assert (ending.unknown_for, ending.cut) == (0, True)


def test_a_write_is_sent_only_within_one_second_of_its_admission() -> None:
    """The slack between a write's admission and its send is one second, the same
    second its in-flight record counts beyond the route's timeouts and quarantine."""
    on_time = attempt()
    on_time.send(ADMITTED_AT + 1.0)
    assert on_time.state is State.SENDING
    late = attempt()
    with pytest.raises(JobQuarantined):
        late.send(ADMITTED_AT + 1.01)
    assert late.state is State.NOT_SENT
    write = read(Fencing_Job="j", Fencing_Token="7").write
    assert write is not None
    assert write.hold == 1 + 3 + 7 + 1


def test_a_write_stalled_past_the_slack_is_not_sent_and_given_back() -> None:
    a = attempt()
    with pytest.raises(JobQuarantined):
        a.send(ADMITTED_AT + TURN_SLACK + 0.001)
    assert a.state is State.NOT_SENT
    ending = a.end(JobQuarantined("stalled"))
    assert (ending.state, ending.key, ending.unknown_for) == (State.NOT_SENT, "forget", None)


def test_a_write_ended_before_it_was_sent_is_given_back() -> None:
    ending = attempt().end(asyncio.CancelledError())
    assert (ending.state, ending.key, ending.cut) == (State.NOT_SENT, "forget", False)


def test_an_unkeyed_write_not_sent_records_nothing() -> None:
    assert attempt(key=None).end().key is None


@pytest.mark.parametrize("move", ["send", "answer"])
def test_a_move_the_table_does_not_list_is_a_bug(move: str) -> None:
    """A move the table lacks (a send or an answer after the answer) raises
    IllegalMove, under ``python -O`` too, and leaves the attempt where it was."""
    a = sending()
    a.answered(200)
    with pytest.raises(IllegalMove) as raised:
        if move == "send":
            a.send(ADMITTED_AT)
        else:
            a.answered(200)
    event = Event.SEND if move == "send" else Event.ANSWER
    assert (raised.value.state, raised.value.event) == (State.ANSWERED, event)
    assert isinstance(raised.value, InvariantError)
    assert a.state is State.ANSWERED


def test_every_state_ends_and_the_final_states_stay_put() -> None:
    ends = {state: TRANSITIONS.get((state, Event.END)) for state in State}
    assert ends == {
        State.ADMITTED: State.NOT_SENT,
        State.SENDING: State.UNKNOWN,
        State.ANSWERED: State.ANSWERED,
        State.NOT_SENT: State.NOT_SENT,
        State.UNKNOWN: State.UNKNOWN,
    }
    final = {State.ANSWERED, State.NOT_SENT, State.UNKNOWN}
    assert all(before not in final or event is Event.END for before, event in TRANSITIONS)


FINAL = {State.ANSWERED, State.NOT_SENT, State.UNKNOWN}


@pytest.mark.parametrize(
    ("state", "row"),
    [
        (State.ANSWERED, Settling(KeyFate.COMPLETED, RecordFate.CLEARED, cut=False)),
        (State.NOT_SENT, Settling(KeyFate.FORGOTTEN, RecordFate.CLEARED, cut=False)),
        (State.UNKNOWN, Settling(KeyFate.UNKNOWN, RecordFate.HELD, cut=True)),
    ],
    ids=["answered", "not-sent", "unknown"],
)
def test_each_final_state_settles_as_its_row(state: State, row: Settling) -> None:
    """An answered write's key keeps its answer and frees the job; one never sent
    releases its key and frees the job; one in doubt is cut, its key marked unknown
    and the job held: the settlement table says so, row by row."""
    assert SETTLING[state] == row


def test_the_settlement_table_has_exactly_the_final_states() -> None:
    """Every state an attempt can end in is settled, and only those."""
    assert set(SETTLING) == FINAL == {TRANSITIONS[state, Event.END] for state in State}


REACH = {
    State.ANSWERED: lambda a: (a.send(ADMITTED_AT), a.answered(201, HEADERS, b"{}")),
    State.NOT_SENT: lambda a: None,
    State.UNKNOWN: lambda a: a.send(ADMITTED_AT),
}


@pytest.mark.parametrize("state", sorted(FINAL, key=lambda s: s.value), ids=lambda s: s.value)
@pytest.mark.parametrize("key", ["k", None], ids=["keyed", "unkeyed"])
def test_an_attempt_ends_as_its_final_states_row_says(state: State, key: str | None) -> None:
    """What the store is asked for at a turn's end is read from the table: the key's
    fate (nothing for an unkeyed write), the record cleared or held for the route's
    quarantine, and the exchange cut before either."""
    a = attempt(key)
    REACH[state](a)
    ending = a.end()
    row = SETTLING[state]
    settled = {
        KeyFate.COMPLETED: StoredResponse(201, HEADERS, b"{}"),
        KeyFate.FORGOTTEN: "forget",
        KeyFate.UNKNOWN: "unknown",
    }
    assert ending.state is state
    assert ending.key == (None if key is None else settled[row.key])
    assert ending.unknown_for == (7 if row.record is RecordFate.HELD else None)
    assert ending.cut is row.cut
