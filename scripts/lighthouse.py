"""Start the torchft lighthouse: the service every replica group's Manager asks for a quorum (which groups take part
in a step) and sends heartbeats to. One per job, on any host the groups can reach; it holds no training state.

    python scripts/lighthouse.py --min_replicas 1                     # listens on [::]:29510
    python scripts/lighthouse.py --bind 127.0.0.1:0 --min_replicas 1  # any free port on loopback (tests)

It prints `lighthouse: http://HOST:PORT`: pass that as --fault_tolerance.lighthouse (or export TORCHFT_LIGHTHOUSE) to
every replica group, and serves until SIGTERM / Ctrl-C. torchft's own `torchft_lighthouse` command does the same
(without printing the address); this wrapper exists so a test can use port 0. Options (torchft's):
  --min_replicas          groups needed for the first quorum (later quorums go on with fewer, down to the
                          groups' own fault_tolerance.min_replica_size)
  --join_timeout_ms       how long a quorum waits for groups that heartbeat but have not asked to join yet
  --heartbeat_timeout_ms  silence after which a group counts as dead (the survivors' next quorum drops it)
  --quorum_tick_ms        how often a waiting quorum is re-checked
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", default="[::]:29510", help="HOST:PORT to listen on (port 0 = any free port)")
    p.add_argument("--min_replicas", type=int, required=True)
    p.add_argument("--join_timeout_ms", type=int, default=60000)
    p.add_argument("--heartbeat_timeout_ms", type=int, default=5000)
    p.add_argument("--quorum_tick_ms", type=int, default=100)
    args = p.parse_args(argv)
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as e:
        print(f"error: the lighthouse needs torchft (pip install torchft==0.2.0): {e}", file=sys.stderr)
        return 2
    server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                              quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    address = server.address()
    if args.bind.startswith("127.0.0.1:"):  # torchft reports the host name; loopback users want loopback
        address = f"http://127.0.0.1:{address.rsplit(':', 1)[1]}"
    print(f"lighthouse: {address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
