"""The pure fence decision without I/O: header parsing at its edges, the decision
table of decide(), a model-based run of random writes, the request fingerprint, and the
problem types of the refusals."""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fenceproxy import errors
from fenceproxy.errors import (
    PROBLEM_BASE,
    FencingHeaderMalformed,
    IdempotencyKeyMalformed,
    KeyOtherCaller,
    KeyReused,
    Refusal,
    StaleGeneration,
)
from fenceproxy.fence.fencing import (
    GENERATION_MAX,
    SHARED_SCOPE,
    UNSCOPED,
    Admit,
    FencedWrite,
    KeyRecord,
    KeyState,
    Replay,
    StoredResponse,
    decide,
    fingerprint,
    parse_generation,
    parse_job,
    parse_key,
    scope,
    signer,
)

TOKEN = "Fencing-Token"
JOB = "Fencing-Job"
KEY = "Idempotency-Key"

PROPERTY = settings(max_examples=300, deadline=None)

# Text with long strings, non-ASCII and lone surrogates (what surrogateescape makes of
# bytes that are not UTF-8), which st.text() leaves out by default.
ANY_TEXT = st.one_of(
    st.text(),
    st.text(max_size=300),
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40),
    st.from_regex(r"[0-9]{1,22}", fullmatch=True),
)

# Near misses for a generation: integers with signs, padding, separators and exponents
# around them, and digits of other scripts, all of which int() would accept or tolerate.
GENERATION_TEXT = st.one_of(
    ANY_TEXT,
    st.builds(
        lambda before, n, after: f"{before}{n}{after}",
        st.sampled_from(["", "", " ", "\t", "+", "-", "0", "00"]),
        st.integers(min_value=-(2**64), max_value=2**64),
        st.sampled_from(["", "", " ", "\n", "_0", "e3", ".0"]),
    ),
    st.text(st.characters(categories=["Nd"]), min_size=1, max_size=4),
)


# --- parse_generation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", 0), ("7", 7), ("9223372036854775807", GENERATION_MAX)],
)
def test_parse_generation_accepts_ascii_decimal_in_range(value: str, expected: int) -> None:
    assert parse_generation(value, TOKEN) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "-1",
        "9223372036854775808",
        "1_0",
        " 7",
        "7 ",
        "7\n",
        "+7",
        "0x10",
        "1e3",
        "1.0",
        "\u0667",  # ARABIC-INDIC DIGIT SEVEN
        "\uff17",  # FULLWIDTH DIGIT SEVEN
        "1" * 20,
        "0" * 20,
        "9" * 20,
    ],
)
def test_parse_generation_refuses_anything_else(value: str) -> None:
    with pytest.raises(FencingHeaderMalformed) as info:
        parse_generation(value, TOKEN)
    assert info.value.extensions == {"header": TOKEN}
    assert TOKEN in info.value.detail


@given(GENERATION_TEXT)
@PROPERTY
def test_parse_generation_returns_an_in_range_int_or_refuses(value: str) -> None:
    try:
        result = parse_generation(value, TOKEN)
    except FencingHeaderMalformed:
        return
    assert type(result) is int
    assert 0 <= result <= GENERATION_MAX
    assert value.isascii()
    assert value.isdigit()
    assert int(value) == result


# --- parse_job and parse_key ---------------------------------------------------------


def _returned_as_is_or_refused(
    parse: Callable[[str, str], str],
    header: str,
    refusal: type[Refusal],
    acceptable: Callable[[str], bool],
    value: str,
) -> None:
    """``parse`` returns ``value`` unchanged when it is ``acceptable``, and refuses it
    with ``refusal`` when it is not."""
    try:
        result = parse(value, header)
    except refusal:
        assert not acceptable(value)
    else:
        assert result == value
        assert acceptable(value)


def _is_acceptable_job(value: str) -> bool:
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return False
    return 1 <= size <= 256 and not any(unicodedata.category(c) in ("Cc", "Cf") for c in value)


