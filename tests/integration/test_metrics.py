"""Prometheus metrics of a running stack, scraped over HTTP as Prometheus would, parsed with
prometheus_client's own exposition parser: vLLM V1's names under `llmserve:`, values that
agree with what the requests did."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from client import LLMClient, SamplingParams
from scheduler_svc.local.redis_server import RedisServer
from tests.support.prom import free_port, scrape, total
from tests.support.stack import make_stack

VLLM_NAMES = [
    "llmserve:num_requests_running",
    "llmserve:num_requests_waiting",
    "llmserve:num_requests_swapped",
    "llmserve:kv_cache_usage_perc",
    "llmserve:prefix_cache_queries",
    "llmserve:prefix_cache_hits",
    "llmserve:prompt_tokens",
    "llmserve:generation_tokens",
    "llmserve:request_success",
    "llmserve:num_preemptions",
    "llmserve:time_to_first_token_seconds",
    "llmserve:inter_token_latency_seconds",
    "llmserve:e2e_request_latency_seconds",
    "llmserve:request_queue_time_seconds",
    "llmserve:request_prompt_tokens",
    "llmserve:request_generation_tokens",
    "llmserve:iteration_tokens_total",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    port, executor_port = free_port(), free_port()
    s = make_stack(
        tmp,
        redis,
        scheduler_args=["--metrics-port", str(port)],
        executor_args=["--num-device-blocks", "512", "--swap-space", "0.05",
                       "--metrics-port", str(executor_port)],
    )  # fmt: skip
    s.metrics_port, s.executor_metrics_port = port, executor_port
    try:
        yield s
    finally:
        s.stop()
        redis.close()


def test_scheduler_metrics_have_vllm_names_and_true_values(stack) -> None:
    with LLMClient(stack.address, timeout=60) as client:
        client.wait_ready(60)
        before = scrape(stack.metrics_port)
        params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
        outs = client.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13]], params, use_tqdm=False)
        model = client.server_info().model
    after = scrape(stack.metrics_port)
    exported = {name.removesuffix("_total") for name in after} | set(after)
    for name in VLLM_NAMES:
        assert name in exported or f"{name}_bucket" in after, name
    # Every series carries the model name.
    for name, series in after.items():
        if name.startswith("llmserve:"):
            assert all(("model_name", model) in labels for labels in series), name

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == 21
    assert delta("llmserve:generation_tokens_total") == generated
    assert delta("llmserve:prompt_tokens_total") == 4 + 3 + 2
    assert delta("llmserve:request_success_total", finished_reason="length") == 3
    assert delta("llmserve:e2e_request_latency_seconds_count") == 3
    assert delta("llmserve:time_to_first_token_seconds_count") == 3
    assert delta("llmserve:request_generation_tokens_sum") == generated
    # Every token but each request's first came after another: 3 x 6 inter-token gaps.
    assert delta("llmserve:inter_token_latency_seconds_count") == 18
    assert delta("llmserve:iteration_tokens_total_sum") >= 9 + 18
    assert total(after, "llmserve:executor_steps_total") > 0
    assert 0 <= total(after, "llmserve:kv_cache_usage_perc") <= 1
    assert total(after, "llmserve:num_requests_running") == 0


def test_executor_metrics_count_steps_and_phases(stack) -> None:
    with LLMClient(stack.address, timeout=60) as client:
        client.wait_ready(60)
        before = scrape(stack.executor_metrics_port)
        client.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        model = client.server_info().model
    after = scrape(stack.executor_metrics_port)
    steps = total(after, "llmserve:executor_step_duration_seconds_count") - total(
        before, "llmserve:executor_step_duration_seconds_count"
    )
    assert steps >= 5  # one prefill and four decodes at least
    for phase in ("cache_ops", "forward", "sampling"):
        assert total(after, "llmserve:executor_phase_seconds_total", phase=phase) > 0
    assert total(after, "llmserve:executor_num_device_blocks", model_name=model) == 512
    for name, series in after.items():
        if name.startswith("llmserve:"):
            assert all(("model_name", model) in labels for labels in series), name


def test_every_dashboard_expression_names_an_exported_metric(stack) -> None:
    import re
    from pathlib import Path

    dashboard = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmserve.json"
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert len(exprs) >= 12
    with LLMClient(stack.address, timeout=60) as client:
        client.wait_ready(60)
        client.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    exported = set(scrape(stack.metrics_port)) | set(scrape(stack.executor_metrics_port))
    used = {name for e in exprs for name in re.findall(r"llmserve:[a-z0-9_]+", e)}
    assert used and used <= exported, sorted(used - exported)
    # Panels cover what an operator watches first.
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("throughput", "first token", "kv cache", "preemptions", "queue", "recover"):
        assert topic in titles, topic


@pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="needs Prometheus (Debian: apt-get install prometheus; make test installs it as root)",
)
def test_a_real_prometheus_scrapes_the_stack(stack, tmp_path) -> None:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: llmserve\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{stack.metrics_port}', "
        f"'127.0.0.1:{stack.executor_metrics_port}']\n"
    )
    check = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    web = free_port()
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 -- closed below
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with LLMClient(stack.address, timeout=60) as client:
            client.wait_ready(60)
            client.generate(
                [[5, 6, 7], [8, 9]],
                SamplingParams(max_tokens=6, ignore_eos=True),
                use_tqdm=False,
            )
        want = total(scrape(stack.metrics_port), "llmserve:generation_tokens_total")
        query = urllib.parse.urlencode({"query": "sum(llmserve:generation_tokens_total)"})
        got, up = None, None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{web}/api/v1/query?{query}", timeout=5
                ) as r:
                    result = json.load(r)["data"]["result"]
                got = float(result[0]["value"][1]) if result else None
                up_q = urllib.parse.urlencode({"query": "sum(up)"})
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{web}/api/v1/query?{up_q}", timeout=5
                ) as r:
                    up_result = json.load(r)["data"]["result"]
                up = float(up_result[0]["value"][1]) if up_result else None
            except OSError:
                pass
            if got == want and up == 2:
                break
            time.sleep(0.5)
        assert want >= 12 and got == want, (got, want)
        assert up == 2  # both targets (scheduler and executor) scraped successfully
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        log.close()
