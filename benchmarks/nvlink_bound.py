"""How close the `nvlink` round trip can come to the peer-copy ceiling, from its measured parts.

Reads a ``benchmarks/dispatch.py`` results JSON whose rows carry the gathered round trip's parts (graphed ms,
``gathered_phases``) and puts each measured part-sum beside the ceiling (a plain peer copy of the token bytes
both ways, ``peer_copy_ms``):

    round trip      the gathered dispatch + combine as it runs (the dispatcher's CTAs)
    sums hidden     the same less the owner's per-token sums (what it would take with them under other work)
    wire, N CTAs    the copy kernels alone, send + barrier + pull: nothing local left, N CTAs (the dispatcher's,
                    and FEW_CTAS = 24): the most any overlap of local work can reach with kernel copies at that budget
    copy engines    tokens sent and sums pulled by the copy engines (no SM moves a byte), the sums included

Each figure is ceiling / time, so 100% is the peer copy's rate; CPU only:

    python benchmarks/nvlink_bound.py benchmarks/results/dispatch_ep2_copy_engine_2xH200.json --gpu H200
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

FEW = 24  # benchmarks/dispatch.py FEW_CTAS: the small SM budget its *_c24 columns ran at


def of_ceiling(row: dict) -> dict:
    """Percent of the ceiling each part-sum of one results row reaches (keys absent where not measured)."""
    c = row["peer_copy_ms"]
    pct = lambda ms: round(100 * c / ms, 1)  # noqa: E731
    out = {"T": row["T"], "D": row["D"], "routing": row["routing"], "ctas": row.get("nvlink_sms"),
           "round_trip_pct": pct(row["gathered_graph_ms"]),
           "sums_hidden_pct": pct(row["gathered_graph_ms"] - row["owner_sum_graph_ms"]),
           "wire_pct": pct(row["send_kernel_graph_ms"] + row["barrier_graph_ms"] + row["pull_kernel_graph_ms"])}
    if f"send_kernel_c{FEW}_graph_ms" in row:
        out[f"wire_{FEW}_ctas_pct"] = pct(row[f"send_kernel_c{FEW}_graph_ms"] + row["barrier_graph_ms"]
                                          + row[f"pull_kernel_c{FEW}_graph_ms"])
    if "send_tokens_ce_graph_ms" in row:
        out["copy_engines_pct"] = pct(row["send_tokens_ce_graph_ms"] + row["sum_back_ce_graph_ms"])
    out["owner_sums_ms"] = round(row["owner_sum_graph_ms"], 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a benchmarks/dispatch.py results JSON with the gathered round trip's parts")
    ap.add_argument("--gpu", default="H200", help="the GPU the results ran on (names the output file)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    a = ap.parse_args()
    with open(a.results) as f:
        rows = [of_ceiling(r) for r in json.load(f)["rows"] if "owner_sum_graph_ms" in r]
    if not rows:
        sys.exit(f"error: {a.results} has no round-trip parts (owner_sum_graph_ms); run benchmarks/dispatch.py "
                 "with its gathered phases")
    table = (f"Percent of the peer-copy ceiling, from {os.path.basename(a.results)}\n\n"
             + markdown_table(rows, list(rows[0])))
    print(table)
    write_results(f"nvlink_bound_{a.gpu}", {**environment(), "gpu": "cpu", "measured_on": a.gpu}, rows, table, a.out,
                  script=f"benchmarks/nvlink_bound.py {os.path.relpath(a.results, ROOT)} --gpu {a.gpu}")


if __name__ == "__main__":
    main()
