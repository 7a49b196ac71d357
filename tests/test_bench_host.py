"""benchmarks/bench_host.py at a small scale: the harness times every phase of a step in both workloads (its
figures are `make bench-host`'s business, not a test's)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_host  # noqa: E402


def test_measure_times_every_phase_of_both_workloads():
    flags = "--num-seqs 4 --steps 3 --warmup-steps 2 --min-len 8 --max-len 24 --baseline="
    result = bench_host.measure(bench_host.parse_args(flags.split()))
    decode, offline = result["workloads"]["decode"], result["workloads"]["offline"]
    assert (decode["steps"], decode["seqs_per_step"], decode["tokens_per_step"]) == (3, 4, 4)
    assert offline["steps"] > 8 and offline["tokens_per_step"] > offline["seqs_per_step"]  # prefills among them
    for figures in (decode, offline):
        assert list(figures["ms_per_step"]) == [
            *(p for p in bench_host.PHASES if p not in (bench_host.MODEL, bench_host.DELIVER)),
            bench_host.HOST,
            bench_host.MODEL,
            bench_host.DELIVER,
        ]
        assert figures["ms_per_step"][bench_host.HOST] > 0
