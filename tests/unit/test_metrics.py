"""Metrics: JSON-lines records, summaries, tables, plots, and the ledger's span listener (one process)."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpiopt.comm import Comm, Ledger, Request
from mpiopt.metrics import (
    add_speedups,
    EVAL_FIELDS,
    STEP_FIELDS,
    MetricsWriter,
    Run,
    Tracer,
    format_bytes,
    format_seconds,
    format_spread,
    markdown_table,
    repeats_table,
    overlap_fraction,
    plot_runs,
    read_metrics,
    summarize,
    versions,
)
from mpiopt.metrics.plots import running_mean

HEADER = {"kind": "run", "algorithm": "sgd", "task": "logistic", "config": {"lr": 0.1}, "world_size": 2, "versions": {}}


def step(n, **over):
    record = dict.fromkeys(STEP_FIELDS, 0.0)
    record.update(kind="step", step=n, algorithm="sgd", loss=1.0 / n, wall_seconds=0.1 * n, bytes_sent=100)
    record.update(over)
    return record


def evaluation(n, wall, sent, accuracy):
    record = dict.fromkeys(EVAL_FIELDS, 0.0)
    record.update(kind="eval", step=n, wall_seconds=wall, bytes_sent_total=sent, test_accuracy=accuracy, evaluated="average")
    return record


def write_lines(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


# -- records ---------------------------------------------------------------------------------
def test_writer_reader_round_trip_converts_numpy(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    end = {"kind": "end", "step": 2, "wall_seconds": 0.3, "bytes_sent_total": 200}
    header = {**HEADER, "versions": versions()}
    assert {"mpiopt", "python", "numpy", "mpi4py", "mpi"} <= set(header["versions"])
    with MetricsWriter(path) as out:
        out.write(header)
        out.write(step(1, loss=np.float32(0.5), bytes_sent=np.int64(100)))
        out.write(step(2, loss=float("nan")))
        out.write(evaluation(2, 0.25, 200, np.float64(0.75)))
        out.write(end)
    run = read_metrics(path)
    assert run.header == header and run.algorithm == "sgd" and run.end == end and run.resumes == []
    assert [s["step"] for s in run.steps] == [1, 2]
    assert run.steps[0]["loss"] == 0.5 and run.steps[0]["bytes_sent"] == 100 and math.isnan(run.steps[1]["loss"])
    assert run.evals == [evaluation(2, 0.25, 200, 0.75)]


def test_writer_rejects_unknown_kinds_and_missing_fields(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as out:
        with pytest.raises(ValueError, match="'stp'"):
            out.write({"kind": "stp"})
        incomplete = step(1)
        del incomplete["comm_seconds"]
        with pytest.raises(ValueError, match="comm_seconds"):
            out.write(incomplete)
        with pytest.raises(ValueError, match="'best'"):
            out.write({**evaluation(1, 0.1, 0, 0.5), "evaluated": "best"})
        with pytest.raises(TypeError, match="object"):
            out.write({**step(1), "loss": object()})
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_truncated_last_line_is_ignored_then_cut_on_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    write_lines(path, [HEADER, step(1), step(2)], tail='{"kind": "step", "step": 3, "lo')
    with pytest.warns(UserWarning, match="line 4: ignoring a truncated"):
        run = read_metrics(path)
    assert [s["step"] for s in run.steps] == [1, 2]
    with pytest.warns(UserWarning, match="partial last line of 31 bytes"):
        out = MetricsWriter(path)
    with out:
        out.write(step(3))
    assert [s["step"] for s in read_metrics(path).steps] == [1, 2, 3]


def test_garbage_names_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    write_lines(path, [HEADER, step(1)], tail="this is not json\n" + json.dumps(step(2)) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl, line 3: not JSON"):
        read_metrics(path)
    write_lines(path, [HEADER, [1, 2]])
    with pytest.raises(ValueError, match=r"line 2: not a metrics record"):
        read_metrics(path)
    write_lines(path, [step(1)])
    with pytest.raises(ValueError, match=r"line 1: the first record must be a 'run' header"):
        read_metrics(path)


def test_resume_from_an_earlier_step_replaces_the_later_records(tmp_path):
    path = tmp_path / "m.jsonl"
    end = {"kind": "end", "step": 5, "wall_seconds": 1.0, "bytes_sent_total": 500}
    write_lines(path, [HEADER] + [step(n) for n in range(1, 6)] + [evaluation(4, 0.4, 400, 0.5), end])
    with MetricsWriter(path) as out:
        out.write({**HEADER, "resumed_from_step": 3})
        for n in (4, 5, 6):
            out.write(step(n, loss=10.0 + n))
        out.write(evaluation(6, 0.6, 600, 0.7))
    run = read_metrics(path)
    assert [s["step"] for s in run.steps] == [1, 2, 3, 4, 5, 6]
    assert [s["loss"] for s in run.steps[3:]] == [14.0, 15.0, 16.0]
    assert [e["step"] for e in run.evals] == [4, 6]
    assert run.end is None and run.resumes == [{**HEADER, "resumed_from_step": 3}]
    with MetricsWriter(path, truncate=True) as out:
        out.write(HEADER)
    assert read_metrics(path).steps == []


# -- summary and table ---------------------------------------------------------------------
def hand_run():
    steps = [
        step(1, compute_seconds=1.0, algo_seconds=0.5, comm_seconds=0.25, wait_seconds=0.0, step_seconds=2.0),
        step(2, compute_seconds=2.0, algo_seconds=0.5, comm_seconds=0.75, wait_seconds=1.0, step_seconds=5.0),
    ]
    evals = [evaluation(10, 1.0, 100, 0.5), evaluation(20, 2.5, 250_000, 0.8), evaluation(30, 4.0, 400_000, 0.7)]
    end = {"kind": "end", "step": 30, "wall_seconds": 4.2, "bytes_sent_total": 420_000}
    return Run(header=HEADER, steps=steps, evals=evals, end=end)


def test_summarize_against_hand_computed_values():
    s = summarize(hand_run(), target_accuracy=0.75)
    assert (s["algorithm"], s["steps"], s["wall_seconds"]) == ("sgd", 30, 4.2)
    assert (s["final_accuracy"], s["best_accuracy"]) == (0.7, 0.8)
    assert (s["time_to_target"], s["bytes_to_target"], s["steps_to_target"]) == (2.5, 250_000, 20)
    assert s["bytes_sent_per_rank"] == 420_000
    # Steps' wall time 7 s: compute 3, algorithm 1, communication 1, waiting 1, other 7 - 6 = 1.
    expect = {"compute": 3.0, "algorithm": 1.0, "communication": 1.0, "waiting": 1.0, "other": 1.0}
    for key, seconds in expect.items():
        assert s[f"{key}_seconds"] == pytest.approx(seconds)
        assert s[f"{key}_fraction"] == pytest.approx(seconds / 7.0)
    never = summarize(hand_run(), target_accuracy=0.9)
    assert never["time_to_target"] is None and never["bytes_to_target"] is None
    with pytest.raises(ValueError, match="target_accuracy"):
        summarize(hand_run(), target_accuracy=75)


def loss_run():
    """hand_run with test losses 2.0, 1.2, 1.5 at its evaluations (steps 10, 20, 30)."""
    run = hand_run()
    for record, loss in zip(run.evals, (2.0, 1.2, 1.5)):
        record["test_loss"] = loss
    return run


def test_summarize_to_a_target_loss_takes_the_first_evaluation_at_or_below_it():
    s = summarize(loss_run(), target_loss=1.3)
    assert (s["final_loss"], s["best_loss"], s["target_loss"], s["target_accuracy"]) == (1.5, 1.2, 1.3, None)
    assert (s["time_to_target"], s["bytes_to_target"], s["steps_to_target"]) == (2.5, 250_000, 20)
    assert summarize(loss_run(), target_loss=1.2)["steps_to_target"] == 20  # at the target counts
    assert summarize(loss_run(), target_loss=1.1)["time_to_target"] is None
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="target_loss"):
            summarize(loss_run(), target_loss=bad)
    with pytest.raises(ValueError, match="not both"):
        summarize(loss_run(), target_accuracy=0.75, target_loss=1.3)


def test_tables_to_a_target_loss_name_it_and_show_the_test_loss():
    lines = markdown_table([summarize(loss_run(), target_loss=1.3)]).splitlines()
    assert lines[0].startswith("| algorithm | final accuracy | best accuracy | final loss | best loss | steps | wall time "
                               "| time to loss 1.3 | sent to loss 1.3 |")
    assert lines[2].startswith("| sgd | 70.0 % | 80.0 % | 1.5000 | 1.2000 | 30 | 4.20 s | 2.50 s | 250 kB | 420 kB |")
    other = summarize(loss_run(), target_loss=1.3)
    other["final_loss"] = 1.7
    lines = repeats_table([[summarize(loss_run(), target_loss=1.3), other]]).splitlines()
    assert "| final loss | best loss |" in lines[0] and "| time to loss 1.3 |" in lines[0]
    assert lines[2].startswith("| sgd | 2 | 70.0 % (70.0-70.0) | 80.0 % (80.0-80.0) | 1.6000 (1.5000-1.7000) | 1.2000 (1.2000-1.2000) |")


def test_a_language_models_table_shows_its_loss_in_bits_per_byte_and_perplexity_not_its_accuracy():
    run = loss_run()
    for record in run.evals:
        record["bits_per_byte"] = record["test_loss"] / math.log(2)
    s = summarize(run, target_loss=1.3)
    assert s["final_bits_per_byte"] == 1.5 / math.log(2) and s["final_perplexity"] == pytest.approx(math.exp(1.5))
    lines = markdown_table([s]).splitlines()
    assert lines[0].startswith("| algorithm | final loss | best loss | bits per byte | perplexity | steps | wall time | time to loss 1.3 |")
    assert lines[2].startswith("| sgd | 1.5000 | 1.2000 | 2.1640 | 4.48 | 30 | 4.20 s | 2.50 s |")
    assert "| sgd | 2 | 1.5000 (1.5000-1.5000) | 1.2000 (1.2000-1.2000) | 2.1640 (2.1640-2.1640) | 4.48 (4.48-4.48) |" in repeats_table([[s, s]])


def test_loss_at_a_budget_is_the_last_evaluation_within_it():
    # Evaluations at 1.0 s (loss 2.0), 2.5 s (1.2), 4.0 s (1.5).
    assert summarize(loss_run(), budget_seconds=3.0)["loss_at_budget"] == 1.2
    assert summarize(loss_run(), budget_seconds=4.0)["loss_at_budget"] == 1.5
    assert summarize(loss_run(), budget_seconds=0.5)["loss_at_budget"] is None
    assert summarize(loss_run())["loss_at_budget"] is None
    with pytest.raises(ValueError, match="budget_seconds"):
        summarize(loss_run(), budget_seconds=-3)
    lines = markdown_table([summarize(loss_run(), target_loss=1.3, budget_seconds=3)]).splitlines()
    assert "| best loss | loss at 3 s | steps |" in lines[0]
    assert lines[2].startswith("| sgd | 70.0 % | 80.0 % | 1.5000 | 1.2000 | 1.2000 | 30 |")
    late = summarize(loss_run(), budget_seconds=3)
    late["loss_at_budget"] = None  # a repeat with no evaluation within the budget
    lines = repeats_table([[summarize(loss_run(), budget_seconds=3), late]]).splitlines()
    assert "| best accuracy | loss at 3 s | steps |" in lines[0] and "| 1.2000 in 1 of 2 |" in lines[2]


def test_speedups_pair_runs_by_seed_against_the_baseline():
    def run(algorithm, seed, reached_at):
        one = hand_run()
        one.header = {**HEADER, "algorithm": algorithm, "config": {"seed": seed}}
        one.evals[1]["wall_seconds"] = reached_at  # the evaluation that reaches 75 %
        return summarize(one, target_accuracy=0.75)

    ddp = [run("ddp", 0, 4.0), run("ddp", 1, 6.0)]
    fast = [run("lsgd", 1, 2.0), run("lsgd", 0, 1.0)]  # seeds out of order: paired by seed, not position
    missed = run("regtopk", 0, 1.0)
    missed["time_to_target"] = None
    add_speedups(ddp + fast + [missed], "ddp")
    assert [s["speedup"] for s in ddp] == [1.0, 1.0]
    assert [s["speedup"] for s in fast] == [3.0, 4.0]
    assert missed["speedup"] is None
    lines = repeats_table([ddp, fast, [missed]]).splitlines()
    assert "| time to 75.0 % | speed-up over ddp | sent to 75.0 % |" in lines[0]
    assert "| 3.50x (3.00x-4.00x) |" in lines[3] and "| — |" in lines[4]
    assert "| 3.00x |" in markdown_table([fast[0]]).splitlines()[2]
    with pytest.raises(ValueError, match="no run of the baseline 'ddp'"):
        add_speedups(fast, "ddp")


def test_summarize_without_end_uses_the_latest_records():
    run = hand_run()
    run.end = None
    s = summarize(run, target_accuracy=None)
    # The last eval (step 30, 4.0 s) is later than the last step record (step 2).
    assert (s["steps"], s["wall_seconds"], s["bytes_sent_per_rank"]) == (30, 4.0, 400_000)
    assert s["time_to_target"] is None


def test_markdown_table_units_and_missing():
    reached = summarize(hand_run(), target_accuracy=0.75)
    slow = hand_run()
    slow.header = {**HEADER, "algorithm": "signum"}
    missed = summarize(slow, target_accuracy=0.95)
    missed["target_accuracy"] = 0.75  # one target for the table's header
    lines = markdown_table([reached, {**missed, "time_to_target": None, "bytes_to_target": None}]).splitlines()
    assert lines[0].startswith("| algorithm | final accuracy | best accuracy | steps | wall time | time to 75.0 % | sent to 75.0 % |")
    assert lines[2] == (
        "| sgd | 70.0 % | 80.0 % | 30 | 4.20 s | 2.50 s | 250 kB | 420 kB "
        "| 3.00 s (43 %) | 1.00 s (14 %) | 1.00 s (14 %) | 1.00 s (14 %) |"
    )
    assert lines[3].startswith("| signum | 70.0 % | 80.0 % | 30 | 4.20 s | — | — | 420 kB |")
    assert len(lines) == 4


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 999, 1000, 1_234_567, 9.996e6, 2.5e9, None)] == [
        "0 B", "999 B", "1.00 kB", "1.23 MB", "10.0 MB", "2.50 GB", "—"
    ]
    with pytest.raises(ValueError, match="-1"):
        format_bytes(-1)


def test_format_spread_median_and_range_by_hand():
    # median of 11.8, 13.1, 12.3 is 12.3; the ends share the median's unit, so it is written once.
    assert format_spread([11.8, 13.1, 12.3], format_seconds) == "12.3 s (11.8-13.1)"
    # even count: the mean of the middle two, (1.0 + 3.0) / 2 = 2.0
    assert format_spread([4.0, 1.0, 3.0, 0.5], format_seconds) == "2.00 s (0.5-4.00)"
    # ends in another unit than the median keep theirs: median 2 MB, range 900 B to 5 MB
    assert format_spread([900, 2e6, 5e6], format_bytes) == "2.00 MB (900 B-5.00 MB)"
    # repeats without a value are left out and counted; one value has no range
    assert format_spread([None, 2.5, None], format_seconds) == "2.50 s in 1 of 3"
    assert format_spread([None, None], format_seconds) == "—"


def test_repeats_table_has_medians_ranges_and_the_repeat_count():
    fast, slow, other = (summarize(hand_run(), target_accuracy=0.75) for _ in range(3))
    fast["wall_seconds"], slow["wall_seconds"], other["wall_seconds"] = 3.0, 5.0, 4.2
    slow["final_accuracy"] = 0.6
    other["time_to_target"] = None
    lines = repeats_table([[fast, slow, other]]).splitlines()
    assert lines[0].startswith("| algorithm | repeats | final accuracy | best accuracy | steps | wall time | time to 75.0 % |")
    assert lines[2].startswith(
        "| sgd | 3 | 70.0 % (60.0-70.0) | 80.0 % (80.0-80.0) | 30 (30-30) | 4.20 s (3.00-5.00) | 2.50 s (2.50-2.50) in 2 of 3 | "
    )
    assert lines[2].endswith("| 3.00 s (3.00-3.00), 43 % | 1.00 s (1.00-1.00), 14 % | 1.00 s (1.00-1.00), 14 % | 1.00 s (1.00-1.00), 14 % |")


# -- plots -------------------------------------------------------------------------------------
def test_running_mean_is_a_trailing_window_skipping_nan():
    np.testing.assert_allclose(running_mean([1.0, 2.0, 3.0, 4.0], 2), [1.0, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(running_mean([1.0, np.nan, 3.0, 5.0], 3), [1.0, 1.0, 2.0, 4.0])
    with pytest.raises(ValueError, match="window"):
        running_mean([1.0], 0)


def test_plot_runs_writes_two_nonblank_pngs(tmp_path):
    import matplotlib.image

    other = hand_run()
    other.header = {**HEADER, "algorithm": "topk"}
    other.steps = [step(n, loss=2.0 / n, bytes_sent=10) for n in range(1, 60)]
    paths = plot_runs([hand_run(), other, hand_run()], tmp_path / "plots", prefix="cmp-")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["cmp-accuracy.png", "cmp-loss.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 300
        assert pixels[..., :3].std() > 0.01, f"{path} is blank"
    with pytest.raises(ValueError, match="at least one"):
        plot_runs([], tmp_path)


def test_median_curves_by_hand_and_grouped_plots(tmp_path):
    from mpiopt.metrics.plots import _median_curves

    a, b, c = hand_run(), hand_run(), hand_run()
    curves = [
        ("sgd (1)", (np.array([1.0, 2.0]),) * 3, np.array([1.0, 4.0])),
        ("sgd (2)", (np.array([3.0, 4.0, 5.0]),) * 3, np.array([3.0, 2.0, 9.0])),
        ("sgd (3)", (np.array([2.0, 6.0]),) * 3, np.array([2.0, 3.0])),
    ]
    [(label, xs, y, low, high)] = _median_curves([a, b, c], curves)
    # cut to the shortest (2 points); medians of x (1, 3, 2) and (2, 4, 6), of y (1, 3, 2) and (4, 2, 3)
    assert label == "sgd (median of 3, range shaded)"
    assert xs[1].tolist() == [2.0, 4.0] and y.tolist() == [2.0, 3.0]
    assert low.tolist() == [1.0, 2.0] and high.tolist() == [3.0, 4.0]
    paths = plot_runs([a, b, c], tmp_path, group_repeats=True)
    assert all(matplotlib_pixels_vary(p) for p in paths)


def matplotlib_pixels_vary(path) -> bool:
    import matplotlib.image

    return matplotlib.image.imread(path)[..., :3].std() > 0.01


# -- span listener and tracer on one process ---------------------------------------------------
class FakeMPIRequest:
    """Stands for an mpi4py request: completes after ``delay`` seconds in Wait, or at once in Test."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def Wait(self) -> None:
        time.sleep(self.delay)

    def Test(self) -> bool:
        return True


