"""`aiolm bench`: throughput, latency and serving benchmarks (see docs/benchmarks.md)."""
