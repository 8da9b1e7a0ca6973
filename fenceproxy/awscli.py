"""The AWS CLI's plugin: every S3 request the CLI sends carries the fencing fields of
the lease it runs under, and a request the proxy refuses fails at once, saying why.

Enabled in the CLI's own config file (``~/.aws/config``, or the one
``AWS_CONFIG_FILE`` names), as its plugin mechanism expects::

    [plugins]
    fenceproxy = fenceproxy.awscli
    cli_legacy_plugin_path = /opt/fenceproxy-plugin

``cli_legacy_plugin_path`` is AWS CLI v2's (its own Python, which imports plugins
from that folder: ``pip install --no-deps --target /opt/fenceproxy-plugin
fenceproxy``); v1 takes every key there for a plugin, and fails on that one.

A job runs under a lease: ``fenceproxy run JOB -- aws s3 cp ...``. The fields come from
the environment ``fenceproxy run`` sets: ``FENCING_JOB`` and ``FENCING_TOKEN``, sent
under the names ``FENCING_JOB_HEADER`` and ``FENCING_TOKEN_HEADER`` give
(``Fencing-Job`` and ``Fencing-Token`` when unset), with an ``Idempotency-Key`` made
once per call, so botocore's retries of a call send the same key and a write whose
answer was lost is answered from its first attempt, not applied twice. All three are
added before botocore signs the request: SigV4 covers them, and an S3 server that
checks signatures refuses a request whose fields were changed on the way. Without
``FENCING_TOKEN`` nothing is added (a write through the proxy then gets its 428).

A refusal of the proxy (an RFC 9457 problem) becomes the CLI's error, with the
problem's kind as its code and its detail as its message: ``An error occurred
(stale-generation) when calling the PutObject operation: ...``, and the CLI exits
non-zero. botocore sends again only what it sends again anyway (a 502, 503 or 504):
with the key, a write sent again is not applied twice.

Only the standard library and :mod:`fenceproxy.errors` are imported: AWS CLI v2
runs its own Python, with none of fenceproxy's dependencies.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from .errors import PROBLEM_BASE

__all__ = ["awscli_initialize", "fencing_fields"]

KEY_HEADER = "Idempotency-Key"

_FIELDS = (
    ("FENCING_JOB", "FENCING_JOB_HEADER", "Fencing-Job"),
    ("FENCING_TOKEN", "FENCING_TOKEN_HEADER", "Fencing-Token"),
)
"""Each field: the variable holding its value, the one naming its header, the name
used when that one is unset."""


def fencing_fields(environ: Mapping[str, str]) -> dict[str, str]:
    """The fencing fields ``fenceproxy run`` put in ``environ``, by header name;
    empty without a token."""
    if not environ.get("FENCING_TOKEN"):
        return {}
    return {
        environ.get(header) or default: environ[value]
        for value, header, default in _FIELDS
        if environ.get(value)
    }


def awscli_initialize(cli: Any) -> None:
    """Called by the AWS CLI with its session's event emitter before any client is made;
    the handlers hold for every S3 client of the command."""
    import os

    fields = fencing_fields(os.environ)

    def fence(params: dict[str, Any], **_: Any) -> None:
        if fields:  # a call's key is made once: its retries reuse the signed request's
            params["headers"].update({**fields, KEY_HEADER: uuid.uuid4().hex})

    cli.register("before-call.s3", fence)
    cli.register("after-call.s3", _explain)


def _explain(http_response: Any, parsed: dict[str, Any], **_: Any) -> None:
    """The proxy's refusal as the error botocore raises: its kind and its detail, in
    place of what botocore read (nothing: the problem is JSON, not S3's XML)."""
    if http_response.status_code < 400:
        return
    content_type = http_response.headers.get("Content-Type", "")
    if not content_type.startswith("application/problem+json"):
        return
    try:
        problem = json.loads(http_response.content)
    except ValueError:
        return
    kind = problem.get("type") if isinstance(problem, dict) else None
    if isinstance(kind, str) and kind.startswith(PROBLEM_BASE):
        message = problem.get("detail") or problem.get("title") or ""
        parsed["Error"] = {"Code": kind.removeprefix(PROBLEM_BASE), "Message": str(message)}