@given(ANY_TEXT)
@example("x" * 256)
@example("x" * 257)
@example("\u00e9" * 128)
@example("\u00e9" * 129)
@example("a\tb")
@example("a\x7fb")
@example("\x85")  # NEL: a C1 control
@example("\udce9")  # a byte that was not UTF-8, surrogate-escaped
@example("invoice-42")
@example("")
@PROPERTY
def test_parse_job_returns_input_or_refuses(value: str) -> None:
    _returned_as_is_or_refused(parse_job, JOB, FencingHeaderMalformed, _is_acceptable_job, value)


def _is_acceptable_key(value: str) -> bool:
    return (
        1 <= len(value) <= 255
        and all(" " <= c <= "~" for c in value)
        and not value.startswith(" ")
        and not value.endswith(" ")
    )


@given(st.one_of(ANY_TEXT, st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127))))
@example("k" * 255)
@example("k" * 256)
@example("a b")
@example(" a")
@example("a ")
@example(" ")
@example("a\tb")
@example("caf\u00e9")
@example("")
@PROPERTY
def test_parse_key_returns_printable_ascii_or_refuses(value: str) -> None:
    _returned_as_is_or_refused(parse_key, KEY, IdempotencyKeyMalformed, _is_acceptable_key, value)


# --- decide ----------------------------------------------------------------------------

FP = fingerprint("POST", "/billing/charges", b'{"amount": 5}')
OTHER_FP = fingerprint("POST", "/billing/charges", b'{"amount": 6}')
STORED = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id": 1}')


def write(generation: int, *, key: str | None = None, replay: bool = True) -> FencedWrite:
    return FencedWrite(
        route="billing",
        job="invoice-42",
        generation=generation,
        key=key,
        fingerprint=FP if key is not None else None,
        replay=replay,
    )


def completed(response: StoredResponse = STORED, fp: bytes = FP) -> KeyRecord:
    return KeyRecord(KeyState.COMPLETED, fp, response)


def test_a_write_holds_its_job_for_60_seconds_unless_told() -> None:
    """The documented default, for callers of the store that do not say."""
    assert FencedWrite("billing", "invoice-42", 1).hold == 60.0


def test_decide_no_history_admits_and_raises() -> None:
    assert decide(write(7), None, None) == Admit(raise_to=7)


def test_decide_generation_zero_with_no_history_raises_to_zero() -> None:
    assert decide(write(0), None, None) == Admit(raise_to=0)


def test_decide_equal_generation_admits_without_raising() -> None:
    assert decide(write(7), 7, None) == Admit(raise_to=None)


def test_decide_higher_generation_admits_and_raises() -> None:
    assert decide(write(8), 7, None) == Admit(raise_to=8)


def test_decide_lower_generation_is_stale() -> None:
    result = decide(write(6), 7, None)
    assert isinstance(result, StaleGeneration)
    assert result.status == 409
    assert result.extensions == {"job": "invoice-42", "generation": 6, "current_generation": 7}


def test_decide_key_with_other_fingerprint_is_key_reused() -> None:
    result = decide(write(7, key="k1"), 7, completed(fp=OTHER_FP))
    assert isinstance(result, KeyReused)
    assert result.status == 422
    assert result.extensions["job"] == "invoice-42"


@pytest.mark.parametrize(
    ("state", "refusal"),
    [
        (KeyState.IN_FLIGHT, errors.DuplicateInFlight),
        (KeyState.UNKNOWN, errors.DuplicateOutcomeUnknown),
    ],
)
def test_decide_key_not_completed_is_refused(state: KeyState, refusal: type[Refusal]) -> None:
    result = decide(write(7, key="k1"), 7, KeyRecord(state, FP))
    assert type(result) is refusal
    assert result.status == 409


def test_decide_completed_key_replays_stored_response() -> None:
    assert decide(write(7, key="k1"), 7, completed()) == Replay(STORED)


