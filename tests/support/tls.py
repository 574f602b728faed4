"""A throwaway PKI for TLS tests, made with the ``openssl`` command line (the ``cryptography``
package is not installed here): a CA, a server certificate for 127.0.0.1/localhost and a client
certificate signed by it, and a second, unrelated CA (what a client that does not trust our CA
holds)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_pki"]


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed none of the above."""


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make test certificates")
    subprocess.run([openssl, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl(
        *("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}"),
        *(
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ),
        *("-keyout", f"{name}.key", "-out", f"{name}.crt"),
        cwd=d,
    )


def _signed(d: Path, name: str, ext: str) -> None:
    _openssl(
        *("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}"),
        *("-keyout", f"{name}.key", "-out", f"{name}.csr"),
        cwd=d,
    )
    (d / f"{name}.ext").write_text(ext, encoding="utf-8")
    _openssl(
        *(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
        ),
        *("-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt"),
        cwd=d,
    )


def make_pki(directory: Path) -> Pki:
    """Write the CA, server, client and other-CA files into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    _signed(
        directory,
        "server",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    _signed(directory, "client", "extendedKeyUsage=clientAuth\n")
    return Pki(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
        other_ca=directory / "other-ca.crt",
    )
