"""Print a compact GPU timeline of one device from `nsys stats --report cuda_gpu_trace --format csv`.

Usage: python benchmarks/suites/nsys_timeline.py TRACE.csv [DEVICE] [FIRST_EVENT] [COUNT]
Shows start (us, relative), duration (us), stream and a short name for kernels and memcpys.
"""
import csv
import sys

path = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "0"
first = int(sys.argv[3]) if len(sys.argv) > 3 else 0
count = int(sys.argv[4]) if len(sys.argv) > 4 else 80
rows = list(csv.DictReader(open(path)))
def col(r, *names):
    for n in names:
        for k in r:
            if k.startswith(n):
                return r[k]
    return ""
rows = [r for r in rows if col(r, "Device") in ("", device) or device in col(r, "Device")]
rows.sort(key=lambda r: int(col(r, "Start")))
t0 = int(col(rows[0], "Start")) if rows else 0
print(f"{len(rows)} GPU events on device {device}")
prev_end = {}
for r in rows[first:first + count]:
    start = (int(col(r, "Start")) - t0) / 1e3
    dur = int(col(r, "Duration")) / 1e3
    strm = col(r, "Strm", "Stream")
    name = col(r, "Name")[:60]
    size = col(r, "Bytes")
    gap = start - prev_end.get(strm, start)
    prev_end[strm] = start + dur
    print(f"{start:10.1f} {dur:8.1f} gap{gap:7.1f} s{strm:>4} {name} {size}")
# Per-name totals
tot = {}
for r in rows:
    k = col(r, "Name")[:40]
    tot[k] = tot.get(k, 0) + int(col(r, "Duration")) / 1e3
print("totals (us):", {k: round(v) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:8]})
