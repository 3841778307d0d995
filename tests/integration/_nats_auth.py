"""Helpers for the secured-server tests: a nats-server with a given config, nkeys,
operator/account/user JWTs (signed here with nkeys) and TLS certificates (openssl)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path

import nkeys

from rftstream.nats_server.embedded import find_nats_server, free_port


class ConfiguredNats:
    """A nats-server on a free loopback port with JetStream and ``body`` (auth, tls,
    accounts) in its config. Blocks in :meth:`start` until the log says it is ready."""

    def __init__(self, tmp: Path, body: str, *, scheme: str = "nats") -> None:
        self.dir = tmp
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = tmp / "server.log"
        store = tmp / "js"
        self.conf = tmp / "server.conf"
        self.conf.write_text(
            f'listen: 127.0.0.1:{self.port}\njetstream {{ store_dir: "{store}" }}\n' + body + "\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ConfiguredNats:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [find_nats_server(), "-c", str(self.conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited:\n{self.log.read_text()[-3000:]}")
            if "Server is ready" in self.log.read_text(errors="replace"):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"nats-server not ready:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def new_key(prefix: int) -> nkeys.KeyPair:
    """A fresh nkey pair of the kind ``prefix`` (nkeys.PREFIX_BYTE_USER, ...)."""
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def sign_jwt(claims: dict[str, object], issuer: nkeys.KeyPair) -> str:
    """A NATS JWT: header ``{"typ":"JWT","alg":"ed25519-nkey"}``, claims, ed25519
    signature by ``issuer`` over ``header.claims`` (all base64url, unpadded)."""
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    sig = issuer.sign(f"{header}.{body}".encode())
    return f"{header}.{body}.{_b64(sig)}"


def _claims(sub: str, iss: str, name: str, nats: dict[str, object]) -> dict[str, object]:
    return {
        "jti": _b64(os.urandom(16)),
        "iat": int(time.time()),
        "iss": iss,
        "name": name,
        "sub": sub,
        "nats": {**nats, "version": 2},
    }


def operator_jwt(op: nkeys.KeyPair) -> str:
    pub = op.public_key.decode()
    return sign_jwt(_claims(pub, pub, "op", {"type": "operator"}), op)


def account_jwt(acc: nkeys.KeyPair, op: nkeys.KeyPair, name: str, *, jetstream: bool = True) -> str:
    """An account, with JetStream (unlimited memory and disk storage) or without."""
    limits = {
        "subs": -1,
        "data": -1,
        "payload": -1,
        "imports": -1,
        "exports": -1,
        "wildcards": True,
        "conn": -1,
        "leaf": -1,
    }
    js = -1 if jetstream else 0
    limits |= {"mem_storage": js, "disk_storage": js, "streams": js, "consumer": js}
    nats = {"type": "account", "limits": limits, "default_permissions": {"pub": {}, "sub": {}}}
    return sign_jwt(_claims(acc.public_key.decode(), op.public_key.decode(), name, nats), op)


def user_creds(user: nkeys.KeyPair, acc: nkeys.KeyPair, path: Path) -> Path:
    """A .creds file for ``user`` in account ``acc`` (JWT signed by the account)."""
    nats = {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
    jwt = sign_jwt(_claims(user.public_key.decode(), acc.public_key.decode(), "u", nats), acc)
    path.write_text(
        "-----BEGIN NATS USER JWT-----\n" + jwt + "\n------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        + user.seed.decode()
        + "\n------END USER NKEY SEED------\n"
    )
    return path


def make_ca(tmp: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA (cert, key)."""
    cert, key = tmp / f"{name}.pem", tmp / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def make_cert(tmp: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    """A certificate (cert, key) signed by ``ca`` with the extensions ``ext``."""
    cert, key, csr, extfile = (tmp / f"{name}{s}" for s in (".pem", ".key", ".csr", ".ext"))
    extfile.write_text(ext + "\n")
    subprocess.run(
        [
            "openssl",
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(csr),
            "-subj",
            f"/CN={name}",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca[0]),
            "-CAkey",
            str(ca[1]),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "1",
            "-extfile",
            str(extfile),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
