"""One configuration of ``rrh bench audit``, measured in a fresh Python process: the read floor or an
audit (serial, process pool, Ray), its wall and CPU time from after the imports, its peak RSS and
that of its workers (``VmHWM`` from ``/proc``), and what it found. ``run_in_child`` starts the
process and reads its one JSON line; ``harness.bench.audit`` compares the configurations.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


class _Peak(threading.Thread):
    """Polls the RSS high-water mark and CPU time of this process and all its descendants, and the
    CPU time of each of their threads (a serial audit reads ahead on a second thread; a thread that
    ended counts with its last reading, up to ``interval`` short).

    ``VmHWM`` never decreases, so the last reading of each process is its peak up to then; a
    reading every ``interval`` seconds catches workers (forked, spawned, raylet's) while they run.
    Descendants are found through ``/proc/<pid>/task/<tid>/children`` (the poller costs well under
    1% of a CPU).
    """

    def __init__(self, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.hwm: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.thread_cpu: dict[tuple[int, int], float] = {}
        self.names: dict[int, str] = {}
        self._stop_event = threading.Event()
        self.supported = Path("/proc/self/task").is_dir()
        self._ticks = os.sysconf("SC_CLK_TCK") if self.supported else 100
        self.baseline: dict[int, float] = {}
        self.thread_baseline: dict[tuple[int, int], float] = {}

    @staticmethod
    def _children(pid: int) -> list[int]:
        found: list[int] = []
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                with open(f"{task.path}/children") as handle:
                    found.extend(int(child) for child in handle.read().split())
        except OSError:
            pass
        return found

    def _cpu(self, stat: str) -> float:
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / self._ticks

    def sample(self) -> None:
        frontier = [os.getpid()]
        while frontier:
            pid = frontier.pop()
            frontier.extend(self._children(pid))
            try:
                with open(f"/proc/{pid}/status") as handle:
                    status = handle.read()
                with open(f"/proc/{pid}/stat") as handle:
                    stat = handle.read()
            except OSError:
                continue
            hwm = status.split("VmHWM:", 1)[1].split(None, 2) if "VmHWM:" in status else None
            if hwm:
                self.hwm[pid] = max(self.hwm.get(pid, 0), int(hwm[0]) * 1024)
            self.names[pid] = stat[stat.index("(") + 1 : stat.rindex(")")]
            self.cpu[pid] = self._cpu(stat)
            self._threads(pid)

    def _threads(self, pid: int) -> None:
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                with open(f"{task.path}/stat") as handle:
                    self.thread_cpu[(pid, int(task.name))] = self._cpu(handle.read())
        except (OSError, ValueError):
            pass

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.sample()

    def mark(self) -> None:
        """Count CPU time from now on (what each process has used so far is left out)."""
        self.sample()
        self.baseline = dict(self.cpu)
        self.thread_baseline = dict(self.thread_cpu)

    def stop(self) -> dict[str, Any]:
        self._stop_event.set()
        self.join()
        self.sample()
        me = os.getpid()
        for pid, before in self.baseline.items():
            if pid in self.cpu:
                self.cpu[pid] -= before
        others = {pid: hwm for pid, hwm in self.hwm.items() if pid != me}
        busiest = max(self.cpu, key=lambda pid: self.cpu[pid]) if self.cpu else None
        threads = [cpu - self.thread_baseline.get(key, 0.0) for key, cpu in self.thread_cpu.items()]
        return {
            "rss_peak_bytes": self.hwm.get(me),
            "rss_peak_worker_bytes": max(others.values()) if others else None,
            "processes": len(self.hwm),
            "cpu_s": round(sum(self.cpu.values()), 2),
            "cpu_busiest_s": round(self.cpu[busiest], 2) if busiest is not None else None,
            "cpu_busiest_thread_s": round(max(threads), 2) if threads else None,
            "cpu_by_process": sorted(
                ((self.names.get(pid, "?"), round(cpu, 2)) for pid, cpu in self.cpu.items() if cpu >= 0.05),
                key=lambda item: -item[1],
            ),
        }


def _read_floor(paths: list[str], use_threads: bool) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from harness.audit.layout.reader import AUDIT_COLUMNS

    decoded = 0
    for path in paths:
        handle = pq.ParquetFile(path)
        for index in range(handle.metadata.num_row_groups):
            table = handle.read_row_group(index, columns=list(AUDIT_COLUMNS), use_threads=use_threads)
            decoded += table.nbytes
            del table
    return {"decoded_bytes": decoded}


def run_config(config: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in this (fresh) process: wall and CPU time, peak RSS, what it found.

    The clock and the CPU count start after the imports (and, for Ray, the cluster's start) and
    stop when the last figure is in: what is measured is reading, or reading and auditing.
    """
    peak = _Peak()
    if peak.supported:
        peak.start()
    out: dict[str, Any] = {}
    floor = config["name"].startswith("read_floor")
    if floor:
        import pyarrow.parquet  # noqa: F401

        from harness.audit.layout.reader import AUDIT_COLUMNS  # noqa: F401
    else:
        from harness.audit import audit_run
    if config.get("executor") == "ray":
        import ray

        started = time.perf_counter()
        ray.init(
            num_cpus=config["workers"],
            include_dashboard=False,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        out["cluster_start_s"] = round(time.perf_counter() - started, 2)
    if peak.supported:
        peak.mark()
    started = time.perf_counter()
    if floor:
        paths = [str(p) for p in sorted(Path(config["run"]).rglob("*.parquet"))]
        out.update(_read_floor(paths, use_threads=config["name"] == "read_floor_threads"))
    else:
        result = audit_run(
            config["run"],
            executor=config["executor"],
            workers=config["workers"],
            read_ahead=config["name"] != "serial_one_thread" if config["executor"] == "serial" else None,
        )
        out["result"], out["samples"] = result.as_dict(), result.rows
    out["wall_s"] = time.perf_counter() - started
    out.update(peak.stop() if peak.supported else {"rss_peak_bytes": None, "rss_peak_worker_bytes": None})
    if config.get("executor") == "ray":
        ray.shutdown()
    return out


def run_in_child(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    code = (
        "import json, sys; from harness.bench.audit_child import run_config; "
        "print(json.dumps(run_config(json.loads(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench audit: {config['name']} failed ({done.returncode}): {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out["load_average"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return out
