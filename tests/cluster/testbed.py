"""A multi-host testbed on one Linux box: N network namespaces on one bridge (needs root).

    tp-hi [tp-hi-v 10.213.0.i/24] <-veth-> [tp-hi-br] tp-br0 [10.213.0.254/24]  (root namespace)

All hosts share one L2 segment, so no routing or ip_forward is needed; hosts get no default route,
so they can reach only the testbed. `rate_limit` uses `tc tbf` on both ends of the host's link;
`add_delay` puts a userspace delay line (see delayline.py) between the host and the bridge.
Only names starting with the prefix and addresses in 10.213.0.0/16 are ever created or deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DELAYLINE = Path(__file__).with_name("delayline.py")
SAFE_RANGE = "10.213."


@dataclass(frozen=True, slots=True)
class Host:
    index: int
    ip: str
    netns: str
    veth: str  # the host's interface, inside netns
    port: str  # the peer end, on the bridge until a delay line takes its place


def _ip(*args: str) -> str:
    return _sh("ip", *args)


def _sh(*argv: str, check: bool = True) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)!r} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _pdeathsig() -> None:
    # Runs in the child before exec: the kernel kills it if the test process dies first.
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)


def _kill_group(proc: subprocess.Popen, grace: float = 2.0) -> None:
    if proc.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream:
            stream.close()


def available() -> str | None:
    """None when the testbed can run here, else the reason it cannot."""
    if sys.platform != "linux":
        return "the testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the testbed needs root (ip netns, veth, bridge, tc)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "the testbed needs iproute2 (`ip` and `tc`)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` does not work here: {r.stderr.strip()}"
    return None


def _names(prefix: str) -> tuple[list[str], list[str]]:
    namespaces = [ln.split()[0] for ln in _ip("netns", "list").splitlines() if ln.strip()]
    links = [ln.split()[0].split("@")[0] for ln in _ip("-br", "link").splitlines() if ln.strip()]
    return [n for n in namespaces if n.startswith(prefix)], [
        n for n in links if n.startswith(prefix)
    ]


def down(prefix: str = "tp-") -> None:
    """Remove every namespace and root-namespace link named with `prefix`; safe to repeat.

    Processes still inside those namespaces (e.g. from a crashed run) are killed first.
    """
    if len(prefix) < 3:
        raise ValueError(f"prefix {prefix!r} is too short to be safely ours; use e.g. 'tp-'")
    namespaces, links = _names(prefix)
    for ns in namespaces:
        for pid in _sh("ip", "netns", "pids", ns, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in namespaces:
        _sh("ip", "netns", "del", ns, check=False)
    for link in links:
        # Deleting one veth end removes its peer too, so a later name may already be gone.
        _sh("ip", "link", "del", link, check=False)


class Testbed:
    """N namespaced hosts on one bridge; use as a context manager so teardown always runs."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, n_hosts: int, prefix: str = "tp-", subnet: str = "10.213.0") -> None:
        if not 1 <= n_hosts <= 99:
            raise ValueError(f"n_hosts={n_hosts} must be in 1..99 (interface names are short)")
        if not subnet.startswith(SAFE_RANGE) or subnet.count(".") != 2:
            raise ValueError(f"subnet {subnet!r} must be a /24 like '10.213.0' (our own range)")
        if len(prefix) > 5:
            raise ValueError(
                f"prefix {prefix!r} is too long: names like {prefix}h99-br must fit 15"
            )
        self.n_hosts, self.prefix, self.subnet = n_hosts, prefix, subnet
        self.bridge = f"{prefix}br0"
        self.gateway = f"{subnet}.254"
        self._hosts = {
            i: Host(i, f"{subnet}.{i}", f"{prefix}h{i}", f"{prefix}h{i}-v", f"{prefix}h{i}-br")
            for i in range(1, n_hosts + 1)
        }
        self._procs: list[subprocess.Popen] = []
        self._delays: dict[int, subprocess.Popen] = {}
        self._rates: dict[int, str] = {}
        self._spliced: set[int] = set()  # hosts whose link runs through a delay namespace
        self._lock: int | None = None

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Testbed:
        # One testbed per prefix at a time: a second one waits instead of tearing the first down.
        lock_dir = "/run/lock" if os.path.isdir("/run/lock") else "/tmp"
        lock_path = f"{lock_dir}/thunderpool-testbed-{self.prefix}lock"
        self._lock = os.open(lock_path, os.O_CREAT | os.O_RDWR)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        down(self.prefix)  # leftovers of a crashed earlier run
        br = self.bridge
        _ip("link", "add", br, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("link", "set", br, "addrgenmode", "none")
        _ip("addr", "add", f"{self.gateway}/24", "dev", br)
        _ip("link", "set", br, "up")
        for h in self._hosts.values():
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", h.port)
            _ip("link", "set", h.veth, "netns", h.netns)
            _ip("link", "set", h.port, "addrgenmode", "none")
            _ip("link", "set", h.port, "master", br, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.veth)
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "link", "set", h.veth, "up")
        return self

    def down(self) -> None:
        """Kill tracked processes, then remove everything with our prefix; idempotent."""
        for proc in [*self._delays.values(), *self._procs]:
            _kill_group(proc)
        self._procs.clear()
        self._delays.clear()
        self._rates.clear()
        self._spliced.clear()
        down(self.prefix)
        if self._lock is not None:
            os.close(self._lock)  # also releases the flock
            self._lock = None

    def release(self) -> None:
        """Leave the testbed up and stop tracking it (the CLI's `--detach`); `down()` removes it."""
        self._procs.clear()
        self._delays.clear()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    # --- hosts and processes ---------------------------------------------------------------

    def host(self, i: int) -> Host:
        try:
            return self._hosts[i]
        except KeyError:
            raise ValueError(f"host {i} does not exist; hosts are 1..{self.n_hosts}") from None

    @property
    def hosts(self) -> list[Host]:
        return list(self._hosts.values())

    def exec_cmd(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.host(i).netns, *argv]

    def run(
        self, i: int, argv: list[str], timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """Run to completion inside host i; raises on a non-zero exit."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.exec_cmd(i, argv), timeout=timeout, check=True, **kw)

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start a process inside host i; it and its group are killed at teardown."""
        proc = subprocess.Popen(
            self.exec_cmd(i, argv), start_new_session=True, preexec_fn=_pdeathsig, **kw
        )
        self._procs.append(proc)
        return proc

    # --- link shaping ----------------------------------------------------------------------

    def rate_limit(self, i: int, rate: str = "10mbit") -> None:
        """Token-bucket limit `rate` (tc syntax) on host i's link, in both directions."""
        h = self.host(i)
        tbf = ["tbf", "rate", rate, "burst", "32kb", "latency", "100ms"]
        _sh(*self.exec_cmd(i, ["tc", "qdisc", "replace", "dev", h.veth, "root", *tbf]))
        _sh("tc", "qdisc", "replace", "dev", self._bridge_port(i), "root", *tbf)
        self._rates[i] = rate

    def limit_between(self, islands: list[tuple[int, ...]], rate: str) -> None:
        """Traffic between hosts of different islands limited to `rate`, none inside one: each
        host's egress to the other islands' addresses goes through an htb class picked by a u32
        filter on the destination (this kernel has htb and tbf but no prio qdisc)."""
        for island in islands:
            others = [j for other in islands if other != island for j in other]
            for i in island:
                dev = self.host(i).veth
                tc = lambda *argv, i=i: _sh(*self.exec_cmd(i, ["tc", *argv]))  # noqa: E731
                tc("qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
                tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10",
                   "htb", "rate", "10gbit")  # fmt: skip
                tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:30",
                   "htb", "rate", rate, "ceil", rate)  # fmt: skip
                for j in others:
                    tc("filter", "add", "dev", dev, "protocol", "ip", "parent", "1:0", "prio",
                       "1", "u32", "match", "ip", "dst", f"{self.host(j).ip}/32",
                       "flowid", "1:30")  # fmt: skip

    def add_delay(self, i: int, ms: float, *, detach: bool = False) -> None:
        """Delay every frame to and from host i by `ms` (so its RTT grows by 2 * ms).

        Calling it again changes the delay. `detach=True` lets the delay line outlive this
        process (for `scripts/testbed up --detach`); `down()` still kills it.
        """
        h, ns = self.host(i), f"{self.prefix}d{i}"
        if old := self._delays.pop(i, None):
            _kill_group(old)
        if i not in self._spliced:
            self._splice_delay_ns(h, ns)
            if rate := self._rates.get(i):
                self.rate_limit(i, rate)  # qdiscs do not survive the port moving namespaces
        flags = ["--detach"] if detach else []
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(DELAYLINE), "--ms", str(ms), *flags,
             h.port, f"{h.port[:-3]}-dx"],
            stdin=subprocess.DEVNULL if detach else subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=None if detach else _pdeathsig, text=True,
        )  # fmt: skip
        self._delays[i] = proc
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            os.killpg(proc.pid, signal.SIGKILL)
            err = proc.communicate(timeout=5)[1]
            del self._delays[i]
            raise RuntimeError(f"delay line for host {i} did not start: {line!r} {err.strip()}")

    def _bridge_port(self, i: int) -> str:
        h = self.host(i)
        return f"{h.port[:-3]}-dl" if i in self._spliced else h.port

    def _splice_delay_ns(self, h: Host, ns: str) -> None:
        base = h.port[:-3]  # e.g. "tp-h3"
        _ip("netns", "add", ns)
        # No IPv6 autoconf chatter from the relay's own interfaces.
        _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1")  # fmt: skip
        _ip("link", "set", h.port, "nomaster")
        _ip("link", "set", h.port, "netns", ns)
        _ip("link", "add", f"{base}-dl", "type", "veth", "peer", "name", f"{base}-dx")
        _ip("link", "set", f"{base}-dx", "netns", ns)
        _ip("link", "set", f"{base}-dl", "addrgenmode", "none")
        _ip("link", "set", f"{base}-dl", "master", self.bridge, "up")
        for dev in (h.port, f"{base}-dx"):
            _ip("-n", ns, "link", "set", dev, "promisc", "on", "up")
        self._spliced.add(h.index)


