#!/usr/bin/env python3
"""hermes-agent's own writer beside the throughput benchmark (issue #41).

``hermes_writer.py DB GO STOP``, run by the throughput example with an
unpacked hermes-agent wheel on PYTHONPATH (standard library only; ``-S``).

Opens DB with hermes' ``hermes_state.SessionDB`` (its own connection, busy
timeout and jittered write retries, unchanged), prints ``ready``, waits for
the GO file, then writes one session plus one message per step, with a 5 ms
pause between steps (a busy agent, not a benchmark), until the STOP file
appears. Prints one JSON line: writes done, writes that failed (the
exception hermes would have raised to its caller), and the latency of each
write in ms (p50, p99, max). Exit status 0 unless hermes could not start.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    db_path, go, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    import hermes_state  # the published wheel's module

    from pathlib import Path

    db = hermes_state.SessionDB(Path(db_path))
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    latencies: list[float] = []
    failures: list[str] = []
    step = 0
    while not os.path.exists(stop):
        sid = f"hermes-bench-{os.getpid()}-{step}"
        started = time.perf_counter()
        try:
            db.create_session(sid, "cli")
            db.append_message(sid, "user", "A turn hermes writes while Retinue works.")
            latencies.append((time.perf_counter() - started) * 1000.0)
        except Exception as e:  # what hermes would surface to its caller
            failures.append(f"{type(e).__name__}: {e}")
        step += 1
        time.sleep(0.005)
    latencies.sort()

    def pct(q: float) -> float | None:
        if not latencies:
            return None
        rank = max(1, min(len(latencies), int(-(-q * len(latencies) // 1))))
        return round(latencies[rank - 1], 2)

    print(
        json.dumps(
            {
                "writes": len(latencies),
                "failed": len(failures),
                "first_failure": failures[0] if failures else None,
                "p50_ms": pct(0.50),
                "p99_ms": pct(0.99),
                "max_ms": round(latencies[-1], 2) if latencies else None,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
