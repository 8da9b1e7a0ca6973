"""Each store's schema, one SQL file per version (``postgresql/001.sql`` ...,
``sqlite/003.sql`` ...), shipped with the package as data. A store applies the files
above its version in order, in one transaction
(:meth:`~fenceproxy.store.base.Store._migrations_after`), as they are: nothing in
them is substituted. SQLite's are run statement by statement, split at each ``;``,
so no ``;`` may appear in their comments or strings.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable

__all__ = ["SCHEMAS", "read_migrations"]

SCHEMAS = resources.files(__name__)
"""The folder of each store's files: ``postgresql/`` and ``sqlite/``."""

_NAME = re.compile(r"([0-9]{3})\.sql", re.ASCII)


def read_migrations(folder: Traversable) -> dict[int, str]:
    """Each schema version in ``folder`` and its statements, by version. ValueError
    for a ``.sql`` file not named by its version (``004.sql``): it would never be
    applied."""
    migrations = {}
    for file in folder.iterdir():
        if not file.name.endswith(".sql"):
            continue
        named = _NAME.fullmatch(file.name)
        if named is None:
            raise ValueError(f"the migration {file.name!r} is not named by its version (004.sql)")
        migrations[int(named[1])] = file.read_text(encoding="utf-8")
    return dict(sorted(migrations.items()))
