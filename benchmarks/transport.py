"""Push-and-pull of a 10M-float32 gradient (40 MB) vs a raw-socket request+reply of the same bytes.

    python benchmarks/transport.py [--values 10000000] [--rounds 20]

All run in this process over loopback, one after the other, so they share the machine's
state.  The raw ceiling: a client sends N*4 bytes, a server thread receives them into a
preallocated buffer and sends N*4 bytes back.  sparkdl: PSClient.push_pull against a live
ParameterServer (async, SGD), which also authenticates, checks, aggregates and steps, once
over TCP (``ps_transport="tcp"``) and once through the same-host shared-memory segment, the
client's buffers being the segment's regions as a CPU worker's replica buffers are.
Also prints where the PS's time goes (aggregate, optimizer) and the per-codec payload.
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import torch

from sparkdl._internal.ps.server.server import ParameterServer
from sparkdl._internal.ps.wire.compression import make_codec
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("closed")
        got += n


def raw_ceiling(num_bytes: int, rounds: int) -> float:
    """Seconds per request+reply of num_bytes each way over a plain TCP socket."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        buffer = bytearray(num_bytes)
        view = memoryview(buffer)
        for _ in range(rounds + 1):
            recv_exactly(conn, view)
            conn.sendall(view)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = memoryview(bytearray(num_bytes))
    back = memoryview(bytearray(num_bytes))
    client.sendall(out)
    recv_exactly(client, back)                      # warm-up round
    start = time.perf_counter()
    for _ in range(rounds):
        client.sendall(out)
        recv_exactly(client, back)
    seconds = (time.perf_counter() - start) / rounds
    client.close()
    thread.join()
    listener.close()
    return seconds


def sparkdl_push_pull(values: int, rounds: int, shared: bool = False) -> tuple[float, dict]:
    config = TrainConfig(num_workers=1, policy="async", learning_rate=1e-6, momentum=0.9, timeout_s=60,
                         ps_transport="auto" if shared else "tcp")
    server = ParameterServer(config, torch.zeros(values), b"k" * 32)
    server.start()
    client = PSClient(server.host, server.port, b"k" * 32, 0, 60)
    weights = torch.zeros(values)
    grad = torch.full((values,), 1e-3)
    version = client.hello(1000, weights, shared_memory=shared).version
    if shared:
        if client.segment is None:
            raise SystemExit("no shared-memory segment on this host (needs /dev/shm)")
        weights, grad = client.segment.weights, client.segment.gradient
        grad.fill_(1e-3)
    version, _ = client.push_pull(grad, version, 32, 0.0, 0, weights)     # warm-up
    aggregate0, optimizer0 = server.stats.aggregate_seconds, server.stats.optimizer_seconds
    start = time.perf_counter()
    for _ in range(rounds):
        version, _ = client.push_pull(grad, version, 32, 0.0, 0, weights)
    seconds = (time.perf_counter() - start) / rounds
    breakdown = {"aggregate_ms": 1e3 * (server.stats.aggregate_seconds - aggregate0) / rounds,
                 "optimizer_ms": 1e3 * (server.stats.optimizer_seconds - optimizer0) / rounds}
    client.done(0, None)
    server.stop()
    return seconds, breakdown


def codec_costs(values: int) -> dict:
    grad = torch.randn(values)
    costs = {}
    for name in ("none", "fp16", "int8", "topk"):
        codec = make_codec(name, values, 0.01)
        codec.encode(grad)
        start = time.perf_counter()
        payload = codec.encode(grad)
        encode_ms = 1e3 * (time.perf_counter() - start)
        costs[name] = {"bytes": payload.numel() * payload.element_size(), "encode_ms": encode_ms}
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_bytes = 4 * args.values
    raw = raw_ceiling(num_bytes, args.rounds)
    ps, breakdown = sparkdl_push_pull(args.values, args.rounds)
    shared, shared_breakdown = sparkdl_push_pull(args.values, args.rounds, shared=True)
    result = {"command": f"python benchmarks/transport.py --values {args.values} --rounds {args.rounds}",
              "values": args.values, "raw_request_reply_ms": raw * 1e3, "push_pull_ms": ps * 1e3,
              "raw_GBps": 2 * num_bytes / raw / 1e9, "push_pull_GBps": 2 * num_bytes / ps / 1e9,
              "fraction_of_ceiling": raw / ps, **breakdown,
              "shared_memory_push_pull_ms": shared * 1e3, "shared_memory_speedup_over_tcp": ps / shared,
              "shared_memory_breakdown": shared_breakdown, "codecs": codec_costs(args.values)}
    print(f"raw TCP request+reply : {raw * 1e3:8.1f} ms  ({result['raw_GBps']:.2f} GB/s both ways)")
    print(f"sparkdl push_pull TCP : {ps * 1e3:8.1f} ms  ({result['push_pull_GBps']:.2f} GB/s)  "
          f"= {result['fraction_of_ceiling']:.0%} of the ceiling")
    print(f"  PS aggregate {breakdown['aggregate_ms']:.1f} ms, optimizer {breakdown['optimizer_ms']:.1f} ms per push")
    print(f"sparkdl push_pull shm : {shared * 1e3:8.1f} ms  = {ps / shared:.1f}x faster than TCP")
    print(f"  PS aggregate {shared_breakdown['aggregate_ms']:.1f} ms, optimizer "
          f"{shared_breakdown['optimizer_ms']:.1f} ms per push")
    for name, cost in result["codecs"].items():
        print(f"  codec {name:5s}: {cost['bytes'] / 1e6:7.2f} MB pushed, encode {cost['encode_ms']:.1f} ms")
    out = ROOT / "benchmarks" / "results" / "transport.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
