"""Certificates for the tests, made by a certificate authority of each test's own
(trustme): no key material is kept in the tree."""

from __future__ import annotations

import datetime
from pathlib import Path

import trustme

__all__ = ["Certificates", "write_pair"]


def write_pair(cert: trustme.LeafCert, folder: Path, name: str) -> tuple[Path, Path]:
    """``cert``'s chain and key as ``name.pem`` and ``name-key.pem`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    chain, key = folder / f"{name}.pem", folder / f"{name}-key.pem"
    cert.private_key_pem.write_to_path(str(key))
    for n, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(chain), append=n > 0)
    key.chmod(0o600)
    return chain, key


class Certificates:
    """A certificate authority and what it signs, written under ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = trustme.CA()
        folder.mkdir(parents=True, exist_ok=True)
        self.ca_file = folder / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))

    def server(
        self,
        name: str = "server",
        hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
        not_after: datetime.datetime | None = None,
        not_before: datetime.datetime | None = None,
    ) -> tuple[Path, Path]:
        """A server certificate for ``hosts``: its chain and key files."""
        leaf = self.ca.issue_cert(*hosts, not_after=not_after, not_before=not_before)
        return write_pair(leaf, self.folder, name)

    def client(self, common_name: str, name: str | None = None) -> tuple[Path, Path]:
        """A client certificate whose subject's CN is ``common_name``."""
        leaf = self.ca.issue_cert(f"{common_name}.clients.test", common_name=common_name)
        return write_pair(leaf, self.folder, name or common_name)
