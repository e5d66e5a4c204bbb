"""Prometheus metrics in the text exposition format, named like vLLM's.

A small self-contained implementation (counters, gauges, histograms) rather
than a dependency: the server builds one ``EngineMetrics`` per app, so several
apps in one process (tests, embedding) never fight over a global registry.
Names mirror vLLM's (``vllm:`` -> ``aiolm:``) so existing dashboards port by a
prefix rename. Gauges and engine-side counters are read from the engine at
scrape time; latency histograms are fed by the server as requests finish.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable, Sequence

Labels = tuple[tuple[str, str], ...]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> Labels:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.labelnames)}")
        return tuple((k, str(labels[k])) for k in self.labelnames)

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        raise NotImplementedError

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for suffix, labels, value in self.samples():
            lines.append(f"{self.name}{suffix}{_labels(labels)} {_fmt(value)}")
        return "\n".join(lines)


class Counter(Metric):
    """Only goes up; ``name`` should end in ``_total`` (the text format's convention)."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        with self._lock:
            return [("", k, v) for k, v in self._values.items()]


class Gauge(Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[Labels, float] = {}

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        with self._lock:
            return [("", k, v) for k, v in self._values.items()]


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._data: dict[Labels, tuple[list[float], list[float]]] = {}  # counts per bucket, [sum]

    def observe(self, value: float, count: int = 1, **labels: str) -> None:
        """``count`` > 1 records the same value several times (e.g. a mean over n gaps)."""
        if count <= 0 or not math.isfinite(value):
            return
        key = self._key(labels)
        with self._lock:
            counts, total = self._data.setdefault(key, ([0.0] * len(self.buckets), [0.0]))
            for i, b in enumerate(self.buckets):
                if value <= b:
                    counts[i] += count
                    break
            total[0] += value * count

    def count(self, **labels: str) -> float:
        entry = self._data.get(self._key(labels))
        return sum(entry[0]) if entry else 0.0

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        out = []
        with self._lock:
            for key, (counts, total) in self._data.items():
                cum = 0.0
                for b, c in zip(self.buckets, counts):
                    cum += c
                    out.append(("_bucket", key + (("le", _fmt(b)),), cum))
                out.append(("_sum", key, total[0]))
                out.append(("_count", key, cum))
        return out


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Metric] = []
        self.collectors: list[Callable[[], None]] = []

    def add(self, metric: Metric) -> Any:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        for collect in self.collectors:
            collect()
        return "\n".join(m.render() for m in self.metrics) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    """The metrics of one served engine; ``render()`` refreshes the engine-side values."""

    def __init__(self, engine: Any, model_name: str | None = None) -> None:
        self.engine = engine
        self._model = model_name
        r = self.registry = Registry()
        m = ("model_name",)
        self.running = r.add(Gauge("aiolm:num_requests_running", "Requests in the running batch.", m))
        self.waiting = r.add(Gauge("aiolm:num_requests_waiting", "Requests waiting to be scheduled.", m))
        self.kv_usage = r.add(Gauge("aiolm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", m))
        self.healthy = r.add(Gauge("aiolm:engine_healthy", "1 while the engine serves, 0 once it is dead.", m))
        self.prefix_queries = r.add(Counter("aiolm:prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache.", m))
        self.prefix_hits = r.add(Counter("aiolm:prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache.", m))
        self.prefix_hit_rate = r.add(Gauge("aiolm:prefix_cache_hit_rate",
                                           "Prefix cache hits / queries since start (tokens).", m))
        self.prompt_tokens = r.add(Counter("aiolm:prompt_tokens_total", "Prompt tokens admitted.", m))
        self.generation_tokens = r.add(Counter("aiolm:generation_tokens_total", "Tokens generated.", m))
        self.success = r.add(Counter("aiolm:request_success_total", "Finished requests by finish reason.",
                                     ("model_name", "finished_reason")))
        self.ttft = r.add(Histogram("aiolm:time_to_first_token_seconds", "Time to first token.",
                                    TTFT_BUCKETS, m))
        self.itl = r.add(Histogram("aiolm:inter_token_latency_seconds",
                                   "Time between output tokens (per-request mean, weighted by tokens).",
                                   ITL_BUCKETS, m))
        self.tpot = r.add(Histogram("aiolm:time_per_output_token_seconds",
                                    "Mean time per output token after the first, one sample per request.",
                                    ITL_BUCKETS, m))
        self.e2e = r.add(Histogram("aiolm:e2e_request_latency_seconds", "End-to-end request latency.",
                                   E2E_BUCKETS, m))
        self.req_prompt = r.add(Histogram("aiolm:request_prompt_tokens", "Prompt tokens per request.",
                                          TOKEN_BUCKETS, m))
        self.req_gen = r.add(Histogram("aiolm:request_generation_tokens", "Generated tokens per request.",
                                       TOKEN_BUCKETS, m))
        r.collectors.append(self._collect)
        self._last_engine: dict[str, float] = {}

    @property
    def model(self) -> str:
        return self._model or getattr(self.engine, "model_name", None) or "unknown"

    def _bump(self, counter: Counter, key: str, value: float) -> None:
        """Mirror an engine-side running total into a counter (never decreasing)."""
        prev = self._last_engine.get(key, 0.0)
        if value > prev:
            counter.inc(value - prev, model_name=self.model)
            self._last_engine[key] = value

    def _collect(self) -> None:
        e, m = self.engine, self.model
        running, waiting = e.num_requests()
        self.running.set(running, model_name=m)
        self.waiting.set(waiting, model_name=m)
        self.kv_usage.set(e.kv_cache_usage(), model_name=m)
        self.healthy.set(1.0 if e.is_healthy() else 0.0, model_name=m)
        stats = getattr(e, "stats", {}) or {}
        self._bump(self.prompt_tokens, "prompt", float(stats.get("prompt_tokens", 0)))
        self._bump(self.generation_tokens, "generation", float(stats.get("generation_tokens", 0)))
        sched = getattr(e, "scheduler", None)
        pcs = getattr(sched, "prefix_cache_stats", None) if sched is not None else None
        if pcs is not None:
            self._bump(self.prefix_queries, "pc_queries", float(pcs.queries))
            self._bump(self.prefix_hits, "pc_hits", float(pcs.hits))
            self.prefix_hit_rate.set(pcs.hit_rate, model_name=m)
        else:
            self.prefix_hit_rate.set(0.0, model_name=m)

    def observe_finished(self, metrics: dict[str, float], prompt_tokens: int,
                         seqs: list[tuple[int, str | None]]) -> None:
        """Record one finished request: ``metrics`` as in RequestOutput.metrics,
        ``seqs`` = (tokens generated, finish reason) per sequence."""
        m = self.model
        for _, reason in seqs:
            self.success.inc(finished_reason=reason or "unknown", model_name=m)
        self.req_prompt.observe(prompt_tokens, model_name=m)
        output_tokens = max((n for n, _ in seqs), default=0)
        for n, _ in seqs:
            self.req_gen.observe(n, model_name=m)
        ttft, e2e = metrics.get("ttft"), metrics.get("e2e")
        if ttft is not None:
            self.ttft.observe(ttft, model_name=m)
        if e2e is not None:
            self.e2e.observe(e2e, model_name=m)
        if ttft is not None and e2e is not None and output_tokens > 1:
            mean = max(e2e - ttft, 0.0) / (output_tokens - 1)
            self.tpot.observe(mean, model_name=m)
            self.itl.observe(mean, count=output_tokens - 1, model_name=m)

    def observe_aborted(self, num_seqs: int) -> None:
        self.success.inc(num_seqs, finished_reason="abort", model_name=self.model)

    def render(self) -> str:
        return self.registry.render()
