"""A manual check of llampy.cluster's autoscaling (min 1, max 2 replicas) on a local Ray cluster of 2 worker nodes:
load brings a second replica, idleness removes it, no request fails. Prints the seconds each took and the failures.
Run as root in a loopback-only namespace:
    unshare -n sh -c 'ip link set lo up && RAY_USAGE_STATS_ENABLED=0 .venv/bin/python benchmarks/cluster_autoscale.py'
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = Path(os.environ.get("LLAMPY_SHARED", ROOT.parent / "shared")) / "fixtures" / "tiny" / "llama-F32.gguf"


def replicas(url: str):
    try:
        return httpx.get(url + "/health", timeout=5).json().get("replicas")
    except (httpx.HTTPError, ValueError):
        return None


def wait_for(url: str, n: int, timeout: float = 180.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if replicas(url) == n:
            return round(time.monotonic() - t0, 1)
        time.sleep(1)
    return None


def main() -> None:
    from llampy.cluster import deploy
    d = deploy(str(TINY), min_replicas=1, max_replicas=2, parallel=4, address="local:2", port=8000,
               place_timeout=300)
    print("start: 1 replica after", wait_for(d.url, 1), "s", flush=True)
    failed, done, stop = [], [0], threading.Event()

    def load():
        while not stop.is_set():
            r = httpx.post(d.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 200,
                                                            "ignore_eos": True, "temperature": 0}, timeout=120)
            done[0] += 1
            if r.status_code != 200:
                failed.append(r.status_code)
    clients = [threading.Thread(target=load) for _ in range(12)]
    for t in clients:
        t.start()
    print("under load: 2 replicas after", wait_for(d.url, 2), "s", flush=True)
    time.sleep(5)
    stop.set()
    for t in clients:
        t.join()
    print(f"requests {done[0]}, failed {failed}", flush=True)
    print("idle: 1 replica after", wait_for(d.url, 1), "s", flush=True)
    d.shutdown()


if __name__ == "__main__":
    main()
