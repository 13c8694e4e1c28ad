"""A hostile local peer floods the parameter server's port during a real fit: the run is not delayed."""
import random
import socket
import threading
import time

import numpy as np

from sparkdl import TrainConfig, train
from tests.conftest import DIGITS_MLP


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def flood(port: int, stop: threading.Event, opened: list[socket.socket]) -> None:
    """Open connections that stay silent or send a few random bytes, until told to stop."""
    rng = random.Random(0)
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:            # the PS is not listening yet, or already gone
            time.sleep(0.02)
            continue
        if rng.random() < 0.5:
            try:
                sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))))
            except OSError:
                pass
        opened.append(sock)        # kept open (idle) until the fit has returned
        time.sleep(0.005)


def test_idle_and_garbage_connections_do_not_stall_a_fit(digits_rdd, digits):
    _, x_test, _, y_test = digits
    # long enough (about 2 s) for the flood to open well over 100 connections during the fit
    config = TrainConfig(num_workers=2, policy="sync", epochs=30, batch_size=16, learning_rate=0.05, momentum=0.9,
                         timeout_s=60)
    train(digits_rdd, DIGITS_MLP, config)                      # warm the Python workers
    started = time.monotonic()
    clean = train(digits_rdd, DIGITS_MLP, config)
    clean_seconds = time.monotonic() - started

    port = free_port()
    stop, opened = threading.Event(), []
    attacker = threading.Thread(target=flood, args=(port, stop, opened), daemon=True)
    attacker.start()
    started = time.monotonic()
    try:
        flooded = train(digits_rdd, DIGITS_MLP, config.replace(ps_port=port))
        flooded_seconds = time.monotonic() - started
    finally:
        stop.set()
        attacker.join()
        for sock in opened:
            sock.close()
    print(f"clean {clean_seconds:.2f} s, flooded {flooded_seconds:.2f} s, {len(opened)} hostile connections, "
          f"{flooded.summary['refused_connections']} refused")
    assert len(opened) >= 100
    # no worker failed for the flood (an evicted worker connects again) and nothing waited out timeout_s (60 s);
    # the margin leaves room for the other test process sharing these two cores
    assert flooded.summary["attempts"] == 1
    assert flooded_seconds < clean_seconds + 20, (flooded_seconds, clean_seconds)
    assert flooded.summary["refused_connections"] >= 50
    assert flooded.summary["updates"] == clean.summary["updates"]
    accuracy = flooded.accuracy(DIGITS_MLP, x_test, y_test)
    assert accuracy >= 0.9 and abs(accuracy - clean.accuracy(DIGITS_MLP, x_test, y_test)) < 1e-6
    assert np.isfinite(flooded.summary["final_loss"])
