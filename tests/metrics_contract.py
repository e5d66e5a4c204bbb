"""The Prometheus series vLLM's v1 dashboards read: names (after the prefix), types, buckets.

Shared by the server and embedded-engine metrics tests, so both check one contract.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# name after "<prefix>:" -> type, as text_string_to_metric_families reports it
# (a counter's family name drops the "_total" its sample carries).
SERIES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "gpu_cache_usage_perc": "gauge",
    "cache_config_info": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "request_params_n": "histogram",
    "request_params_max_tokens": "histogram",
    "iteration_tokens_total": "histogram",
    "request_max_num_generation_tokens": "histogram",
    "request_time_per_output_token_seconds": "histogram",
}

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), written out here rather than imported
# from aiolm so the test fails if ours drift.
VLLM_BUCKETS = {
    "inter_token_latency_seconds": [
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
    ],
    "e2e_request_latency_seconds": [
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
    ],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_params_n": [1, 2, 5, 10, 20],
}


class Scrape:
    """One parsed exposition: values by series name (without the prefix) and labels."""

    def __init__(self, text: str, prefix: str) -> None:
        self.prefix = prefix + ":"
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def family(self, name: str) -> Any:
        return self.families[self.prefix + name]

    def value(self, sample: str, **labels: str) -> float:
        """The one sample named ``<prefix>:<sample>`` whose labels include ``labels``."""
        name = self.prefix + sample
        hits = [
            s.value
            for f in self.families.values()
            for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]
        assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
        return hits[0]

    def hist(self, name: str) -> tuple[float, float]:
        """(count, sum) of a histogram."""
        return self.value(name + "_count"), self.value(name + "_sum")

    def bounds(self, name: str) -> list[float]:
        return [
            float(s.labels["le"])
            for s in self.family(name).samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
        ]


def check_contract(scrape: Scrape, model_name: str) -> None:
    """Every series exists with its type and the labels model_name and engine; vLLM's buckets."""
    for name, kind in SERIES.items():
        fam = scrape.family(name)
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        for s in fam.samples:
            if name == "cache_config_info":
                assert s.labels["engine"] == "0" and int(s.labels["num_gpu_blocks"]) > 0 and s.value == 1
            else:
                assert s.labels["model_name"] == model_name and s.labels["engine"] == "0", (name, s)
    for name, bounds in VLLM_BUCKETS.items():
        assert scrape.bounds(name) == bounds, name
