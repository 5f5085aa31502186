"""What else used the host's CPUs while an engine was timed (bench_e2e's timed passes).

On the small SmolLM2 pair a decode step is bound by the host (Python scheduling and launches), so another busy
process on the GPU host moves its tokens/s. Engines run one after another in one call, and on an H100 (2026-12-07)
the engine run last was 0.5-2.5 ms a step dearer than the one before it with nothing in its own code to explain it;
whether the host was busier then could not be told. ``snapshot`` reads the CPU time of every process (``/proc``) and
of the whole machine; ``cpu_use`` is the difference over a timed pass: what the timed engine's own processes used,
what every other process used (the busiest named), and the machine's steal time.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_times(proc: Path = Path("/proc")) -> dict[int, tuple[str, int, float]]:
    """pid -> (command name, parent pid, user + system CPU seconds); processes that vanish while read are skipped."""
    out = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ... utime stime ...": comm may hold spaces and parentheses, so split after the last ")"
        name = text[text.index("(") + 1: text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[int(entry.name)] = (name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _machine_times(stat: Path = Path("/proc/stat")) -> tuple[float, float] | None:
    """(all CPU seconds, steal seconds) summed over the machine's CPUs, or None where /proc/stat is absent."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in first[1:]]
    return sum(ticks[:8]) / _TICK, (ticks[7] if len(ticks) > 7 else 0) / _TICK


def snapshot(monotonic: float, proc: Path = Path("/proc")) -> dict:
    return {"t": monotonic, "processes": _process_times(proc), "machine": _machine_times(proc / "stat")}


def _descendants(root: int, processes: dict[int, tuple[str, int, float]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def cpu_use(before: dict, after: dict, own_root: int, top: int = 3) -> dict | None:
    """CPU use over the interval between two snapshots, in CPU-seconds per second: ``own`` by ``own_root``'s process
    tree (the timed engine: the bench worker and the engine core it started), ``elsewhere`` by every other process,
    the ``top`` busiest of those ``[name[pid], cpus]``, and ``steal``, the machine's share of CPU time a hypervisor
    took. A process that ended inside the interval is not seen. None without /proc."""
    seconds = after["t"] - before["t"]
    if seconds <= 0 or not after["processes"]:
        return None
    own_pids = _descendants(own_root, after["processes"]) | _descendants(own_root, before["processes"])
    own, used = 0.0, []
    for pid, (name, _, cpu) in after["processes"].items():
        start = before["processes"].get(pid)
        # A process started during the interval used all its CPU time inside it; a reused pid is another process.
        delta = cpu - start[2] if start and start[0] == name and cpu >= start[2] else cpu
        if pid in own_pids:
            own += delta
        elif delta > 0:
            used.append((delta / seconds, f"{name}[{pid}]"))
    used.sort(reverse=True)
    steal = None
    if before["machine"] and after["machine"]:
        total = after["machine"][0] - before["machine"][0]
        steal = round((after["machine"][1] - before["machine"][1]) / total, 4) if total > 0 else None
    return {"own": round(own / seconds, 3), "elsewhere": round(sum(u for u, _ in used), 3),
            "busiest": [[n, round(u, 3)] for u, n in used[:top]], "steal": steal, "seconds": round(seconds, 2)}
