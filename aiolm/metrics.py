"""Prometheus metrics of one engine, named, typed and bucketed like vLLM's v1 metrics.

Each engine owns an ``EngineMetrics`` with its own ``CollectorRegistry`` (never
prometheus_client's process-wide default), so several engines in one process (tests, an
app embedding two models) never collide. The server serves it at ``/metrics``; an app
embedding ``AsyncEngine`` exposes ``engine.metrics_registry`` with prometheus_client
(``start_http_server(port, registry=engine.metrics_registry)``) or renders
``engine.metrics.render()`` itself.

Names are ``<prefix>:<vLLM's name>`` with vLLM's labels (``model_name``, ``engine``) and
bucket layouts; the prefix is ``--metrics-prefix`` (``aiolm`` by default), and ``vllm``
makes them vLLM's own so its Grafana dashboards read them unchanged.

Where the numbers come from:

- gauges and the engine-wide counters (running, waiting, KV usage, prefix cache queries
  and hits, preemptions) are read from the scheduler when scraped: nothing per step;
- token counters and inter-token latencies are fed by the output processor in one call
  per step's outputs, with one latency per generated token gap; the tokens of each
  engine step by the engine core;
- the per-request histograms when a request finishes, from engine-side timestamps:
  arrival, first scheduled (``Request.scheduled_time``), first token, finish.

Observations go into plain accumulators (``Histogram`` below: one bisect and two adds)
that one collector turns into prometheus_client metric families at scrape time.
prometheus_client's own Histogram takes locks and walks its buckets on every observe,
several times the cost, and inter-token latencies are observed for every generated
token on the event loop. Reads at scrape time copy lists of ints, so a scrape from
another thread (``start_http_server``) sees a consistent histogram.
"""

from __future__ import annotations

import copy
import math
import re
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
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
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
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
)
REQUEST_LATENCY_BUCKETS = (
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
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")  # every series exists from the start, at 0
LABELS = ("model_name", "engine")

_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def check_prefix(prefix: str) -> str:
    """A metric name prefix Prometheus accepts (the ``:`` is added after it), else ValueError."""
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"metrics_prefix: {prefix!r} is not a Prometheus name prefix "
            f"(letters, digits and '_', not starting with a digit)"
        )
    return prefix


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count layout)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out) or (1,)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """Bucket counts and a sum; ``observe`` is what hot paths call."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are "<= bound": bisect_left finds the first bound >= value.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: list[float]) -> None:
        """``observe`` each value; one call per step for the per-token latencies."""
        counts, bounds = self.counts, self.bounds
        for v in values:
            counts[bisect_left(bounds, v)] += 1
        self.sum += sum(values)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, c in zip((*self.bounds, math.inf), counts):
            cumulative += c
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(labels, buckets, sum_value=total)


@dataclass
class FinishedRequest:
    """What the output processor knows about a request when it ends (monotonic seconds)."""

    reasons: list[str]  # one per sequence
    prompt_tokens: int
    output_tokens: list[int]  # one per sequence
    n: int
    max_tokens: int | None
    arrival: float
    scheduled: float | None  # first scheduled (its first sequence); None if it never ran
    first_token: float | None
    finish: float


# name, help, buckets (None: 1-2-5 up to max_model_len)
_REQUEST_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
    (
        "request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    ("request_prompt_tokens", "Number of prefill tokens processed.", None),
    ("request_generation_tokens", "Number of generation tokens processed.", None),
    ("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", None),
    ("request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
    ("request_params_max_tokens", "Histogram of the max_tokens request parameter.", None),
)


class EngineMetrics:
    """The metrics of one engine and the registry that exposes them.

    ``source`` is read at scrape time: ``num_requests()``, ``kv_cache_usage()``,
    ``is_healthy()`` and, once started, ``scheduler`` (preemptions, prefix cache, cache
    config). Nothing is exposed before ``configure`` (the model name is not known yet).
    """

    def __init__(self, source: Any, prefix: str = "aiolm", engine_index: int = 0) -> None:
        self.source = source
        self.prefix = check_prefix(prefix)
        self.engine_index = engine_index
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name: str | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.itl = Histogram(ITL_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.requests: dict[str, Histogram] = {}
        self.registry.register(_Collector(self))

    def configure(self, model_name: str, max_model_len: int) -> None:
        """Name the model and size the token-count buckets (on engine start)."""
        tokens = buckets_1_2_5(max_model_len)
        self.requests = {
            name: self.requests.get(name) or Histogram(tokens if b is None else b) for name, _, b in _REQUEST_HISTOGRAMS
        }
        self.model_name = model_name

    # -- fed by the engine ---------------------------------------------------------

    def step_outputs(self, prompt: int, generation: int, gaps: list[float]) -> None:
        """One step's outputs: prompt tokens of sequences that got their first token,
        tokens generated, and the inter-token latencies (one per token after a first)."""
        self.prompt_tokens += prompt
        self.generation_tokens += generation
        if gaps:
            self.itl.observe_many(gaps)

    def request_finished(self, r: FinishedRequest) -> None:
        if not self.requests:
            return
        h = self.requests
        for reason in r.reasons:
            self.success[reason] = self.success.get(reason, 0) + 1
        h["e2e_request_latency_seconds"].observe(r.finish - r.arrival)
        h["request_prompt_tokens"].observe(r.prompt_tokens)
        for n in r.output_tokens:
            h["request_generation_tokens"].observe(n)
        most = max(r.output_tokens, default=0)
        h["request_max_num_generation_tokens"].observe(most)
        h["request_params_n"].observe(r.n)
        if r.max_tokens is not None:
            h["request_params_max_tokens"].observe(r.max_tokens)
        if r.scheduled is not None:
            h["request_queue_time_seconds"].observe(r.scheduled - r.arrival)
            h["request_inference_time_seconds"].observe(r.finish - r.scheduled)
        if r.first_token is not None:
            h["time_to_first_token_seconds"].observe(r.first_token - r.arrival)
            decode = r.finish - r.first_token
            h["request_decode_time_seconds"].observe(decode)
            if r.scheduled is not None:
                h["request_prefill_time_seconds"].observe(r.first_token - r.scheduled)
            if most > 1:
                h["request_time_per_output_token_seconds"].observe(decode / (most - 1))

    # -- exposition ----------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition of this engine's registry (what ``/metrics`` serves)."""
        return generate_latest(self.registry)


