"""The tests. The helper modules beside them (``postgres.py``, ``nginx.py``, ...) are
not test modules: their asserts are rewritten as the test modules' are, so that their
checks hold under ``python -O`` too."""

from pathlib import Path

import pytest

pytest.register_assert_rewrite(
    *(
        f"{__name__}.{path.stem}"
        for path in Path(__file__).parent.glob("*.py")
        if not path.stem.startswith(("test_", "conftest", "__"))
    )
)
