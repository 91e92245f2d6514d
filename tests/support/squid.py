"""Debian's squid as a real egress proxy for the tests: a private instance on a free loopback
port, its own configuration, logs and names in a temporary folder, stopped by the test.

``hosts`` are names only squid can resolve (its own hosts file): a request for one of them
that reaches its upstream can only have gone through squid. ``users`` turns on Basic
authentication (squid's basic_ncsa_auth helper): every request then needs credentials.
``.ci/run`` installs squid.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import services

SQUID = shutil.which("squid") or "/usr/sbin/squid"
NCSA_AUTH = "/usr/lib/squid/basic_ncsa_auth"


class Squid:
    def __init__(self, *, hosts: dict[str, str] | None = None, users: dict[str, str] | None = None):
        self.port = services.free_port()
        self.users = users or {}
        # not under pytest's tmp_path: squid drops root for the `proxy` user, which must reach it
        self.folder = Path(tempfile.mkdtemp(prefix="idemproxy-squid-"))
        self.folder.chmod(0o755)
        self.hosts = hosts or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_as(self, user: str, password: str) -> str:
        return f"http://{user}:{password}@127.0.0.1:{self.port}"

    def _config(self) -> str:
        f = self.folder
        lines = [f"http_port 127.0.0.1:{self.port}", f"pid_filename {f}/squid.pid",
                 f"access_log stdio:{f}/access.log", f"cache_log {f}/cache.log", "cache_store_log none",
                 f"coredump_dir {f}", "cache deny all", "cache_mem 8 MB", "pinger_enable off",
                 "visible_hostname idemproxy-test", f"hosts_file {f}/hosts", "shutdown_lifetime 0 seconds",
                 # loopback only: the tests' upstreams, and nothing else
                 "acl loopback dst 127.0.0.0/8", "http_access deny !loopback"]
        if self.users:
            lines += [f"auth_param basic program {NCSA_AUTH} {f}/passwd",
                      "auth_param basic children 2 startup=1 idle=1", "auth_param basic realm idemproxy-test",
                      "acl users proxy_auth REQUIRED", "http_access allow users"]
        else:
            lines.append("http_access allow localhost")
        lines.append("http_access deny all")
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 15.0) -> "Squid":
        (self.folder / "hosts").write_text("".join(f"{ip} {name}\n" for name, ip in self.hosts.items()))
        if self.users:
            hashed = [subprocess.run(["openssl", "passwd", "-apr1", password], check=True, capture_output=True,
                                     text=True).stdout.strip() for password in self.users.values()]
            (self.folder / "passwd").write_text("".join(f"{user}:{h}\n" for user, h in zip(self.users, hashed)))
        (self.folder / "squid.conf").write_text(self._config())
        if os.geteuid() == 0:
            owner = pwd.getpwnam("proxy")
            for path in [self.folder, *self.folder.iterdir()]:
                os.chown(path, owner.pw_uid, owner.pw_gid)
        # -N: in the foreground, ours to stop; -n: a service name of its own, so two never meet
        self.proc = subprocess.Popen([SQUID, "-N", "-n", f"idemtest{self.port}", "-f", str(self.folder / "squid.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"squid exited: {self._log_tail()}")
            if services.reachable(self.url, 0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"squid did not start: {self._log_tail()}")

    def _log_tail(self) -> str:
        log = self.folder / "cache.log"
        return log.read_text()[-3000:] if log.exists() else "(no cache.log)"

    def access_log(self) -> list[str]:
        """The requests squid has finished, one line each: method, URL (absolute-form, or the
        CONNECT authority), the user it authenticated (``-`` for none), its status."""
        log = self.folder / "access.log"
        if not log.exists():
            return []
        return [f"{f[5]} {f[6]} {f[7]} {f[3].rsplit('/', 1)[-1]}"
                for f in (line.split() for line in log.read_text().splitlines())
                if len(f) > 7 and f[5] != "-"]  # (not the start-up probe's empty connection)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # killed: it keeps nothing worth a clean stop (no cache, unbuffered logs), and a
            # clean stop takes 2 s whatever shutdown_lifetime says; its auth helper leaves
            # when its stdin closes
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