def spans_of(ledger):
    spans = []
    ledger.listener = lambda op, start, end, kind: spans.append((op, start, end, kind))
    return spans


def test_listener_gets_inflight_and_wait_spans_of_a_request():
    ledger = Ledger()
    spans = spans_of(ledger)
    ledger.record("world.Iallreduce", 4, 4)
    posted = time.perf_counter()
    request = Request(ledger, "world.Iallreduce", FakeMPIRequest(0.01), [], posted, lambda: None)
    request.Wait()
    request.Wait()  # completed already: no more spans
    (op, start, end, kind), (wop, wstart, wend, wkind) = spans
    assert (op, kind, start) == ("world.Iallreduce", "inflight", posted)
    assert (wop, wkind, wend) == ("world.Iallreduce", "wait", end)
    assert posted <= wstart < wend
    assert end - posted == pytest.approx(ledger["world.Iallreduce"].seconds, abs=1e-12)
    assert wend - wstart == pytest.approx(ledger["world.Iallreduce"].wait_seconds, abs=1e-12)
    spans.clear()
    ledger.record("world.Isend", 4, 0)
    Request(ledger, "world.Isend", FakeMPIRequest(0.0), [], time.perf_counter(), lambda: None).Test()
    assert [(s[0], s[3]) for s in spans] == [("world.Isend", "inflight")]