def test_decide_completed_key_without_replay_is_rejected() -> None:
    result = decide(write(7, key="k1", replay=False), 7, completed())
    assert isinstance(result, errors.DuplicateRejected)
    assert result.extensions["original_status"] == 201


def test_decide_completed_key_with_unstored_body_is_not_stored() -> None:
    record = completed(StoredResponse(200, (), None))
    result = decide(write(7, key="k1"), 7, record)
    assert isinstance(result, errors.DuplicateNotStored)
    assert result.extensions["original_status"] == 200


def test_decide_completed_key_replays_even_when_generation_is_stale() -> None:
    assert decide(write(3, key="k1"), 9, completed()) == Replay(STORED)


def test_decide_new_key_is_fenced_like_any_write() -> None:
    assert isinstance(decide(write(3, key="k1"), 9, None), StaleGeneration)
    assert decide(write(9, key="k1"), 9, None) == Admit(raise_to=None)


ALICE = scope([("Authorization", ["Bearer alice"]), ("Cookie", [])])
BOB = scope([("Authorization", ["Bearer bob"]), ("Cookie", [])])


@pytest.mark.parametrize(
    "record",
    [
        completed(),
        completed(fp=OTHER_FP),  # not even whether the request is the same is told
        completed(StoredResponse(200, (), None)),
        KeyRecord(KeyState.IN_FLIGHT, FP),
        KeyRecord(KeyState.UNKNOWN, FP),
    ],
    ids=["completed", "other-request", "not-stored", "in-flight", "unknown"],
)
@pytest.mark.parametrize("replay", [True, False])
def test_decide_another_callers_key_is_refused_before_anything_else(
    record: KeyRecord, replay: bool
) -> None:
    theirs = KeyRecord(record.state, record.fingerprint, record.response, scope=ALICE)
    mine = FencedWrite("billing", "invoice-42", 3, key="k1", fingerprint=FP, scope=BOB)
    result = decide(dataclasses.replace(mine, replay=replay), 9, theirs)
    assert isinstance(result, KeyOtherCaller)
    assert (result.status, result.extensions) == (422, {"job": "invoice-42"})
    own = dataclasses.replace(mine, scope=ALICE, replay=replay)
    assert not isinstance(decide(own, 9, theirs), KeyOtherCaller)


@pytest.mark.parametrize(
    "caller",
    [SHARED_SCOPE, ALICE, scope([("Authorization", [])])],
    ids=["shared", "a-credential", "no-credential"],
)
def test_decide_a_key_from_before_callers_answers_nobody(caller: bytes) -> None:
    record = KeyRecord(KeyState.COMPLETED, FP, STORED, scope=UNSCOPED)
    result = decide(
        FencedWrite("billing", "j", 1, key="k", fingerprint=FP, scope=caller), 1, record
    )
    assert isinstance(result, KeyOtherCaller)


def test_scope_tells_callers_apart_by_every_name_value_and_order() -> None:
    callers = [
        [("Authorization", []), ("Cookie", [])],
        [("Authorization", [""]), ("Cookie", [])],  # empty, not absent
        [("Authorization", ["x"]), ("Cookie", [])],
        [("Authorization", []), ("Cookie", ["x"])],  # the same value under another name
        [("Authorization", ["x", "y"]), ("Cookie", [])],
        [("Authorization", ["y", "x"]), ("Cookie", [])],
        [("Authorization", ["xy"]), ("Cookie", [])],
        [("Authorization", ["x"]), ("Cookie", ["y"])],
        [("Authorization", ["x\0y"]), ("Cookie", [])],
        [],
    ]
    digests = [scope(fields) for fields in callers]
    assert len(set(digests)) == len(callers)
    assert all(len(d) == 32 for d in digests)
    assert scope([("authorization", ["x"]), ("cookie", [])]) == digests[2]  # any case
    assert scope([]) == SHARED_SCOPE
    assert UNSCOPED not in digests


