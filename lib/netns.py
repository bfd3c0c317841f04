"""A fleet on a kernel network: one network namespace per host, each behind a veth into its rack's
bridge, racks joined to a spine over uplinks that may be oversubscribed, the origin behind a link of
its own. Every link is shaped by the kernel in both directions (``tc`` tbf on each veth end's
egress), so rates, queues and TCP's congestion control are the kernel's, not an application pacer's.

Layout (``T`` the topology's tag, unique per process):

    T-h0 .. T-hN   hosts: ``eth0`` 10.200.x.y/16, the far end ``vh<i>`` on its rack bridge
    T-origin       the origin: ``eth0`` 10.200.255.1/16, the far end ``vo`` on the spine bridge
    T-ctl          with ``control``: where a benchmark's controller runs, 10.200.254.1/16 on the spine,
                   unshaped (its polls still cross each host's shaped link)
    T-fab          the fabric: bridges ``r<k>`` per rack and ``spine``, uplinks ``u<k>`` (rack side)
                   to ``s<k>`` (spine side); a single rack puts every host on the spine directly
    T-gw           with ``gateway``: a veth from this machine's own namespace onto the spine,
                   10.200.253.1/16, unshaped: processes that stay here (a Temporal server, a test) reach
                   every host across the host's own link. ``down`` deletes it before the namespaces
                   (the kernel frees those asynchronously); one gateway topology at a time (they would
                   share 10.200.0.0/16)

One L2 segment over all bridges: nothing to route. Everything lives in the topology's own
namespaces, so deleting them removes every veth, bridge and qdisc; ``down`` kills what runs there
first. ``up`` registers ``down`` to run at interpreter exit and on SIGTERM, and a failed ``up`` undoes
itself.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.200"
PAYLOAD_SHARE = 1448 / 1514        # TCP payload per Ethernet frame at MTU 1500 (timestamps on): ~95.6 %
_TAGS: set[str] = set()            # every topology this process has brought up (``made_here``)


class NetnsError(RuntimeError):
    """A topology could not be built (or torn down); the message has the failing command and its output."""


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def tc(ns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {p.stderr.strip()}")


def shape(ns: str, dev: str, rate: float) -> None:
    """Limit ``dev``'s egress to ``rate`` bytes/s on the wire (headers included): a token bucket with
    10 ms of burst and up to 100 ms of queue, the rest dropped (TCP backs off, as on a real link)."""
    burst = max(16 * 1024, int(rate / 100))
    tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst),
       "latency", "100ms")


def drop_at_random(ns: str, share: float) -> None:
    """Drop ``share`` of the packets arriving in ``ns`` (nftables' ``numgen random``, in tenths of a
    percent; netem is not in every kernel). Needs ``nft``: `make netns-tools`."""
    per_mille = round(share * 1000)
    script = ("table inet wcloss {\n chain in {\n  type filter hook input priority 0; policy accept;\n"
              f"  numgen random mod 1000 < {per_mille} drop\n }}\n}}\n")
    try:
        p = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script, capture_output=True, text=True)
    except FileNotFoundError:
        raise NetnsError("random loss needs nftables' nft: run `make netns-tools`") from None
    if p.returncode != 0:
        raise NetnsError(f"nft in {ns}: {p.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    name: str                      # h0, h1, ... or "origin"
    ns: str                        # its namespace
    addr: str                      # its address on the fleet's segment
    rack: int                      # -1: the origin (on the spine)
    fabric_dev: str                # its link's far end in the fabric namespace

    def run(self, *cmd: str) -> list[str]:
        """``cmd`` as this host runs it (for subprocess)."""
        return ["ip", "netns", "exec", self.ns, *cmd]


@dataclass
class Topology:
    racks: list[int]                       # hosts per rack
    host_rate: float                       # bytes/s of each host's link, each direction
    origin_rate: float                     # bytes/s of the origin's link, each direction
    oversubscription: float = 1.0          # a rack's uplink carries (its hosts x host_rate) / this
    control: bool = False                  # a namespace for a controller that reaches every host
    gateway: bool = False                  # a link from this machine's namespace onto the spine
    loss: float = 0.0                      # each host and the origin drop this share of arriving packets
    congestion: str = "cubic"              # TCP congestion control in every namespace (Linux's default; a new
                                           # namespace would otherwise inherit whatever this machine chose)
    tag: str = field(default_factory=lambda: f"wc{uuid.uuid4().hex[:6]}")
    hosts: list[Host] = field(default_factory=list)
    origin: Host | None = None
    controller: Host | None = None
    gateway_addr: str | None = None        # this machine's address on the fleet's segment (``gateway``)
    _made: list[str] = field(default_factory=list)          # namespaces created, for teardown
    _previous_sigterm: object = None

    @property
    def fabric(self) -> str:
        return f"{self.tag}-fab"

    def namespaces(self) -> list[str]:
        return list(self._made)

    # ------------------------------------------------------------------ build
    def up(self) -> "Topology":
        _TAGS.add(self.tag)
        atexit.register(self.down)
        if self._previous_sigterm is None and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _allow_congestion(self) -> None:
        """A namespace may select only the algorithms in the machine-wide allowed list (this machine's
        default and ``reno`` unless widened): add ours to it, as root. The machine's own default is
        untouched."""
        base = Path("/proc/sys/net/ipv4")
        allowed = (base / "tcp_allowed_congestion_control").read_text().split()
        if self.congestion in allowed:
            return
        if self.congestion not in (base / "tcp_available_congestion_control").read_text().split():
            raise NetnsError(f"the kernel has no {self.congestion!r} congestion control (modprobe tcp_{self.congestion})")
        try:
            (base / "tcp_allowed_congestion_control").write_text(" ".join([*allowed, self.congestion]))
        except OSError as e:
            raise NetnsError(f"cannot allow congestion control {self.congestion!r} in namespaces: {e}") from None

    def _netns(self, name: str) -> str:
        ip("netns", "add", name)
        self._made.append(name)
        ip("link", "set", "lo", "up", ns=name)
        p = subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw",
                            f"net.ipv4.tcp_congestion_control={self.congestion}"], capture_output=True, text=True)
        if p.returncode != 0:
            raise NetnsError(f"congestion control {self.congestion!r} in {name}: {p.stderr.strip()}")
        return name

    def _build(self) -> None:
        self._allow_congestion()
        fab = self._netns(self.fabric)
        ip("link", "add", "spine", "type", "bridge", ns=fab)
        ip("link", "set", "spine", "up", ns=fab)
        flat = len(self.racks) == 1
        for k, count in enumerate(self.racks):
            if flat:
                break
            ip("link", "add", f"r{k}", "type", "bridge", ns=fab)
            ip("link", "set", f"r{k}", "up", ns=fab)
            ip("link", "add", f"u{k}", "type", "veth", "peer", "name", f"s{k}", ns=fab)
            ip("link", "set", f"u{k}", "master", f"r{k}", "up", ns=fab)
            ip("link", "set", f"s{k}", "master", "spine", "up", ns=fab)
            uplink = count * self.host_rate / self.oversubscription
            shape(fab, f"u{k}", uplink)                 # rack -> spine
            shape(fab, f"s{k}", uplink)                 # spine -> rack
        i = 0
        for k, count in enumerate(self.racks):
            for _ in range(count):
                addr = f"{SUBNET}.{i // 250}.{i % 250 + 2}"
                self.hosts.append(self._attach(f"h{i}", f"vh{i}", "spine" if flat else f"r{k}", addr, k,
                                               self.host_rate))
                i += 1
        self.origin = self._attach("origin", "vo", "spine", f"{SUBNET}.255.1", -1, self.origin_rate)
        if self.control:
            self.controller = self._attach("ctl", "vc", "spine", f"{SUBNET}.254.1", -1, 0)
        if self.gateway:
            if any(dev.endswith("-gw") for dev in _links_on(f"{SUBNET}.0.0/16")):
                raise NetnsError(f"another topology's gateway already holds {SUBNET}.0.0/16")
            gw = f"{self.tag}-gw"
            ip("link", "add", gw, "type", "veth", "peer", "name", "vg", "netns", self.fabric)
            ip("addr", "add", f"{SUBNET}.253.1/16", "dev", gw)
            ip("link", "set", gw, "up")
            ip("link", "set", "vg", "master", "spine", "up", ns=self.fabric)
            self.gateway_addr = f"{SUBNET}.253.1"

    def _attach(self, name: str, far: str, bridge: str, addr: str, rack: int, rate: float) -> Host:
        ns = self._netns(f"{self.tag}-{name}")
        ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", far, "netns", self.fabric)
        ip("addr", "add", f"{addr}/16", "dev", "eth0", ns=ns)
        ip("link", "set", "eth0", "up", ns=ns)
        ip("link", "set", far, "master", bridge, "up", ns=self.fabric)
        if rate:
            shape(ns, "eth0", rate)                     # upload
            shape(self.fabric, far, rate)               # download
            if self.loss:
                drop_at_random(ns, self.loss)
        return Host(name, ns, addr, rack, far)

    # ------------------------------------------------------------------ handing over
    def describe(self) -> dict:
        """What another process needs to use the topology (``Topology.view``), not to own it."""
        host = lambda h: None if h is None else {"name": h.name, "ns": h.ns, "addr": h.addr, "rack": h.rack,
                                                 "fabric_dev": h.fabric_dev}
        return {"tag": self.tag, "racks": self.racks, "host_rate": self.host_rate, "origin_rate": self.origin_rate,
                "oversubscription": self.oversubscription, "loss": self.loss, "congestion": self.congestion,
                "hosts": [host(h) for h in self.hosts], "gateway_addr": self.gateway_addr,
                "origin": host(self.origin), "controller": host(self.controller)}

    @classmethod
    def view(cls, d: dict) -> "Topology":
        """A described topology, owned by another process: its ``down`` removes nothing."""
        host = lambda h: None if h is None else Host(**h)
        return cls(d["racks"], d["host_rate"], d["origin_rate"], d["oversubscription"], loss=d["loss"],
                   congestion=d["congestion"], tag=d["tag"],
                   hosts=[host(h) for h in d["hosts"]], origin=host(d["origin"]), controller=host(d["controller"]),
                   gateway_addr=d.get("gateway_addr"))

    def tx_bytes(self, dev: str) -> int:
        """Bytes a fabric-side device has sent (the kernel's counter, headers included): ``s<k>`` into
        rack k from the spine, ``u<k>`` out of it, ``vh<i>`` to host i."""
        out = json.loads(ip("-s", "-j", "link", "show", "dev", dev, ns=self.fabric).stdout)
        return int(out[0]["stats64"]["tx"]["bytes"])

    # ------------------------------------------------------------------ faults
    def link(self, host: Host, up: bool) -> None:
        """Take a host's link down (the cable pulled) or bring it back."""
        ip("link", "set", host.fabric_dev, "up" if up else "down", ns=self.fabric)

    def rack_uplink(self, rack: int, up: bool) -> None:
        """Partition a rack from the spine (and so from every other rack and the origin), or heal it."""
        ip("link", "set", f"s{rack}", "up" if up else "down", ns=self.fabric)

    def heal(self) -> None:
        """Every host link and rack uplink up again."""
        for h in self.hosts:
            self.link(h, True)
        for k in range(len(self.racks) if len(self.racks) > 1 else 0):
            self.rack_uplink(k, True)

    # ------------------------------------------------------------------ teardown
    def down(self) -> None:
        """Kill every process in the topology's namespaces, then delete them (with every veth, bridge
        and qdisc in them). Safe to call twice."""
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.gateway and self._made:
            # its far end would go with the fabric namespace, but the kernel frees a deleted namespace's
            # devices later, asynchronously: delete it now so that `down` returning means it is gone
            ip("link", "del", f"{self.tag}-gw", check=False)
        left = []
        for ns in reversed(self._made):
            if ip("netns", "del", ns, check=False).returncode != 0 and ns in existing_namespaces():
                left.append(ns)
        self._made = left
        atexit.unregister(self.down)
        if left:
            raise NetnsError(f"namespaces left behind: {', '.join(left)}")

    def _on_sigterm(self, signum, frame) -> None:
        self.down()
        signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)   # then as before: usually, exit
        os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> "Topology":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def enter(ns: str) -> None:
    """Move the calling thread (and every thread and process it starts from now on) into ``ns``: a
    rank process calls it first thing, before it opens a socket."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        enter_fd(fd, ns)
    finally:
        os.close(fd)


def enter_fd(fd: int, name: str = "") -> None:
    """``enter`` the namespace an open descriptor refers to (``/proc/PID/ns/net`` of another process,
    passed over a Unix socket), unless the caller is in it already: setns needs CAP_SYS_ADMIN even then."""
    if os.fstat(fd).st_ino == os.stat("/proc/thread-self/ns/net").st_ino:
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:              # CLONE_NEWNET
        raise NetnsError(f"setns({name or fd}): {os.strerror(ctypes.get_errno())}")


def _links_on(prefix: str) -> list[str]:
    """This namespace's devices with a route to ``prefix``."""
    routes = json.loads(ip("-j", "route", "show", prefix).stdout or "[]")
    return [r.get("dev", "") for r in routes]


def made_here() -> set[str]:
    """The namespaces of this process's topologies that exist now (none once each is down): other
    processes' topologies on the same machine are not counted."""
    return {n for n in existing_namespaces() if n.split("-", 1)[0] in _TAGS}


def existing_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