def test_listener_gets_blocking_spans_and_is_not_part_of_the_totals():
    comm = Comm(MPI.COMM_SELF, name="self")
    spans = spans_of(comm.ledger)
    before = time.perf_counter()
    buf = np.arange(4, dtype=np.float32)
    comm.Allreduce(buf)
    comm.Barrier()
    assert [(s[0], s[3]) for s in spans] == [("self.Allreduce", "blocking"), ("self.Barrier", "blocking")]
    assert before <= spans[0][1] <= spans[0][2] <= spans[1][1] <= spans[1][2]
    assert spans[0][2] - spans[0][1] == pytest.approx(comm.ledger["self.Allreduce"].seconds, abs=1e-12)
    snapshot = comm.ledger.snapshot()
    assert snapshot.listener is None and snapshot == comm.ledger
    comm.ledger.listener = None
    comm.Allreduce(buf)  # no listener: nothing else happens
    np.testing.assert_array_equal(buf, np.arange(4, dtype=np.float32))
    comm.Free()


def test_tracer_lanes_and_close(tmp_path):
    comm = Comm(MPI.COMM_SELF, name="self")
    a, b = np.ones(3, np.float32), np.ones(5, np.float32)
    with Tracer(comm) as tracer:
        assert comm.ledger.listener is not None
        with pytest.raises(RuntimeError, match="already has a span listener"):
            Tracer(comm)
        first, second = comm.Iallreduce(a), comm.Iallreduce(b)  # in flight together: two lanes
        with tracer.phase("forward/backward"):
            time.sleep(0.002)
        first.Wait()
        second.Wait()
        comm.Allreduce(a)
        trace = tracer.write(tmp_path / "t.json")
        assert tracer.recording  # writing pauses, then resumes
    assert comm.ledger.listener is None and not tracer.recording
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = {(e["name"], e["cat"]): set() for e in spans}
    for e in spans:
        lanes[e["name"], e["cat"]].add(e["tid"])
    assert lanes[("self.Iallreduce", "inflight")] == {2, 3}
    assert lanes[("forward/backward", "phase")] == {0} and lanes[("self.Allreduce", "blocking")] == {1}
    assert overlap_fraction(trace["traceEvents"], 0) > 0
    assert trace["otherData"]["dropped_events"] == [0]
    comm.Allreduce(a)  # after close: not traced
    again = tracer.write(tmp_path / "t2.json")
    assert [e for e in again["traceEvents"] if e["ph"] == "X" and e["name"] == "self.Allreduce"] == [
        e for e in spans if e["name"] == "self.Allreduce"
    ]
    comm.Free()