def sigv4(key_id: str, date: str, signature: str) -> str:
    return (
        f"AWS4-HMAC-SHA256 Credential={key_id}/{date}/us-east-1/s3/aws4_request, "
        f"SignedHeaders=host;x-amz-date, Signature={signature}"
    )


def test_scope_of_a_signed_request_is_its_access_key_not_its_signature() -> None:
    """botocore signs each retry anew (another date, another signature): a retry is
    still its caller's, or a lost answer could never be replayed to it."""

    def caller(authorization: str) -> bytes:
        return scope([("Authorization", [authorization]), ("Cookie", [])])

    first = caller(sigv4("AKIDALICE", "20261204", "a" * 64))
    assert caller(sigv4("AKIDALICE", "20261205", "b" * 64)) == first
    assert caller(sigv4("AKIDBOB", "20261204", "a" * 64)) != first
    assert caller("AWS AKIDALICE:c2lnbmF0dXJlMQ==") == caller("AWS AKIDALICE:c2lnbmF0dXJlMg==")
    assert caller("AWS AKIDALICE:c2lnbmF0dXJlMQ==") != first  # another scheme
    # A bearer token is its whole self: two tokens are two callers.
    assert caller("Bearer one") != caller("Bearer two")
    assert signer("Bearer AWS4-HMAC-SHA256 Credential=AKIDALICE/") == (
        "Bearer AWS4-HMAC-SHA256 Credential=AKIDALICE/"
    )


# A write in the model run: generation, idempotency key (or none), body.
WRITES = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=6),
        st.one_of(st.none(), st.sampled_from(["k1", "k2", "k3"])),
        st.sampled_from([b"a", b"b"]),
    ),
    max_size=40,
)


@given(WRITES)
@PROPERTY
def test_decide_over_random_writes_never_goes_back_or_applies_a_key_twice(
    writes: list[tuple[int, str | None, bytes]],
) -> None:
    """A tiny store model: the highest generation and the completed keys. Every admitted
    write completes before the next one is decided, as the per-job queue does."""
    highest: int | None = None
    keys: dict[str, KeyRecord] = {}
    admitted: list[int] = []
    admitted_keys: list[str] = []

    for generation, key, body in writes:
        fp = fingerprint("POST", "/billing/charges", body)
        w = FencedWrite("billing", "j", generation, key, fp if key else None)
        record = keys.get(key) if key else None
        result = decide(w, highest, record)

        if isinstance(result, Admit):
            assert record is None
            assert highest is None or generation >= highest
            if result.raise_to is not None:
                assert result.raise_to == generation
                highest = result.raise_to
            assert highest == generation
            admitted.append(generation)
            if key:
                admitted_keys.append(key)
                keys[key] = KeyRecord(KeyState.COMPLETED, fp, StoredResponse(200, (), body))
        elif isinstance(result, Replay):
            assert record is not None
            assert result.response == record.response
            assert result.response.body == body
        else:
            assert isinstance(result, StaleGeneration | KeyReused), result
            if isinstance(result, StaleGeneration):
                assert highest is not None
                assert generation < highest
            else:
                assert record is not None
                assert record.fingerprint != fp

    assert admitted == sorted(admitted)
    assert len(admitted_keys) == len(set(admitted_keys))


# --- fingerprint -----------------------------------------------------------------------

BASE = ("POST", "/billing/charges?x=1", b'{"amount": 5}')


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(("PUT", BASE[1], BASE[2]), id="method"),
        pytest.param((BASE[0], "/billing/charges?x=2", BASE[2]), id="query"),
        pytest.param((BASE[0], "/billing/charge", BASE[2]), id="path"),
        pytest.param((BASE[0], BASE[1], b'{"amount": 6}'), id="body"),
        pytest.param((BASE[0], BASE[1], b""), id="empty-body"),
        pytest.param((BASE[0], "/billing/charges?x=1" + '{"amount": 5}', b""), id="boundary"),
    ],
)
def test_fingerprint_differs_when_request_differs(other: tuple[str, str, bytes]) -> None:
    assert fingerprint(*other) != fingerprint(*BASE)


