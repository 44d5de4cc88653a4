"""Why /health stalls and what grows: the soak's request mix against a `dspark serve` with probes inside.

    PYTHONPATH=src python scripts/soak_probe.py --requests 800 --out /tmp/probe.json [--burn 4] [-- serve flags]

The server is `dspark serve` started through this file (``serve`` mode), which first installs, in the
server process:

- a loop-lag probe: a thread that every 0.1 s schedules a no-op on uvicorn's event loop and times how
  long it takes to run. When that passes 0.25 s it records what every thread is doing (Python stacks,
  and CPU seconds per thread from /proc/self/task during the stall), so a stall names its cause: the
  loop busy in Python, the GIL held by another thread, a garbage collection, or no CPU at all;
- a garbage-collector timer (``gc.callbacks``): every collection over 20 ms, with its generation;
- a memory sampler every 5 s: VmRSS, anonymous memory, glibc's mallinfo2 (heap in use / free, mmapped
  bytes), threads.

The load is ``dspark.bench.chaos_soak``'s (same plan, same concurrency blocks, same client-side /health
poll); the probe's records come back in one JSON file.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PROBE_ENV = "DSPARK_PROBE_OUT"


# =============================================================== inside the server
class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo() -> dict:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_mib": m.arena / 2**20, "in_use_mib": m.uordblks / 2**20, "free_mib": m.fordblks / 2**20,
            "mmapped_mib": m.hblkhd / 2**20, "mmapped_blocks": m.hblks}


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            out[key] = int(value.split()[0]) if key != "Threads" else int(value)
    return out


def _thread_cpu() -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def _stacks() -> dict[str, list[str]]:
    import traceback

    by_ident = {t.ident: t for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        t = by_ident.get(ident)
        name = t.name if t else str(ident)
        out[name] = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)][-6:]
    return out


class Probe:
    def __init__(self, path: str) -> None:
        self.path = path
        self.loop = None
        self.stalls: list[dict] = []
        self.gcs: list[dict] = []
        self.memory: list[dict] = []
        self.lags: list[float] = []  # every loop-lag sample (s)
        self._gc_start = 0.0
        self.served_at: float | None = None  # when uvicorn's loop started (tracemalloc's baseline: a minute later)
        self.t0 = time.monotonic()

    def install(self) -> None:
        import uvicorn

        probe, serve = self, uvicorn.Server.serve

        async def serve_probed(server, sockets=None):
            import asyncio

            probe.loop = asyncio.get_running_loop()
            if os.environ.get("DSPARK_PROBE_TRACEMALLOC"):  # from here on: loading under it takes minutes
                import tracemalloc

                tracemalloc.start(8)
            return await serve(server, sockets)

        uvicorn.Server.serve = serve_probed
        gc.callbacks.append(self._on_gc)
        for fn in (self._lag_thread, self._memory_thread):
            threading.Thread(target=fn, name=f"probe-{fn.__name__}", daemon=True).start()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            took = time.perf_counter() - self._gc_start
            if took > 0.02:
                self.gcs.append({"t": time.monotonic() - self.t0, "generation": info["generation"], "s": took,
                                 "collected": info["collected"]})

    def _lag_thread(self) -> None:
        while self.loop is None:
            time.sleep(0.1)
        while True:
            ran = threading.Event()
            t0 = time.perf_counter()
            cpu0 = _thread_cpu()
            try:
                self.loop.call_soon_threadsafe(ran.set)
            except RuntimeError:  # the loop closed
                return
            stacks = None
            if not ran.wait(0.25):
                stacks = _stacks()  # taken during the stall (this thread holds the GIL here)
                ran.wait(120)
            lag = time.perf_counter() - t0
            self.lags.append(lag)
            if stacks is not None:
                cpu1, names = _thread_cpu(), _names()
                busy = {names.get(tid, str(tid)): round(cpu1[tid] - cpu0.get(tid, 0.0), 2) for tid in cpu1
                        if cpu1[tid] - cpu0.get(tid, 0.0) > 0}
                self.stalls.append({"t": time.monotonic() - self.t0, "lag_s": lag, "thread_cpu_s": busy,
                                    "stacks_at_0.25s": stacks, "load1": os.getloadavg()[0]})
            time.sleep(0.1)

    def _memory_thread(self) -> None:
        import tracemalloc

        baseline, last_diff = None, 0.0
        while True:
            t = time.monotonic() - self.t0
            self.memory.append({"t": t, **_status(), **_mallinfo()})
            if self.loop is not None and self.served_at is None:
                self.served_at = t
            if tracemalloc.is_tracing() and self.served_at is not None and t > self.served_at + 60:
                if baseline is None:
                    baseline, last_diff = tracemalloc.take_snapshot(), t
                elif t - last_diff > 30:
                    stats = tracemalloc.take_snapshot().compare_to(baseline, "traceback")
                    self.python_growth = [{"kib": s.size_diff / 1024, "count": s.count_diff,
                                           "where": [str(f) for f in s.traceback][-4:]} for s in stats[:12]]
                    self.python_growth_total_mib = sum(s.size_diff for s in stats) / 2**20
                    last_diff = t
            self.dump()
            time.sleep(5)

    def dump(self) -> None:
        lags = sorted(self.lags)
        summary = {"samples": len(lags), "p50": lags[len(lags) // 2] if lags else None,
                   "p99": lags[int(len(lags) * 0.99)] if lags else None, "max": lags[-1] if lags else None}
        Path(self.path).write_text(json.dumps({"loop_lag": summary, "stalls": self.stalls, "gc": self.gcs,
                                               "memory": self.memory,
                                               "python_growth_total_mib": getattr(self, "python_growth_total_mib", None),
                                               "python_growth": getattr(self, "python_growth", None)}))


def serve_main(argv: list[str]) -> int:
    Probe(os.environ[PROBE_ENV]).install()
    from dspark.cli import main

    return main(argv)


# =============================================================== the load
def run(args: argparse.Namespace) -> None:
    from dspark.bench import chaos_soak as soak

    cfg = soak.SoakConfig(requests=args.requests, block=args.block, threads=1, serve_args=args.serve_args)
    probe_out = str(Path(args.out).with_suffix(".server.json"))
    port = soak._free_port()
    src = args.src or str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1", PROBE_ENV: probe_out,
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "serve", "--threads", "1", "serve", "--target", cfg.target, "--drafter",
           cfg.drafter, "--port", str(port), "--max-batch", str(cfg.max_batch), "--max-queue", "64",
           "--log-level", "warning", *cfg.serve_args]
    log = open(Path(args.out).with_suffix(".log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server did not start")
        time.sleep(0.5)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burn)]
    try:
        samples, outcomes = soak.run_load(url, soak.plan(cfg), cfg, proc.pid,
                                          lambda m: print(m, file=sys.stderr, flush=True))
        time.sleep(6)  # one more memory sample
    finally:
        for b in burners:
            b.kill()
            b.wait()
        proc.terminate()
        proc.wait(60)
    server = json.loads(Path(probe_out).read_text())
    Path(args.out).write_text(json.dumps({"client": {"samples": samples, "outcomes": outcomes},
                                          "server": server}, indent=1))
    worst_client = max(s.get("health_worst_s", 0) for s in samples)
    print(f"client-side slowest /health {worst_client:.3f} s; server loop lag {server['loop_lag']}; "
          f"{len(server['stalls'])} stalls > 0.25 s; {len(server['gc'])} collections > 20 ms")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(serve_main(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--block", type=int, default=100)
    p.add_argument("--out", required=True)
    p.add_argument("--src", default=None,
                   help="the dspark source tree the server runs (default: this checkout's src/), e.g. an older "
                   "commit's: git archive COMMIT src | tar -x -C /tmp/old")
    p.add_argument("--burn", type=int, default=0,
                   help="busy-loop processes run during the load: a machine as busy as the soak's (load ~15)")
    p.add_argument("serve_args", nargs="*", help="more dspark serve flags (after --)")
    run(p.parse_args())
