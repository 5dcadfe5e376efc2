"""The hot instructions of one kernel from Nsight Compute's source page, as a short text table.

    ncu -i report.ncu-rep --page source --csv --print-source sass | python scripts/ncu_source_summary.py

The source page has one row per SASS instruction and a column per metric (stall samples by
reason, shared-memory wavefronts, ...); a whole kernel is thousands of rows, too many to bring
back from the device. Printed: the kernel's totals of every stall-reason and excessive-wavefront
column, then the `--top` instructions by sampled stalls with their non-zero columns of those kinds.
The column names are matched by substring because they differ between ncu versions.
"""
import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All"


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    lines = [line for line in sys.stdin if not line.startswith("==")]
    rows = list(csv.reader(lines))
    header_at = next((i for i, row in enumerate(rows) if any(SAMPLES in c for c in row)), None)
    if header_at is None:
        print("no stall-sampling column in the source page; first lines:", *lines[:5], sep="\n")
        return 1
    header, body = rows[header_at], [r for r in rows[header_at + 1:] if len(r) == len(rows[header_at])]
    samples = next(i for i, c in enumerate(header) if SAMPLES in c)
    source = next((i for i, c in enumerate(header) if c.strip('"') == "Source"), 1)
    address = next((i for i, c in enumerate(header) if "Address" in c), 0)
    watched = [i for i, c in enumerate(header)
               if i != samples and ("stall" in c.lower() or "Excessive" in c or "Wavefronts" in c)]
    total = sum(number(r[samples]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} stall samples")
    print("kernel totals:")
    for i in watched:
        column_total = sum(number(r[i]) for r in body)
        if column_total:
            print(f"  {header[i]}: {column_total:.0f}")
    print(f"top {args.top} instructions by stall samples (share of all samples):")
    for row in sorted(body, key=lambda r: -number(r[samples]))[:args.top]:
        details = ", ".join(f"{header[i]}={row[i]}" for i in watched if number(row[i]))
        print(f"  {row[address]} {number(row[samples]) / total:6.1%}  {row[source].strip()[:60]:60s} {details}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
