"""nginx as the reference for how an upstream reads a request path.

:func:`resolve_like_nginx` is a model of what nginx makes of a path before it routes
(its ``$uri``): every escape decoded, ``%2F`` included, slashes merged, then dot
segments resolved; a malformed escape, an encoded NUL or a climb above the root is
refused. :class:`Nginx` is the real thing, echoing ``$uri``, so the model can be
held against it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["NGINX", "Nginx", "resolve_like_nginx", "temp_paths"]

NGINX = shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))
_HEX = b"0123456789abcdefABCDEF"


def resolve_like_nginx(target: bytes) -> bytes | None:
    """The decoded path nginx routes a request path to, or None where it answers 400."""
    decoded = bytearray()
    i = 0
    while i < len(target):
        if target[i] == ord("%"):
            digits = target[i + 1 : i + 3]
            if len(digits) != 2 or any(d not in _HEX for d in digits):
                return None
            if (byte := int(digits, 16)) == 0:
                return None
            decoded.append(byte)
            i += 3
        else:
            decoded.append(target[i])
            i += 1
    segments = bytes(decoded).split(b"/")[1:]
    out: list[bytes] = []
    for n, segment in enumerate(segments):
        if segment == b"..":
            if not out:
                return None
            out.pop()
        elif segment not in (b"", b"."):
            out.append(segment)
            continue
        if n == len(segments) - 1:
            out.append(b"")
    return b"/" + b"/".join(out)


def temp_paths(directory: Path) -> str:
    """nginx directives that keep its temporary files in ``directory``, not in the
    system's folders (which a run as another user may not write)."""
    return " ".join(
        f"{kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )


class Nginx:
    """A real nginx on loopback whose every location answers ``200`` with ``$uri``."""

    def __init__(self, directory: Path) -> None:
        assert NGINX is not None
        self.directory = directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        temp = temp_paths(directory)
        (directory / "nginx.conf").write_text(
            "daemon off; master_process off; worker_processes 1;\n"
            f"pid {directory / 'nginx.pid'}; error_log {directory / 'error.log'};\n"
            "events { worker_connections 64; }\n"
            f"http {{ access_log off; {temp}\n"
            f"  server {{ listen 127.0.0.1:{self.port};\n"
            '    location / { default_type text/plain; return 200 "$uri"; } } }\n'
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Nginx:
        self.process = subprocess.Popen(
            [NGINX, "-c", str(self.directory / "nginx.conf"), "-p", str(self.directory)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"nginx did not start: {(self.directory / 'error.log').read_text()}"
                    ) from None
                time.sleep(0.01)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def uri(self, target: bytes) -> bytes | None:
        """nginx's ``$uri`` for a request to ``target``; None where it answers 400."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"GET " + target + b" HTTP/1.0\r\nHost: reference\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        status = answer[9:12]
        if status == b"400":
            return None
        assert status == b"200", answer[:200]
        return answer.split(b"\r\n\r\n", 1)[1]
