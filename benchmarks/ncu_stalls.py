"""Summarize an ncu per-instruction source export (``ncu --page source --print-source sass --csv``
of a run of benchmarks/profile_kernels.py): warp stall reasons as shares of all samples, the instructions
with the most samples, and samples and executed warp instructions inside the kernel's last loop
(the span up to its last backward branch) against before it.

    python benchmarks/ncu_stalls.py NCU_SOURCE.csv [--keys 4194304]

``--keys``: the keys the profiled launch processed, to print warp instructions per 32 keys.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from collections import Counter


def read(path):
    text = open(path).read()
    rows = list(csv.reader(io.StringIO(text[text.index('"Address"'):])))
    hdr = rows[0]
    return hdr, [r for r in rows[1:] if len(r) == len(hdr)]


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--keys", type=int, default=0)
    a = ap.parse_args(argv)
    hdr, rows = read(a.csv)
    col = {h: i for i, h in enumerate(hdr)}
    samples = [num(r[col["Warp Stall Sampling (All Samples)"]]) for r in rows]
    executed = [num(r[col["Instructions Executed"]]) for r in rows]
    total = sum(samples)
    stalls = Counter()
    for h, i in col.items():
        if h.startswith("stall_") and "Not Issued" not in h:
            stalls[h] = sum(num(r[i]) for r in rows)
    print(f"{a.csv}: {total:.0f} samples")
    for name, v in stalls.most_common(8):
        print(f"  {name:24s} {100 * v / total:5.1f} %")
    print("  instructions with the most samples:")
    for j in sorted(range(len(rows)), key=lambda j: -samples[j])[: a.top]:
        print(f"    {samples[j]:5.0f} ({100 * samples[j] / total:4.1f} %)  {rows[j][col['Source']].strip()}")
    # The last loop: from the target of the last backward branch to that branch.
    addr = [int(r[col["Address"]], 16) for r in rows]
    back = [(j, int(m.group(1), 16)) for j, r in enumerate(rows)
            if (m := re.search(r"BRA\s+0x([0-9a-f]+)", r[col["Source"]])) and int(m.group(1), 16) < addr[j]]
    if back:
        end, target = back[-1]
        start = addr.index(target)
        inside = sum(samples[start:end + 1])
        ins = sum(executed[start:end + 1])
        print(f"  loop (instructions {start}-{end}): {100 * inside / total:.1f} % of samples, "
              f"{ins:.0f} warp instructions executed; before it: {100 * sum(samples[:start]) / total:.1f} %")
        if a.keys:
            print(f"  loop warp instructions per 32 keys: {ins / (a.keys / 32):.1f}")


if __name__ == "__main__":
    main()
