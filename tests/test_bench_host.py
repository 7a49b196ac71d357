"""benchmarks/bench_host.py at a small scale: the harness times every phase of a step in both workloads (its
figures are `make bench-host`'s business, not a test's)."""

import importlib
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_host  # noqa: E402

from lmgate.engine.sampling.sampler import SamplingParams  # noqa: E402


def test_measure_times_every_phase_of_both_workloads():
    """With --penalties and --stop-strings, which every measured request then has; with --detail, the pieces
    inside the phases too; and every hooked method put back after."""
    flags = "--num-seqs 4 --steps 3 --warmup-steps 2 --min-len 8 --max-len 24 --baseline= --penalties --stop-strings"
    flags += " --detail"
    hooked = {(module, owner, method) for _, module, owner, method in bench_host.HOOKS + bench_host.DETAIL_HOOKS}
    methods = {(owner, method): engine_method(module, owner, method) for module, owner, method in hooked}
    args = bench_host.parse_args(flags.split())
    measured = bench_host.sampling(args, SamplingParams(temperature=0.6))
    assert measured.penalized and measured.stop == bench_host.STOP_STRINGS
    plain = bench_host.sampling(bench_host.parse_args([]), SamplingParams(temperature=0.6))
    assert not plain.penalized and plain.stop == ()
    result = bench_host.measure(args)
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
        assert {"prepare", "prefix keys"} <= set(figures["detail"])
    assert offline["detail"]["plan"][1] > 0  # calls a step: its prefills' made row by row
    assert decode["detail"]["plan: followed"][1] == 1 and "plan" not in decode["detail"]  # each the one before's
    assert methods == {(owner, method): engine_method(module, owner, method) for module, owner, method in hooked}


def engine_method(module: str, owner: str, method: str):
    return getattr(importlib.import_module(f"lmgate.engine.{module}"), owner).__dict__[method]


def test_ids_only_requests_write_no_text_and_the_table_shows_the_phase_only_the_baseline_has(capsys):
    """--ids-only (the gateway's worker protocol): no step detokenizes; beside a run that writes text, the
    detokenizer's row is still printed, blank on this side."""
    flags = "--num-seqs 4 --steps 3 --warmup-steps 2 --min-len 8 --max-len 24 --baseline= --workload decode"
    ids_only = bench_host.measure(bench_host.parse_args([*flags.split(), "--ids-only"]))
    with_text = bench_host.measure(bench_host.parse_args(flags.split()))
    assert "detokenize" not in ids_only["workloads"]["decode"]["ms_per_step"]
    assert with_text["workloads"]["decode"]["ms_per_step"]["detokenize"] > 0
    bench_host.report(ids_only, with_text, "text")
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    names = [cells[0].strip() for cells in rows]
    assert names.index("detokenize") == names.index("update") + 1
    assert [cell.strip() for cell in rows[names.index("detokenize")][1:3]] == ["—", "—"]
    goal = [line for line in out.splitlines() if "less the sampler's arithmetic" in line]
    assert len(goal) == 1 and goal[0].count(" ms a step") == 2  # this tree's figure and the baseline's
    floor = (ids_only["sampler_floor_ms"] + with_text["sampler_floor_ms"]) / 2
    host = bench_host.HOST
    mine, theirs = (run["workloads"]["decode"]["ms_per_step"][host] - floor for run in (ids_only, with_text))
    assert f"{mine:.3f} against {theirs:.3f} ms ({mine / theirs:.2f}x)" in out  # both less the same floor
    bench_host.report({**ids_only, "clock": "cpu"}, None, "")
    out = capsys.readouterr().out
    assert "phases in the CPU time of their thread" in out and "less the sampler's arithmetic" not in out


def test_the_cpu_clock_counts_a_threads_work_not_its_waits():
    """--clock cpu: a phase that waits (here a sleep, as a loop waiting for the GIL) counts next to nothing;
    on the wall clock it counts whole."""
    import time

    for clock, waited in (("wall", True), ("cpu", False)):
        rec = bench_host.Recorder(bench_host.CLOCKS[bench_host.parse_args(["--clock", clock]).clock])
        rec.current = {}
        rec.wrap(lambda: time.sleep(0.05), "probe")()
        assert (rec.current["probe"][0] >= 0.05) is waited


def test_rounds_report_each_figure_as_the_median_of_the_rounds_that_have_it():
    """--rounds: per phase, the sampler's floor, throughput and the pieces inside the phases, the median of the
    rounds; a phase only some rounds have is the median of those."""

    def run(ms: float, floor: float, extra: bool = False) -> dict:
        phases = {"schedule": ms, bench_host.HOST: 2 * ms, **({"detokenize": ms} if extra else {})}
        workload = {"ms_per_step": phases, "us_per_seq": {k: v * 4 for k, v in phases.items()}, "tok_s": 100 * ms}
        workload["detail"] = {"plan": [ms / 2, 1.0]}
        return {"sampler_floor_ms": floor, "workloads": {"decode": workload}}

    merged = bench_host.median_run([run(1.0, 0.5), run(9.0, 0.7, extra=True), run(2.0, 0.6, extra=True)])
    decode = merged["workloads"]["decode"]
    assert merged["rounds"] == 3 and merged["sampler_floor_ms"] == 0.6
    assert decode["ms_per_step"] == {"schedule": 2.0, bench_host.HOST: 4.0}  # the first round's phases
    assert decode["us_per_seq"]["schedule"] == 8.0 and decode["tok_s"] == 200.0
    assert decode["detail"]["plan"] == [1.0, 1.0]
    merged = bench_host.median_run([run(9.0, 0.7, extra=True), run(1.0, 0.5), run(2.0, 0.6, extra=True)])
    assert merged["workloads"]["decode"]["ms_per_step"]["detokenize"] == 5.5  # of the two rounds that have it


def test_the_rounds_import_this_tree_from_a_copy_of_its_packages_as_they_are():
    """Both sides of a run in rounds import from copies under the temporary directory: this checkout's is
    its packages with their changes, which a child imports (its code path names the copy)."""
    with bench_host.copy_of_this_tree() as tree:
        assert bench_host.same_files(os.path.join(tree, "engine"), os.path.join(bench_host.ROOT, "engine"))
        assert bench_host.same_files(os.path.join(tree, "service"), os.path.join(bench_host.ROOT, "service"))
        env = {**os.environ, bench_host.CODE_ENV: tree}
        probe = "import sys; sys.argv = ['x']; import bench_host, lmgate.engine; print(lmgate.engine.__file__)"
        where = subprocess.run(
            [sys.executable, "-c", probe],
            env=env,
            cwd=os.path.dirname(bench_host.__file__),
            capture_output=True,
            text=True,
        )
        assert where.stdout.strip() == os.path.join(tree, "engine", "__init__.py"), where.stderr
    assert not os.path.exists(tree)