class CombinedMetrics:
    """Several engines' metric families in one exposition (data parallelism): each family
    once, holding every engine's samples, told apart by their ``engine`` label.
    ``snapshots`` gives each engine's families (a replica process's, as last fetched)."""

    def __init__(self, snapshots: Callable[[], Iterable[Iterable[Metric]]]) -> None:
        self.snapshots = snapshots
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for families in self.snapshots():
            for family in families:
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = copy.copy(family)
                    merged[family.name].samples = list(family.samples)
        yield from merged.values()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def as_dead(families: Iterable[Metric]) -> list[Metric]:
    """A dead replica's last families as its series should read from now on: its counters
    and histograms stay (a counter that vanished would read as a reset), every gauge is 0
    (``engine_healthy`` included: nothing runs, waits or is held there), and the info
    series, whose labels describe live state, are gone."""
    out: list[Metric] = []
    for family in families:
        if family.type == "gauge" and family.name.endswith("_info"):
            continue
        if family.type == "gauge":
            family = copy.copy(family)
            family.samples = [s._replace(value=0.0) for s in family.samples]
        out.append(family)
    return out


class _Collector:
    """Turns an EngineMetrics into metric families when the registry is scraped."""

    def __init__(self, m: EngineMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        if m.model_name is None:
            return
        p = m.prefix + ":"
        labels = [m.model_name, str(m.engine_index)]
        src = m.source
        sched = getattr(src, "scheduler", None) if src is not None else None

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(p + name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(p + name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        running, waiting = src.num_requests()
        usage = src.kv_cache_usage()
        yield gauge("num_requests_running", "Number of requests in model execution batches.", running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        # vLLM's older name, still read by its classic Grafana dashboard.
        yield gauge(
            "gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use kv_cache_usage_perc.",
            usage,
        )
        yield gauge("engine_healthy", "1 while the engine serves, 0 once it is dead.", 1.0 if src.is_healthy() else 0.0)
        pcs = getattr(sched, "prefix_cache_stats", None)
        yield counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            pcs.queries if pcs is not None else 0,
        )
        yield counter(
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            pcs.hits if pcs is not None else 0,
        )
        yield counter(
            "num_preemptions", "Cumulative number of preemption from the engine.", getattr(sched, "num_preemptions", 0)
        )
        connector = getattr(sched, "connector", None)
        if connector is not None:  # a KV connector (--kv-transfer-config), only when it is on
            st = connector.stats
            yield counter(
                "external_prefix_cache_queries",
                "Prompt tokens asked of the KV connector beyond the local prefix cache.",
                st.queried_tokens,
            )
            yield counter(
                "external_prefix_cache_hits", "Prompt tokens the KV connector brought back.", st.loaded_tokens
            )
            yield counter(
                "kv_connector_saved_blocks",
                "KV blocks kept past their request: in an offload tier, or for a decode instance to read.",
                st.saved_blocks,
            )
            yield counter(
                "kv_connector_dropped_blocks", "KV blocks pushed out of an offload tier by its cap.", st.dropped_blocks
            )
            yield counter(
                "kv_connector_failed_loads",
                "KV loads cut short (a block missing or corrupt, a transfer broken): recomputed.",
                st.failed_loads,
            )
        spec = getattr(sched, "spec_decode_stats", None)
        if spec is not None:  # vLLM's speculative decoding series, only when it is on
            yield counter("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)
            per_pos = CounterMetricFamily(
                p + "spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=(*LABELS, "position"),
            )
            for pos, count in enumerate(list(spec.accepted_per_position)):
                per_pos.add_metric([*labels, str(pos)], count)
            yield per_pos
        ledger = getattr(sched, "encoder_cache", None)
        if ledger is not None and ledger.encoded:  # a vision-language model that has seen images
            yield counter(
                "encoder_images", "Images run through the vision encoder (cache hits are not).", ledger.encoded
            )
        if sched is not None and sched.config.max_loras:  # --enable-lora
            running_names, waiting_names = sched.lora_adapters()
            info = {
                "max_lora": str(sched.config.max_loras),
                "waiting_lora_adapters": ",".join(waiting_names),
                "running_lora_adapters": ",".join(running_names),
            }
            # vLLM's series: the labels carry the state, the value is when it was read. The
            # engine label keeps data-parallel replicas' series apart (vLLM's has none).
            g = GaugeMetricFamily(p + "lora_requests_info", "Running stats on lora requests.", labels=(*LABELS, *info))
            g.add_metric([*labels, *info.values()], time.time())
            yield g
        experts = getattr(src, "expert_tokens", None)
        if experts:  # a mixture of experts: what expert placement is balanced by
            routed = CounterMetricFamily(
                p + "moe_expert_tokens",
                "Tokens routed to each expert of each layer of experts.",
                labels=(*LABELS, "layer", "expert"),
            )
            for layer, row in enumerate(experts):
                for expert, count in enumerate(row):
                    routed.add_metric([*labels, str(layer), str(expert)], count)
            yield routed
        yield counter("prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", m.generation_tokens)
        success = CounterMetricFamily(
            p + "request_success", "Count of successfully processed requests.", labels=(*LABELS, "finished_reason")
        )
        for reason, count in list(m.success.items()):
            success.add_metric([*labels, reason], count)
        yield success
        yield from self._histograms(p, labels)
        cfg = getattr(sched, "config", None)
        if cfg is not None:
            info = {
                "block_size": str(cfg.block_size),
                "num_gpu_blocks": str(cfg.num_blocks),
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "engine": str(m.engine_index),
            }
            g = GaugeMetricFamily(
                p + "cache_config_info", "Information of the LLMEngine CacheConfig", labels=tuple(info)
            )
            g.add_metric(list(info.values()), 1.0)
            yield g

    def _histograms(self, p: str, labels: list[str]) -> Iterable[Metric]:
        m = self.m

        def family(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            f = HistogramMetricFamily(p + name, doc, labels=LABELS)
            h.add_to(f, labels)
            return f

        yield family("iteration_tokens_total", "Histogram of number of tokens per engine_step.", m.iteration_tokens)
        yield family("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl)
        # vLLM's older name for the same per-token gaps, still read by its classic dashboard.
        yield family(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: use inter_token_latency_seconds.",
            m.itl,
        )
        for name, doc, _ in _REQUEST_HISTOGRAMS:
            yield family(name, doc, m.requests[name])
