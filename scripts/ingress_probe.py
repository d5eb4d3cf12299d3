"""How fast can blocks arrive into a GPU on copy engines: pulled by it, pushed by the peers, or both?

Issue 3's reduce-scatter at llama70b_qkv M8k on 4 x H200 is bound by ingress: each GPU pulls
3 x 40 MiB on one copy stream at ~300 GB/s, slower than the matmuls that produce the blocks
(BENCHMARKS.md, session 6). This probe measures whether splitting the work between the receiver's
copy engines (pulls) and the senders' (pushes) brings more bytes per second into each GPU:

  pull1      the receiver pulls its peers' blocks one after another on one stream (the executor's way)
  pullN      the receiver pulls from every peer at once, one stream per peer
  push       every peer pushes its block on its own stream
  pull+push  each block half pulled by the receiver (one stream), half pushed by its peer

each with one receiver (GPU 0) and with every GPU receiving at once (as in a reduce-scatter).
Timing: CUDA events; a start event, recorded after ~1 ms of GPU sleep so that the host has
enqueued every copy by then, that every copy stream waits for; an end event per stream; and a
timing stream of the receiver (of GPU 0 for "every GPU") that waits for all of them; median of
--trials runs after two warm-up runs. One process drives every GPU; cudaMemcpyAsync
through ctypes on streams PyTorch creates (the stream's device runs the copy).

  python3 scripts/ingress_probe.py [--mib 40,8] [--trials 20] [--out DIR]

Measurement only: needs torch and 2+ GPUs with peer access; not part of the library.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import json
import os
import statistics

import torch

COPY_DEFAULT = 4  # cudaMemcpyDefault: unified addressing decides the direction


def _cudart():
    for name in ("libcudart.so", ctypes.util.find_library("cudart"), "/usr/local/cuda/lib64/libcudart.so"):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("ingress_probe: libcudart.so not found (set LD_LIBRARY_PATH to the CUDA runtime's folder)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="40,8", help="block sizes in MiB (comma-separated)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "out/ingress"))
    args = parser.parse_args()
    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit(f"ingress_probe: needs 2 or more GPUs, this machine has {n}")
    rt = _cudart()
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    for a in range(n):
        rt.cudaSetDevice(a)
        for b in range(n):
            if a != b:
                rc = rt.cudaDeviceEnablePeerAccess(b, 0)
                if rc not in (0, 704):  # 704: already enabled
                    raise SystemExit(f"ingress_probe: cudaDeviceEnablePeerAccess({a} -> {b}) failed with {rc}")
    # streams[d][k]: copy streams of device d: k = peer for the per-peer pulls and the pushes, k = n for
    # the single pull stream (so a device's pulls and pushes never share a stream); leads[d]: timing.
    streams = [[torch.cuda.Stream(device=d) for _ in range(n + 1)] for d in range(n)]
    leads = [torch.cuda.Stream(device=d) for d in range(n)]

    def copy(stream, dev, dst, src, nbytes):
        rt.cudaSetDevice(dev)
        rc = rt.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, COPY_DEFAULT,
                                ctypes.c_void_p(stream.cuda_stream))
        if rc:
            raise SystemExit(f"ingress_probe: cudaMemcpyAsync failed with {rc}")

    rows = []
    for mib in [int(m) for m in args.mib.split(",") if m]:
        nbytes = mib << 20
        # src[d]: a block on device d for every peer; dst[d]: the arrivals of device d, one slot per peer.
        src = [torch.randn(n, nbytes // 2, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(n)]
        dst = [torch.empty(n, nbytes // 2, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(n)]

        def enqueue(mode, receivers):
            """The copies of one trial; returns the (device, stream) pairs used."""
            used = set()
            for r in receivers:
                for p in (p for p in range(n) if p != r):
                    s_ptr, d_ptr = src[p][r].data_ptr(), dst[r][p].data_ptr()
                    if mode == "pull1":
                        copy(streams[r][n], r, d_ptr, s_ptr, nbytes); used.add((r, n))
                    elif mode == "pullN":
                        copy(streams[r][p], r, d_ptr, s_ptr, nbytes); used.add((r, p))
                    elif mode == "push":
                        copy(streams[p][r], p, d_ptr, s_ptr, nbytes); used.add((p, r))
                    else:  # pull+push: first half pulled, second half pushed
                        half = nbytes // 2
                        copy(streams[r][n], r, d_ptr, s_ptr, half); used.add((r, n))
                        copy(streams[p][r], p, d_ptr + half, s_ptr + half, half); used.add((p, r))
            return used

        for who, receivers in (("one receiver", [0]), ("every GPU", list(range(n)))):
            for mode in ("pull1", "pullN", "push", "pull+push"):
                times = []
                for trial in range(args.trials + 2):  # two warm-up trials
                    for d in range(n):
                        torch.cuda.synchronize(d)
                    lead = leads[receivers[0]]
                    with torch.cuda.device(receivers[0]), torch.cuda.stream(lead):
                        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time: the host enqueues every copy meanwhile
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(lead)
                    # every copy stream waits for `start`, then the copies, then `lead` waits for all
                    for d in range(n):
                        for s in streams[d]:
                            s.wait_event(start)
                    used = enqueue(mode, receivers)
                    for d, k in used:
                        done = torch.cuda.Event()
                        done.record(streams[d][k])
                        lead.wait_event(done)
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(lead)
                    end.synchronize()
                    if trial >= 2:
                        times.append(start.elapsed_time(end))
                ms = statistics.median(times)
                into_each = (n - 1) * nbytes
                rows.append({"block_mib": mib, "receivers": who, "mode": mode, "ms": ms,
                             "ingress_gbps_per_receiver": into_each / (ms * 1e-3) / 1e9,
                             "spread_ms": (max(times) - min(times)) / 2})
                print(json.dumps(rows[-1]), flush=True)
        del src, dst
    os.makedirs(args.out, exist_ok=True)
    result = {"what": __doc__.split("\n\n")[0], "gpus": n, "device": torch.cuda.get_device_name(0),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "trials": args.trials, "rows": rows}
    with open(os.path.join(args.out, "ingress_probe.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print("| block | receivers | " + " | ".join(("pull1", "pullN", "push", "pull+push")) + " |  (GB/s into each receiver)")
    for mib in sorted({r["block_mib"] for r in rows}, reverse=True):
        for who in ("one receiver", "every GPU"):
            cells = [next(r for r in rows if r["block_mib"] == mib and r["receivers"] == who and r["mode"] == m)
                     for m in ("pull1", "pullN", "push", "pull+push")]
            print(f"| {mib} MiB | {who} | " + " | ".join(f"{c['ingress_gbps_per_receiver']:.0f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