def test_tracer_stops_at_max_events_and_counts_the_rest(tmp_path):
    comm = Comm(MPI.COMM_SELF, name="self")
    with Tracer(comm, max_events=2) as tracer:
        with pytest.warns(UserWarning, match="max_events") as caught:
            for _ in range(5):
                with tracer.phase("eval"):
                    pass
        assert len(caught) == 1
        trace = tracer.write(tmp_path / "t.json")
    assert tracer.dropped == 3 and trace["otherData"]["dropped_events"] == [3]
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["eval", "eval"]
    with pytest.raises(ValueError, match="max_events"):
        Tracer(comm, max_events=0)
    comm.Free()


def test_overlap_fraction_by_hand():
    def x(cat, name, ts, dur, pid=0):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": 0}

    events = [
        x("inflight", "world.Iallreduce", 0, 10), x("inflight", "world.Isend", 5, 10),  # union [0, 15]
        x("phase", "forward/backward", 2, 2), x("phase", "eval", 12, 8),  # covers 2 + 3 of it
        x("phase", "forward/backward", 0, 15, pid=1),  # another rank's
        x("blocking", "world.Allreduce", 0, 15),
    ]
    assert overlap_fraction(events, 0) == pytest.approx(5 / 15)
    assert overlap_fraction(events, 0, phases=["forward/backward"]) == pytest.approx(2 / 15)
    assert math.isnan(overlap_fraction(events, 1))


