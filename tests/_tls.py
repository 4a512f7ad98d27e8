"""Throwaway PKI for TLS tests, made with the `openssl` CLI: a CA and leaf certificates it signs."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

SAN = "IP:127.0.0.1,DNS:localhost,DNS:pdserve-internal"


@dataclass(frozen=True)
class Leaf:
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


class Pki:
    """`ca.pem` plus leaves; every leaf may serve and be a client (pdserve processes are both)."""

    def __init__(self, root: Path, name: str = "ca"):
        if shutil.which("openssl") is None:
            pytest.skip("the openssl CLI makes the test certificates")
        self.dir = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca = root / f"ca-{name}.pem"
        self._ca_key = root / f"ca-{name}.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", self._ca_key.name, "-out", self.ca.name, "-days", "2", "-subj", f"/CN=pdserve test {name}",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                 cwd=root)

    def leaf(self, name: str, san: str = SAN) -> Leaf:
        key, csr, cert = (self.dir / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key.name,
                 "-out", csr.name, "-subj", f"/CN={name}", cwd=self.dir)
        ext = self.dir / f"{name}.ext"
        ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
                       "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n")
        _openssl("x509", "-req", "-in", csr.name, "-CA", self.ca.name, "-CAkey", self._ca_key.name,
                 "-CAcreateserial", "-out", cert.name, "-days", "2", "-extfile", ext.name, cwd=self.dir)
        return Leaf(cert, key)
