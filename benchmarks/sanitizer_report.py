"""Summarise a compute-sanitizer log: each distinct finding once, with its count, the kernel it was
found in and the first Python frame of its host backtrace (where the launch or API call came from).

    python benchmarks/sanitizer_report.py run.log [--ignore nccl,nvjet,cudnn]

Findings in kernels whose names contain an ``--ignore`` substring (vendor libraries the tools are
known to misread: NCCL's partial-block barriers under synccheck, cuBLAS's and cuDNN's asynchronous
(TMA) shared-memory copies under racecheck), and failed API calls that are probes (NCCL's kernel
images at init, torch's symmetric-memory fabric-handle check) are counted apart. Exit code 1 when any other finding
remains.
"""

import argparse
import re
import sys
from collections import Counter

HEADER = re.compile(r"^========= (?!\s)(?!COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Target application)(.+)$")
KERNEL = re.compile(r"^=========\s+(?:at|and \w+ access at)\s+(?:0x[0-9a-f]+ in )?([^\s(+]+)")
PYFRAME = re.compile(r"Host Frame: (\S+) in (\S+\.py):(\d+)")


def findings(lines):
    """Yield (header, kernel, python_frame) per finding block."""
    block = None
    for line in lines:
        m = HEADER.match(line)
        if m:
            if block:
                yield block
            head = re.sub(r"0x[0-9a-f]+|\(\d+,\d+,\d+\)|\[\d+ hazards\]|\d+ bytes", "#", m.group(1)).strip()
            block = [head, None, None]
            if "access at" in head:  # racecheck puts the kernel in the header
                block[1] = re.search(r"access at (?:# in )?([^\s(+]+)", head).group(1)
            continue
        if block is None:
            continue
        k = KERNEL.match(line)
        if k and block[1] is None:
            block[1] = k.group(1)
        if block[1] is None and "Host Frame:" in line and "libnccl" in line:
            block[1] = "nccl (host API call)"  # NCCL probing its kernels at init
        if block[1] is None and "isFabricSupported" in line:
            block[1] = "fabric probe (host API call)"  # torch's symmetric memory probing fabric handles
        p = PYFRAME.search(line)
        if p and block[2] is None:
            block[2] = f"{p.group(1)} ({p.group(2).split('/site-packages/')[-1].split('/work/main/')[-1]}:{p.group(3)})"
        if line.strip() == "=========":
            yield block
            block = None
    if block:
        yield block


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--ignore", default="nccl,nvjet,cudnn,fabric probe")
    a = ap.parse_args()
    ignore = [s for s in a.ignore.split(",") if s]
    with open(a.log, errors="replace") as f:
        counts = Counter(tuple(b) for b in findings(f))
    ours = {k: n for k, n in counts.items() if not any(s in (k[1] or "") or s in k[0] for s in ignore)}
    vendor = sum(counts.values()) - sum(ours.values())
    print(f"{a.log}: {sum(ours.values())} findings outside {ignore} ({len(ours)} distinct); {vendor} inside")
    for (head, kernel, frame), n in sorted(ours.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {n:5d}x {head[:110]}" + (f" | kernel {kernel[:70]}" if kernel else "") + (f" | from {frame}" if frame else ""))
    sys.exit(1 if ours else 0)


if __name__ == "__main__":
    main()