def test_the_legend_of_a_dozen_curves_sits_beside_the_panels_not_on_them():
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from mpiopt.metrics.plots import _draw

    x = np.arange(1.0, 11.0)
    curves = [(f"algorithm {i}", (x, x, x), 100 - 10 / x - i) for i in range(12)]
    fig = _draw(curves, "test accuracy (%)", "Test accuracy")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # the constrained layout places the legend
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"algorithm {i}" for i in range(12)]
    right_of_panels = max(ax.get_window_extent(renderer).x1 for ax in fig.axes)
    assert legend.get_window_extent(renderer).x0 >= right_of_panels


def test_lost_ranks_are_the_runs_own_record_and_give_its_world_size_over_time(tmp_path):
    """A "lost" record is neither a step nor an evaluation; the world's size over the run follows the losses (from
    the step redone, or the next where the step stood) and the resumes (from the step after the checkpoint's)."""
    from mpiopt.metrics.summary import world_over_time

    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(str(path)) as w:
        w.write({"kind": "run", "algorithm": "sgd", "task": "t", "config": {}, "world_size": 4, "versions": {}})
        w.write(evaluation(4, 1.0, 10, 0.5))
        w.write({"kind": "lost", "step": 7, "lost": [2], "world_size": 3, "wall_seconds": 2.0, "redone": True})
        w.write({"kind": "lost", "step": 9, "lost": [0, 3], "world_size": 1, "wall_seconds": 3.0, "redone": False})
        w.write({"kind": "run", "algorithm": "sgd", "task": "t", "config": {}, "world_size": 4, "versions": {},
                 "resumed_after_step": 11})
        w.write(evaluation(12, 4.0, 20, 0.6))
    run = read_metrics(str(path))
    assert [e["kind"] for e in run.evals] == ["eval", "eval"] and [r["step"] for r in run.lost] == [7, 9]
    assert world_over_time(run) == "4 ranks; 3 from step 7 (lost rank 2); 1 from step 10 (lost ranks 0, 3); 4 from step 12 (resumed)"
    run.lost = [{"kind": "lost", "step": 6, "lost": [0], "left": [1], "world_size": 2, "redone": True}]
    assert world_over_time(run) == "4 ranks; 2 from step 6 (lost rank 0; rank 1 left with its island); 4 from step 12 (resumed)"
    run.lost, run.resumes = [], []
    assert world_over_time(run) == ""
