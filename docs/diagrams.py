"""The state diagrams of this site, drawn from the tables the code runs on, so that a
picture cannot drift from the code. Each is written into its page between two
markers, as a Mermaid block:

    <!-- drawn from fenceproxy.fence.write.TRANSITIONS by docs/diagrams.py -->
    ```mermaid
    stateDiagram-v2
    ...
    ```
    <!-- end of the drawing -->

    python3 docs/diagrams.py           # redraw every diagram in its page
    python3 docs/diagrams.py --check   # redraw nothing; exit 1 naming each one out of date

tests/test_docs.py fails when a page's diagram is not what its tables draw now, and
when the package has a table named ``...TRANSITIONS`` that :data:`TABLES` does not
list. Docs tooling, run from the repository's root: nothing of the package imports it.

A table is a mapping ``(state, event) -> state``, as ``fenceproxy.fence.write.TRANSITIONS``
is: states and events are enum members (shown by their value when it is a string, else
their name) or strings. The first row's state is where the machine starts, unless
its :class:`Drawing` names where. A state with no move to another state is final: its
moves to itself are drawn as its end, an arrow to Mermaid's ``[*]``. The events that
move one state to the same other share an arrow, and an event that moves every state
but the final ones to one same state (a connection lost) is drawn once, from a box
"any state". A second table, ``state -> detail``, may add lines to states' boxes, as
``fenceproxy.fence.write.SETTLING`` does to the final ones: a detail that is a
dataclass gives a line per field (``key completed``; a true flag its name, a false or
empty one nothing), any other its text.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

DOCS = Path(__file__).resolve().parent


class Drawing(NamedTuple):
    page: str
    """The page, in docs/, that shows the diagram between its markers."""
    details: str | None = None
    """The dotted name of a table of lines to add to states' boxes, if any."""
    starts: tuple[str, ...] = ()
    """The dotted names of the states it starts from (none: the first row's)."""
    direction: str = "LR"
    """Mermaid's: LR, left to right, or TB, top to bottom."""


_CONNECTION = "fenceproxy.http.connection_states"

TABLES = {
    "fenceproxy.fence.write.TRANSITIONS": Drawing(
        "fenced-write-states.md", details="fenceproxy.fence.write.SETTLING"
    ),
    f"{_CONNECTION}.TRANSITIONS": Drawing(
        "development.md",
        starts=(f"{_CONNECTION}.READING_STARTS", f"{_CONNECTION}.ANSWERING_STARTS"),
        direction="TB",
    ),
}
"""Each table drawn, by its dotted name, and where. A table not yet drawn is one entry
here and its two markers on its page (:data:`BEGIN`, :data:`END`, nothing between
them), then ``python3 docs/diagrams.py``."""

BEGIN = "<!-- drawn from {} by docs/diagrams.py -->"
END = "<!-- end of the drawing -->"

Table = Mapping[tuple[Any, Any], Any]
ANY = "ANY_STATE"
"""The box an event that moves every state alike is drawn from."""


