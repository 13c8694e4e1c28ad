"""A multi-host lab on one machine: hosts in network namespaces on a switch, rate-limited links, Spark standalone.

Each *host* is a network namespace with its own loopback, one address and one link (a veth pair)
to a *switch* namespace holding a Linux bridge; every process started on a host also gets a
private tmpfs on ``/dev/shm``, so no host sees another's shared memory.  Each link is limited in
both directions with ``tbf`` (the host's end limits what it sends, the switch's end what it
receives).  Host 0 runs the Spark standalone master and the driver; hosts 1..N run one Spark
worker each.  Nothing is made in the machine's own namespace: the addresses live only inside the
namespaces, on a subnet that overlaps none of the machine's routes.

    with Lab(workers=2, rate="1gbit") as lab:
        done = lab.run_driver([sys.executable, "tests/e2e/lab_run.py", "--master", lab.master_url,
                               "--driver-host", lab.driver.address, "--weights", "/tmp/w.pt"])

Needs root and ``ip netns`` (``Lab.missing()`` says why not).  ``close()`` kills every process
the lab started and deletes its namespaces (with them their links); it runs at interpreter exit
and a lab started later removes what a killed one left (a lab's names carry its maker's pid).

From the command line (for benchmarks and by hand):

    python tests/e2e/lab.py --workers 2 --rate 100mbit   # start, print the master URL, wait for Ctrl-C
    python tests/e2e/lab.py --clean                      # remove what every lab made
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark

PREFIX = "sdlab"                       # every namespace the lab makes starts with it
SPARK_HOME = Path(pyspark.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
MASTER_PORT = 7077
#: rate profiles: two cores cannot feed 10 Gbit/s, so a faster link would measure the CPU, not the link
RATES = {"100mbit": 100e6, "1gbit": 1e9}
_LABS = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True, check=True,
                   timeout=30)


def namespaces() -> list[str]:
    """The lab namespaces that exist now (any lab's)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def _owner_alive(namespace: str) -> bool:
    """Whether the process that made this lab namespace (its pid is in the name) still runs."""
    digits = namespace[len(PREFIX):].split("-")[0]
    if not digits.isdigit():
        return False
    try:
        os.kill(int(digits), 0)
    except ProcessLookupError:
        return False
    return True


def clean(everything: bool = False) -> list[str]:
    """Kill the processes in lab namespaces whose maker is gone (or in all, ``everything``) and delete them."""
    removed = [name for name in namespaces() if everything or not _owner_alive(name)]
    for namespace in removed:
        pids = _ip("netns", "pids", namespace, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for namespace in removed:
        _ip("netns", "del", namespace, check=False)
    return removed


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that overlaps none of this machine's routes or addresses."""
    taken = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        try:
            taken.append(ipaddress.ip_network("0.0.0.0/0" if word == "default" else word, strict=False))
        except ValueError:
            continue
    taken = [net for net in taken if net.prefixlen > 0]          # the default route overlaps everything
    for third in range(200, 250):
        candidate = ipaddress.ip_network(f"10.{third}.77.0/24")
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise RuntimeError("no free 10.x.77.0/24 subnet for the lab: every candidate overlaps a route of this machine")


def burst_bytes(rate_bits: float) -> int:
    """tbf's bucket: 10 ms at the rate, and never below one 64 KiB GSO segment (else nothing passes)."""
    return max(int(rate_bits / 8 / 100), 96 * 1024)


@dataclass
class Host:
    """One namespace: its name in the lab, its address, and the processes started on it."""

    name: str
    namespace: str
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, args: list[str]) -> list[str]:
        """``args`` run inside this host, with a /dev/shm of its own."""
        inner = "mount -t tmpfs -o size=4g,mode=1777 sdlab-shm /dev/shm && exec \"$0\" \"$@\""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", inner, *args]

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Spark binds and advertises this host's address, never the machine's own name."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_") and k != "PYSPARK_SUBMIT_ARGS"}
        env.update(SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP=self.address, SPARK_LOCAL_HOSTNAME=self.address,
                   SPARK_NO_DAEMONIZE="1", PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
        env.update(extra or {})
        return env

    def start(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """A process on this host, its output in ``log`` (stopped by ``Lab.close`` if still running)."""
        with open(log, "w") as out:
            process = subprocess.Popen(self.command(args), env=self.environment(env), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        self.processes.append(process)
        return process


class Lab:
    """A switch, a driver host and ``workers`` worker hosts, each with a Spark worker of ``cores`` cores."""

    def __init__(self, workers: int = 2, rate: str = "1gbit", cores: int = 1, worker_memory: str = "3g",
                 worker_timeout_s: int = 60) -> None:
        if rate not in RATES:
            raise ValueError(f"rate {rate!r}: choose one of {sorted(RATES)}")
        self.rate = rate
        #: the master's spark.worker.timeout: how long a silent worker host stays registered (Spark's default)
        self.worker_timeout_s = worker_timeout_s
        self.cores = cores
        self.worker_memory = worker_memory
        self.tag = f"{PREFIX}{os.getpid()}-{next(_LABS)}"       # several labs per process
        self.switch = f"{self.tag}-sw"
        subnet = free_subnet()
        addresses = list(subnet.hosts())
        self.prefixlen = subnet.prefixlen
        self.hosts = [Host("driver" if i == 0 else f"worker{i}", f"{self.tag}-h{i}", str(addresses[i]))
                      for i in range(workers + 1)]
        self.logs = Path(tempfile.gettempdir())      # its own folder once started
        self._closed = True

    @staticmethod
    def missing() -> str | None:
        """Why no lab can be built here, or None."""
        if os.geteuid() != 0:
            return "the multi-host lab needs root (network namespaces, links, tmpfs mounts)"
        for tool in ("ip", "tc", "unshare"):
            if shutil.which(tool) is None:
                return f"the multi-host lab needs the {tool!r} command"
        probe = f"{PREFIX}-probe{os.getpid()}"
        steps = [["ip", "netns", "add", probe],
                 ["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
                 ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
                 ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "1gbit",
                  "burst", "1250000", "latency", "100ms"],
                 ["ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private", "mount", "-t",
                  "tmpfs", "tmpfs", "/dev/shm"]]
        try:
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True, timeout=30)
                if done.returncode != 0:
                    return f"the lab cannot be built here ({' '.join(step[:6])} ...: {done.stderr.strip()})"
        finally:
            _ip("netns", "del", probe, check=False)
        return None

    @property
    def driver(self) -> Host:
        return self.hosts[0]

    @property
    def workers(self) -> list[Host]:
        return self.hosts[1:]

    @property
    def master_url(self) -> str:
        return f"spark://{self.driver.address}:{MASTER_PORT}"

    # -- building ---------------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the network, then start the master and one worker per worker host; wait until all registered."""
        reason = self.missing()
        if reason:
            raise RuntimeError(reason)
        clean()                                   # what a killed lab left behind
        self.logs = Path(tempfile.mkdtemp(prefix=f"{self.tag}-logs-"))
        self._closed = False
        atexit.register(self.close)
        try:
            self._build_network()
            self._start_spark()
        except BaseException as exc:
            tails = self._log_tails()
            self.close()
            raise RuntimeError(f"the lab did not start: {exc}\n{tails}") from exc

    def _build_network(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            port = self._port(host)
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
                host.namespace)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/{self.prefixlen}", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            self.limit(host, self.rate)

    def limit(self, host: Host, rate: str) -> None:
        """Set the host's link to ``rate`` both ways (tbf on the host's end and on the switch's end)."""
        bits = RATES[rate] if rate in RATES else float(rate)
        spec = ["rate", f"{int(bits)}bit", "burst", str(burst_bytes(bits)), "latency", "100ms"]
        _tc(host.namespace, "qdisc", "replace", "dev", "eth0", "root", "tbf", *spec)
        _tc(self.switch, "qdisc", "replace", "dev", self._port(host), "root", "tbf", *spec)

    def cut(self, host: Host) -> None:
        """Cut the host's link (its processes live on, unreachable)."""
        _ip("-n", self.switch, "link", "set", self._port(host), "down")

    def mend(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", self._port(host), "up")

    def _start_spark(self) -> None:
        spark_class = str(SPARK_HOME / "bin" / "spark-class")
        self.driver.start([spark_class, "org.apache.spark.deploy.master.Master", "--host", self.driver.address,
                           "--port", str(MASTER_PORT), "--webui-port", "8080"], self.logs / "master.log",
                          {"SPARK_MASTER_OPTS": f"-Dspark.worker.timeout={self.worker_timeout_s}"})
        self._wait_for_master()
        for host in self.workers:
            work = self.logs / f"{host.name}-work"
            host.start([spark_class, "org.apache.spark.deploy.worker.Worker", self.master_url, "--host",
                        host.address, "--cores", str(self.cores), "--memory", self.worker_memory,
                        "--webui-port", "8081", "--work-dir", str(work)], self.logs / f"{host.name}.log")
        self._wait_for_workers()

    def _wait_for_master(self, timeout: float = 90) -> None:
        if not self.wait_for_port(self.driver, MASTER_PORT, timeout):
            raise RuntimeError(f"the lab's Spark master did not listen within {timeout} s")

    def wait_for_port(self, host: Host, port: int, timeout: float) -> bool:
        """Whether ``host`` accepted a connection on ``port`` within ``timeout`` seconds (tried from the host)."""
        probe = host.command([sys.executable, "-c", _PORT_PROBE, host.address, str(port), str(timeout)])
        return subprocess.run(probe, capture_output=True, text=True, timeout=timeout + 30).returncode == 0

    def _wait_for_workers(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        logs = [self.logs / f"{host.name}.log" for host in self.workers]
        while time.monotonic() < deadline:
            if all(log.exists() and "Successfully registered with master" in log.read_text() for log in logs):
                return
            for process in (p for host in self.hosts for p in host.processes):
                if process.poll() is not None:
                    raise RuntimeError(f"a lab Spark process ended with {process.returncode}")
            time.sleep(0.2)
        raise RuntimeError(f"the lab's Spark workers did not register within {timeout} s")

    def _log_tails(self) -> str:
        """The end of every log of the lab's processes (they are deleted with the lab)."""
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}"
                         for log in sorted(self.logs.glob("*.log")))

    # -- using ------------------------------------------------------------------------------------------

    def run_driver(self, args: list[str], timeout: float = 600, env: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess:
        """Run ``args`` (a driver program) on the driver host and wait for it."""
        return subprocess.run(self.driver.command(args), env=self.driver.environment(env), capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)

    def start_driver(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``args`` on the driver host and return at once; its output goes to ``log``.

        (A file, not a pipe: a JVM child that outlives the driver would hold a pipe open.)
        """
        return self.driver.start(args, log, env)

    def link_bytes(self, host: Host) -> dict[str, int]:
        """Bytes the host's link carried so far: ``sent`` by the host and ``received`` by it."""
        port = self._port(host)
        out = _ip("-n", self.switch, "-s", "link", "show", port).stdout.split("\n")
        # the switch port's RX is what the host sent; its TX what the host received
        rx = int(out[out.index(next(l for l in out if l.strip().startswith("RX:"))) + 1].split()[0])
        tx = int(out[out.index(next(l for l in out if l.strip().startswith("TX:"))) + 1].split()[0])
        return {"sent": rx, "received": tx}

    def _port(self, host: Host) -> str:
        """The switch's end of ``host``'s link."""
        return f"port{self.hosts.index(host)}"

    @contextmanager
    def carried(self, hosts: list[Host]) -> Iterator[dict[str, dict[str, int]]]:
        """A dict that, once the block ends, holds the bytes each host's link carried during it (by name)."""
        before = {host.name: self.link_bytes(host) for host in hosts}
        carried: dict[str, dict[str, int]] = {}
        yield carried
        for host in hosts:
            after = self.link_bytes(host)
            carried[host.name] = {way: after[way] - before[host.name][way] for way in after}

    @contextmanager
    def timeline(self, hosts: list[Host], interval_s: float = 0.005) -> Iterator[dict[str, Any]]:
        """A dict that, once the block ends, holds every host's link counters sampled every ``interval_s``.

        ``{"t": [seconds...], name: {"sent": [bytes so far...], "received": [...]}}``, read in the
        switch's namespace (its sysfs) by one process, so that the samples of all links are taken together.
        """
        ports = [self._port(host) for host in hosts]
        out = self.logs / f"timeline-{time.monotonic_ns()}.txt"
        sampler = subprocess.Popen(["ip", "netns", "exec", self.switch, sys.executable, "-c", _LINK_SAMPLER,
                                    str(interval_s), str(out), *ports], stdin=subprocess.PIPE)
        samples: dict[str, Any] = {}
        try:
            while not out.exists():        # the sampler has taken its first sample
                if sampler.poll() is not None:
                    raise RuntimeError(f"the link sampler ended at once (exit {sampler.returncode}); ports {ports}")
                time.sleep(0.01)
            yield samples
        finally:
            if sampler.stdin is not None:
                sampler.stdin.close()      # the sampler's signal to stop
            sampler.wait(timeout=30)
        rows = [list(map(float, line.split())) for line in out.read_text().splitlines() if line.strip()]
        out.unlink()
        samples["t"] = [row[0] - rows[0][0] for row in rows]
        for i, host in enumerate(hosts):
            # the switch port's RX is what the host sent; its TX what the host received
            samples[host.name] = {"sent": [int(row[1 + 2 * i]) for row in rows],
                                  "received": [int(row[2 + 2 * i]) for row in rows]}

    def close(self) -> None:
        """Stop every process the lab started and delete its namespaces (with them, its links)."""
        if self._closed:
            return
        self._closed = True
        processes = [p for host in self.hosts for p in host.processes]
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for namespace in [host.namespace for host in self.hosts] + [self.switch]:
            for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)   # anything started there that left our process group
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", namespace, check=False)
        shutil.rmtree(self.logs, ignore_errors=True)


_LINK_SAMPLER = """
import os, select, sys, time
interval, out, ports = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
files = [open(f"/sys/class/net/{p}/statistics/{way}_bytes") for p in ports for way in ("rx", "tx")]
lines = []
while not select.select([sys.stdin], [], [], 0)[0]:     # until the lab closes our stdin
    now = time.monotonic()
    values = []
    for f in files:
        f.seek(0)
        values.append(f.read().strip())
    lines.append(f"{now} {' '.join(values)}")
    if len(lines) == 1:
        with open(out + ".part", "w") as first:
            first.write(lines[0] + "\\n")
        os.rename(out + ".part", out)
    time.sleep(max(0.0, interval - (time.monotonic() - now)))
with open(out, "w") as f:
    f.write("\\n".join(lines) + "\\n")
"""

_PORT_PROBE = """
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        socket.create_connection((host, port), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
"""


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", choices=sorted(RATES), default="1gbit")
    parser.add_argument("--cores", type=int, default=1)
    parser.add_argument("--clean", action="store_true", help="remove every lab's namespaces and processes, then exit")
    args = parser.parse_args()
    if args.clean:
        print("removed:", " ".join(clean(everything=True)) or "nothing")
        return
    with Lab(args.workers, args.rate, args.cores) as lab:
        print(f"master {lab.master_url}; hosts " + ", ".join(f"{h.name}={h.address} ({h.namespace})"
                                                            for h in lab.hosts))
        print(f"run on the driver host: ip netns exec {lab.driver.namespace} ...; Ctrl-C ends the lab")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    _main()