def wait_until(pred, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll `pred` until it is true or `timeout` passes; returns the last result."""
    deadline = time.monotonic() + timeout
    while not (ok := pred()) and time.monotonic() < deadline:
        time.sleep(interval)
    return bool(ok)


AGENT_PORT = 7070


def node_cmd(bed: Testbed, i: int, home: Path, *extra: str) -> list[str]:
    """`thunderpool node` for host i on AGENT_PORT, its state under home/home{i}, without mDNS
    or measuring (the namespaces share one machine); `extra` adds --token, --join, ..."""
    return [
        "env",
        f"THUNDERPOOL_HOME={home}/home{i}",
        sys.executable,
        "-m",
        "thunderpool",
        "node",
        "--host",
        bed.host(i).ip,
        "--port",
        str(AGENT_PORT),
        "--no-mdns",
        "--no-measure",
        *extra,
    ]


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200 (serving a model)."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def cluster_serve(home: Path, url: str, *args: str, timeout: float = 240.0):
    """`thunderpool serve --cluster ARGS --port (url's)` in this process's namespace, logged to
    home/serve.log; yields the process once `url`/health answers 200, stops it on exit."""
    log = open(home / "serve.log", "w")  # noqa: SIM115 - closed on exit
    serve = subprocess.Popen(
        [
            *("env", f"THUNDERPOOL_HOME={home}/serve", sys.executable, "-m"),
            *("thunderpool", "serve", "--cluster", *args, "--port", url.rsplit(":", 1)[1]),
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        up = wait_until(lambda: healthy(url) or serve.poll() is not None, timeout, 0.5)
        assert up and serve.poll() is None, (home / "serve.log").read_text()
        yield serve
    finally:
        serve.terminate()
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()
