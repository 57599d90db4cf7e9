"""Pure parts of the client and the benchmark harness: no server, no model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from client import RequestOutput, SamplingParams, StreamDelta
from client.bench.metrics import (
    RequestRecord,
    arrival_offsets,
    compute_metrics,
    meets_slo,
    parse_slo,
)
from client.bench.report import build_report, to_markdown, write_report
from client.bench.workloads import (
    SHAREGPT_INPUT_MEAN,
    SHAREGPT_OUTPUT_MEAN,
    make_workload,
    random_workload,
    shared_prefix_workload,
    sharegpt_like_lengths,
    sharegpt_like_workload,
)
from client.cli import build_parser
from client.prompts import ChatPrompt, broadcast_params, build_request, normalize_prompts
from protos import scheduler_pb2 as pb

# ---- workloads -------------------------------------------------------------------------------


def test_random_workload_exact_lengths_and_vocab() -> None:
    reqs = random_workload(20, input_len=32, output_len=7, vocab_size=100, max_model_len=64)
    assert [r.prompt_len for r in reqs] == [32] * 20
    assert [r.output_len for r in reqs] == [7] * 20
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 20


def test_random_workload_range_ratio_bounds() -> None:
    reqs = random_workload(
        200, input_len=100, output_len=50, range_ratio=0.5, vocab_size=50, max_model_len=300
    )
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150
    assert min(out_lens) >= 25 and max(out_lens) <= 75
    assert len(set(in_lens)) > 20  # actually spread, not fixed


def test_random_workload_rejects_lengths_over_model() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        random_workload(1, input_len=60, output_len=10, vocab_size=10, max_model_len=64)


@pytest.mark.parametrize("name", ["random", "sharegpt-like", "shared-prefix"])
def test_workloads_are_reproducible_by_seed(name: str) -> None:
    kwargs = dict(vocab_size=1000, max_model_len=2048, input_len=16, output_len=8)
    a = make_workload(name, 10, seed=3, **kwargs)
    b = make_workload(name, 10, seed=3, **kwargs)
    c = make_workload(name, 10, seed=4, **kwargs)
    assert a == b
    assert a != c


def test_sharegpt_like_mean_and_heavy_tail() -> None:
    in_lens, out_lens = sharegpt_like_lengths(20000, max_model_len=1 << 16, seed=0)
    assert in_lens.mean() == pytest.approx(SHAREGPT_INPUT_MEAN, rel=0.1)
    assert out_lens.mean() == pytest.approx(SHAREGPT_OUTPUT_MEAN, rel=0.1)
    # Heavy right tail: mean well above the median, p99 many times the median.
    assert np.median(in_lens) < 0.75 * in_lens.mean()
    assert np.percentile(in_lens, 99) > 5 * np.median(in_lens)
    assert np.percentile(out_lens, 99) > 4 * np.median(out_lens)
    assert in_lens.min() >= 4 and out_lens.min() >= 4


def test_sharegpt_like_capped_at_model_length() -> None:
    reqs = sharegpt_like_workload(500, vocab_size=300, max_model_len=256, seed=1)
    assert all(r.prompt_len + r.output_len <= 256 for r in reqs)
    assert all(r.prompt_len >= 4 and r.output_len >= 4 for r in reqs)
    assert all(0 <= t < 300 for r in reqs for t in r.prompt_token_ids)


def test_shared_prefix_structure() -> None:
    reqs = shared_prefix_workload(
        6, prefix_len=40, question_len=5, output_len=3, vocab_size=5000, max_model_len=64
    )
    prefix = reqs[0].prompt_token_ids[:40]
    assert all(r.prompt_token_ids[:40] == prefix for r in reqs)
    assert all(r.prompt_len == 45 and r.output_len == 3 for r in reqs)
    assert len({tuple(r.prompt_token_ids[40:]) for r in reqs}) == 6


# ---- metrics ---------------------------------------------------------------------------------


def _rec(start: float, times: list[float], *, success: bool = True, prompt_len: int = 10):
    return RequestRecord(
        prompt_len=prompt_len,
        expected_output_len=len(times),
        start_time=start,
        token_times=times,
        end_time=times[-1] if times else start,
        success=success,
    )


def test_metrics_on_hand_made_timestamps() -> None:
    a = _rec(0.0, [0.1, 0.2, 0.4])  # ttft 100, tpot 150, itls 100 200, e2el 400
    b = _rec(1.0, [1.3, 1.4])  # ttft 300, tpot 100, itl 100, e2el 400
    c = _rec(2.0, [2.05])  # ttft 50, no tpot, e2el 50
    failed = _rec(0.0, [], success=False)
    m = compute_metrics([a, b, c, failed], duration_s=4.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(1.5)
    assert m["total_token_throughput"] == pytest.approx(9.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300, 50], 99))
    assert m["mean_tpot_ms"] == pytest.approx(125.0)
    assert m["mean_itl_ms"] == pytest.approx((100 + 200 + 100) / 3)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx((400 + 400 + 50) / 3)
    assert "goodput" not in m


def test_goodput_counts_requests_within_all_slos() -> None:
    a = _rec(0.0, [0.1, 0.2, 0.4])  # ttft 100, tpot 150
    b = _rec(1.0, [1.3, 1.4])  # ttft 300, tpot 100
    c = _rec(2.0, [2.05])  # ttft 50, no tpot
    slo = parse_slo(["ttft=200", "tpot_ms=120"])
    assert slo == {"ttft": 200.0, "tpot": 120.0}
    assert [meets_slo(r, slo) for r in (a, b, c)] == [False, False, True]
    m = compute_metrics([a, b, c], duration_s=2.0, slo=slo)
    assert m["goodput"] == pytest.approx(0.5)
    assert compute_metrics([a, b, c], 2.0, slo={"ttft": 1000})["goodput"] == pytest.approx(1.5)


def test_parse_slo_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slo(["latency=5"])


def test_metrics_without_successes_are_nan_not_zero() -> None:
    m = compute_metrics([_rec(0.0, [], success=False)], 1.0)
    assert m["completed"] == 0 and math.isnan(m["mean_ttft_ms"])


def test_poisson_arrivals_mean_rate() -> None:
    offsets = arrival_offsets(4001, 8.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    # Exponential gaps: standard deviation equals the mean.
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.1)
    assert arrival_offsets(5, 8.0, seed=0) == arrival_offsets(5, 8.0, seed=0)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    bursty = np.diff(arrival_offsets(4001, 8.0, seed=0, burstiness=0.25))
    assert bursty.mean() == pytest.approx(1 / 8.0, rel=0.1)
    assert bursty.std() > 1.5 * bursty.mean()


# ---- client conversions ----------------------------------------------------------------------


def test_sampling_params_to_proto_sets_every_optional() -> None:
    p = SamplingParams(
        n=2, max_tokens=7, temperature=0.0, top_k=5, seed=11, stop="END", logprobs=3,
        logit_bias={4: -1.5},
    )  # fmt: skip
    msg = p.to_proto()
    assert dict(msg.logit_bias) == {4: -1.5}
    assert msg.n == 2 and msg.max_tokens == 7 and msg.top_k == 5 and msg.seed == 11
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert msg.HasField("top_p") and msg.HasField("repetition_penalty")
    assert msg.HasField("skip_special_tokens") and msg.skip_special_tokens
    assert list(msg.stop) == ["END"] and msg.logprobs == 3
    assert SamplingParams.from_proto(msg) == p


def test_sampling_params_unset_optionals_stay_unset() -> None:
    msg = SamplingParams(max_tokens=None).to_proto()
    assert not msg.HasField("max_tokens")
    assert not msg.HasField("seed") and not msg.HasField("logprobs")
    assert SamplingParams.from_proto(pb.SamplingParams()) == SamplingParams()


def test_prompt_forms() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert normalize_prompts("a") == ["a"]
    assert normalize_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert normalize_prompts([[1, 2], [3]]) == [[1, 2], [3]]
    assert normalize_prompts(chat) == [ChatPrompt(chat)]
    assert normalize_prompts([chat, "b", {"prompt_token_ids": [4]}]) == [ChatPrompt(chat), "b", [4]]
    with pytest.raises(TypeError):
        normalize_prompts([1.5])
    req = build_request([5, 6], SamplingParams(), request_id="r1", priority=2, detached=True)
    assert req.WhichOneof("prompt") == "token_ids" and list(req.token_ids.ids) == [5, 6]
    assert (req.request_id, req.priority, req.detached) == ("r1", 2, True)
    req = build_request(ChatPrompt(chat, add_generation_prompt=False), SamplingParams())
    assert req.chat.messages[0].content == "hi" and not req.chat.add_generation_prompt
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        broadcast_params([SamplingParams()] * 2, 3)


def test_request_output_folds_deltas() -> None:
    out = RequestOutput.start("", [1, 2], n=2)
    msgs = [
        pb.GenerateResponse(request_id="x", index=0, text="He", token_ids=[7], num_prompt_tokens=2),
        pb.GenerateResponse(
            request_id="x",
            index=1,
            text="Yo",
            token_ids=[9],
            finish_reason=pb.FINISH_REASON_STOP,
            stop_reason="\n",
            logprobs=[
                pb.TokenLogprobs(
                    token_id=9, logprob=-0.5, top=[pb.TokenAlternative(token_id=9, logprob=-0.5)]
                )
            ],
        ),
        pb.GenerateResponse(
            request_id="x",
            index=0,
            text="llo",
            token_ids=[8],
            token_offset=1,
            finish_reason=pb.FINISH_REASON_LENGTH,
        ),
    ]
    for i, msg in enumerate(msgs):
        out.add(StreamDelta.from_proto(msg))
        assert out.finished == (i == 2)
    assert out.request_id == "x" and out.prompt_token_ids == [1, 2] and out.num_prompt_tokens == 2
    assert out.outputs[0].text == "Hello" and out.outputs[0].token_ids == [7, 8]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[1].stop_reason == "\n" and out.outputs[1].cumulative_logprob == -0.5
    assert out.outputs[1].logprobs[0][9].rank == 1
    assert out.metrics.first_token_time is not None and out.metrics.finished_time is not None


# ---- report and CLI parsing ------------------------------------------------------------------


def _result(backend: str, mode: str, out_tps: float, **extra: float) -> dict:
    return {"backend": backend, "mode": mode, "completed": 4, "failed": 0,
            "output_throughput": out_tps, "request_throughput": out_tps / 10, **extra}  # fmt: skip


def test_report_ratios_and_markdown(tmp_path) -> None:
    results = [
        _result("llmserve", "throughput", 300.0),
        _result("hf", "throughput", 100.0),
        _result("llmserve", "serve", 50.0, request_rate=2.0, mean_ttft_ms=10.0),
        _result("hf", "serve", 25.0, request_rate=2.0, mean_ttft_ms=40.0),
        _result("llmserve", "serve", 60.0, request_rate="inf", mean_ttft_ms=float("nan")),
    ]
    report = build_report({"workload": "random"}, results)
    by_mode = {(r["mode"], r.get("request_rate")): r for r in report["ratios"]}
    assert len(by_mode) == 2  # the inf run has no hf partner
    assert by_mode[("throughput", None)]["output_throughput"] == pytest.approx(3.0)
    assert by_mode[("serve", 2.0)]["mean_ttft_ms"] == pytest.approx(0.25)
    md = to_markdown(report)
    assert "| backend | ok | failed | req/s | output tok/s |" in md
    assert "| llmserve | 4 | 0 | 30 | 300 |" in md
    assert "### llmserve ÷ hf" in md and "| throughput | – | 3 | 3 |" in md
    json_path, md_path = write_report(report, tmp_path / "r.json")
    loaded = json.loads(json_path.read_text())  # strict JSON: NaN became null
    assert loaded["results"][4]["mean_ttft_ms"] is None
    assert md_path.read_text().startswith("Config: workload=random")


def test_cli_parses_generate_and_bench() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["generate", "hi", "--max-tokens", "5", "--stop", "a", "--stop", "b", "--stream"]
    )
    assert args.prompt == ["hi"] and args.max_tokens == 5 and args.stop == ["a", "b"]
    args = parser.parse_args(
        ["bench", "serve", "--backend", "llmserve,hf", "--sweep", "1,2,inf", "--slo", "ttft=5"]
    )
    assert args.backend == ["llmserve", "hf"] and args.sweep == [1.0, 2.0, math.inf]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "throughput", "--backend", "tgi"])


def test_structured_output_round_trips_and_cli_builds_it(tmp_path) -> None:
    from client import structured
    from client.cli import _params

    for so in (
        structured.json_schema({"type": "object"}),
        structured.json_object(),
        structured.regex("[0-9]+"),
        structured.choice(["a", "b"]),
        structured.grammar('start: "x"'),
    ):
        msg = SamplingParams(structured_output=so).to_proto()
        assert msg.structured_output.WhichOneof("kind") == so.kind
        assert SamplingParams.from_proto(msg).structured_output == so
    assert not SamplingParams().to_proto().HasField("structured_output")
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer"}')
    args = build_parser().parse_args(["generate", "hi", "--json-schema", str(schema)])
    assert _params(args).structured_output == structured.json_schema('{"type": "integer"}')
    args = build_parser().parse_args(["generate", "hi", "--choice", "yes", "--choice", "no"])
    assert _params(args).structured_output == structured.choice(["yes", "no"])
    args = build_parser().parse_args(["generate", "hi", "--regex", "a", "--json-object"])
    with pytest.raises(ValueError, match="at most one"):
        _params(args)