def test_fingerprint_equal_for_equal_requests() -> None:
    assert fingerprint(*BASE) == fingerprint(*BASE)
    assert fingerprint("DELETE", "/a/", b"") == fingerprint("DELETE", "/a/", b"")


def test_fingerprint_accepts_surrogate_escaped_path() -> None:
    assert fingerprint("POST", "/caf\udce9", b"") != fingerprint("POST", "/caf\u00e9", b"")


# Paths as the server hands them over: request-target bytes (never NUL) decoded as UTF-8
# with surrogateescape, or plain Unicode text.
RAW_PATHS = st.one_of(
    st.binary(max_size=8)
    .filter(lambda raw: b"\0" not in raw)
    .map(lambda raw: raw.decode("utf-8", "surrogateescape")),
    st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=8),
)
REQUESTS = st.tuples(
    st.sampled_from(["POST", "PUT", "PATCH", "DELETE"]), RAW_PATHS, st.binary(max_size=8)
)


@given(REQUESTS, REQUESTS)
@PROPERTY
def test_fingerprint_equal_exactly_when_requests_equal(
    a: tuple[str, str, bytes], b: tuple[str, str, bytes]
) -> None:
    assert (fingerprint(*a) == fingerprint(*b)) == (a == b)


# --- refusals --------------------------------------------------------------------------


def _subclasses(cls: type[Refusal]) -> list[type[Refusal]]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


ALL_REFUSALS = _subclasses(Refusal)
CONCRETE = [cls for cls in ALL_REFUSALS if "slug" in vars(cls)]


def test_every_leaf_refusal_has_a_problem_type() -> None:
    leaves = [cls for cls in ALL_REFUSALS if not cls.__subclasses__()]
    assert leaves
    assert all(cls in CONCRETE for cls in leaves), leaves


def test_every_refusal_in_errors_module_is_found() -> None:
    exported = {
        obj
        for name in errors.__all__
        if isinstance(obj := getattr(errors, name), type) and issubclass(obj, Refusal)
    }
    assert exported - {Refusal} == set(ALL_REFUSALS)


def test_refusal_slugs_are_distinct() -> None:
    slugs = [cls.slug for cls in CONCRETE]
    assert len(slugs) == len(set(slugs))


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda cls: cls.__name__)
def test_refusal_has_slug_status_and_title(cls: type[Refusal]) -> None:
    assert cls.slug
    assert cls.slug == cls.slug.strip().lower()
    assert 400 <= cls.status <= 599
    assert cls.title.strip()
    assert cls.type_uri() == PROBLEM_BASE + cls.slug


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda cls: cls.__name__)
def test_refusal_problem_is_rfc9457_object(cls: type[Refusal]) -> None:
    extensions: dict[str, Any] = {"job": "invoice-42"}
    problem = cls("a sentence for a person", **extensions).problem()
    assert problem == {
        "type": PROBLEM_BASE + cls.slug,
        "title": cls.title,
        "status": cls.status,
        "detail": "a sentence for a person",
        "job": "invoice-42",
    }
    assert problem["type"].startswith(PROBLEM_BASE)


def test_refusal_problem_carries_instance_when_given() -> None:
    problem = StaleGeneration("older").problem(instance="/billing/charges")
    assert problem["instance"] == "/billing/charges"
    assert "instance" not in StaleGeneration("older").problem()


def test_a_method_override_is_part_of_what_a_key_identifies() -> None:
    plain = fingerprint("GET", "/a", b"")
    overridden = fingerprint("GET", "/a", b"", "DELETE")
    assert overridden not in (plain, fingerprint("DELETE", "/a", b""))
    assert overridden != fingerprint("GET", "/a", b"", "PUT")
