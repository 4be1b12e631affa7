"""A git forge's HTTPS origin on loopback, for the tests: ``git http-backend`` (git's own smart-HTTP server)
behind TLS with a self-signed certificate and HTTP basic authentication that takes one token (as the
user or as the password, as forges take access tokens). Every request it answered or refused is counted."""

from __future__ import annotations

import base64
import os
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class GitHTTPS:
    def __init__(self, root: Path, token: str):
        self.root, self.token = Path(root), token
        self.root.mkdir(parents=True, exist_ok=True)
        self.cert, key = self.root / "cert.pem", self.root / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(self.cert), "-days", "2",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        self.cert.chmod(0o644)  # the worker's user trusts it, as a box trusts its forge's CA
        self.refused = self.answered = 0
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self._git()

            def do_POST(self):
                self._git()

            def _authorized(self) -> bool:
                auth = self.headers.get("Authorization", "")
                if not auth.startswith("Basic "):
                    return False
                user, _, password = base64.b64decode(auth[6:]).decode(errors="replace").partition(":")
                return srv.token in (user, password)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _git(self):
                body = self._body()
                if not self._authorized():
                    srv.refused += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="forge"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                srv.answered += 1
                path, _, query = self.path.partition("?")
                env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(srv.root), "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
                       "QUERY_STRING": query, "REQUEST_METHOD": self.command, "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                       "CONTENT_LENGTH": str(len(body)), "REMOTE_USER": "forge-user", "REMOTE_ADDR": "127.0.0.1",
                       "GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
                if self.headers.get("Content-Encoding"):
                    env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
                r = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True)
                sep = b"\r\n\r\n" if b"\r\n\r\n" in r.stdout else b"\n\n"
                head, _, rest = r.stdout.partition(sep)
                status, headers = 200, []
                for line in head.decode(errors="replace").splitlines():
                    k, _, v = line.partition(":")
                    if k.lower() == "status":
                        status = int(v.split()[0])
                    elif k:
                        headers.append((k, v.strip()))
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(rest)))
                self.end_headers()
                self.wfile.write(rest)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.cert), str(key))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="git-https").start()

    def bare(self, name: str) -> str:
        """A new empty repository; its URL (no credentials)."""
        subprocess.run(["git", "init", "-q", "--bare", "--initial-branch=main", str(self.root / f"{name}.git")], check=True)
        subprocess.run(["git", "config", "-f", str(self.root / f"{name}.git" / "config"), "http.receivepack", "true"], check=True)
        return f"https://127.0.0.1:{self.port}/{name}.git"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