def load(name: str) -> Any:
    """What a dotted name names: ImportError or AttributeError when there is none."""
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def state_diagram(
    table: Table,
    details: Mapping[Any, Any] | None = None,
    starts: Sequence[Any] = (),
    direction: str = "LR",
) -> str:
    """The Mermaid state diagram of ``table``, from ``starts`` (the first row's state
    when none), with ``details`` in the boxes of their states; ValueError when it has
    no rows, or a detail is of a state it does not have."""
    if not table:
        raise ValueError("a table with no rows draws nothing")
    states: dict[str, str] = {}  # id: label, in the order the table meets them
    for (source, _), target in table.items():
        for state in (source, target):
            states.setdefault(_id(state), _label(state))
    final = set(states) - {_id(source) for (source, _), target in table.items() if target != source}
    anywhere = _anywhere(table, set(states) - final)
    arrows: dict[tuple[str, str], list[str]] = {}
    for (source, event), target in table.items():
        if event not in anywhere:
            end = "[*]" if _id(source) in final else _id(target)  # a final state's loop ends it
            arrows.setdefault((_id(source), end), []).append(_label(event))
    lines = ["stateDiagram-v2", f"    direction {direction}"]
    lines += [f'    state "{label}" as {id_}' for id_, label in states.items()]
    lines += [f"    [*] --> {_id(state)}" for state in starts or [next(iter(table))[0]]]
    lines += [f"    {s} --> {t}: {', '.join(events)}" for (s, t), events in arrows.items()]
    lines += [f"    {id_} --> [*]" for id_ in states if id_ in final and (id_, "[*]") not in arrows]
    if anywhere:
        lines.append(f'    state "any state" as {ANY}')
        lines += [f"    {ANY} --> {_id(target)}: {_label(e)}" for e, target in anywhere.items()]
    for state, detail in (details or {}).items():
        if _id(state) not in states:
            raise ValueError(f"a detail of {_label(state)}, which the table does not have")
        lines += [f"    {_id(state)}: {line}" for line in _lines(detail)]
    return "\n".join(lines) + "\n"


def _anywhere(table: Table, moving: set[str]) -> dict[Any, Any]:
    """The events that move every state but the final ones (two at least), all to one
    state: each is drawn once, from any state."""
    moves: dict[Any, dict[str, Any]] = {}
    for (source, event), target in table.items():
        moves.setdefault(event, {})[_id(source)] = target
    return {
        event: next(iter(targets.values()))
        for event, targets in moves.items()
        if len(moving) > 1
        and moving <= set(targets)
        and len({_id(target) for target in targets.values()}) == 1
    }


def _label(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value if isinstance(value.value, str) else value.name
    return str(value).replace('"', "'")


def _id(value: Any) -> str:
    name = value.name if isinstance(value, enum.Enum) else str(value)
    return re.sub(r"\W", "_", name)


def _lines(detail: Any) -> list[str]:
    """A detail's lines in its state's box."""
    if not dataclasses.is_dataclass(detail):
        return [_label(detail)]
    lines = []
    for field in dataclasses.fields(detail):
        value = getattr(detail, field.name)
        if value is True:
            lines.append(field.name)
        elif value is not False and value is not None:
            lines.append(f"{field.name} {_label(value)}")
    return lines


def drawn(name: str) -> str:
    """The diagram of the table ``name``, between its markers (the end marker left out)."""
    drawing = TABLES[name]
    details = load(drawing.details) if drawing.details else None
    starts = [load(start) for start in drawing.starts]
    diagram = state_diagram(load(name), details, starts, drawing.direction)
    return f"{BEGIN.format(name)}\n```mermaid\n{diagram}```\n"


def redraw(text: str, name: str) -> str:
    """``text``, a page, with the diagram of the table ``name`` drawn as it is now
    between its markers; ValueError when the page has not both, in order."""
    begin = BEGIN.format(name)
    start = text.find(begin)
    end = text.find(END, start) if start >= 0 else -1
    if end < 0:
        raise ValueError(f"no place for {name}'s diagram: write {begin} and {END}")
    return text[:start] + drawn(name) + text[end:]


def out_of_date(write: bool) -> list[str]:
    """The pages whose diagrams are not what their tables draw, each redrawn when
    ``write``."""
    stale = []
    for name, drawing in TABLES.items():
        path = DOCS / drawing.page
        text = path.read_text()
        now = redraw(text, name)
        if now != text:
            stale.append(f"docs/{drawing.page}: the diagram of {name}")
            if write:
                path.write_text(now)
    return stale


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python3 docs/diagrams.py [--check]", file=sys.stderr)
        return 2
    stale = out_of_date(write=not check)
    for page in stale:
        print(f"{page}: {'out of date' if check else 'redrawn'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(DOCS.parent))  # the package of this checkout
    sys.exit(main(sys.argv[1:]))
