"""``GET /metrics``: the server's counters in Prometheus' text format
(prometheus-client, one registry per server).

Requests by endpoint and status; per generation: prompt, cached-prefix and
generated tokens, decode time (rate(tokens) / rate(seconds) is tokens/s over
any window), drafted and accepted draft tokens (acceptance), prefix-cache
hits; the generations running now, and the last generation's tokens/s,
acceptance and estimated speedup over plain decoding as gauges."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

PREFIX = "edgespec"


class Metrics:
    def __init__(self, model: str):
        self.registry = r = CollectorRegistry(auto_describe=True)

        def counter(name, doc, labels=("model",)):
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        def gauge(name, doc):
            return Gauge(f"{PREFIX}_{name}", doc, ("model",), registry=r)

        self.model = model
        self.requests = counter("requests", "HTTP requests answered, by endpoint and status.",
                                ("endpoint", "status"))
        self.generations = counter("generations", "Generations run.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the generations.")
        self.cached_tokens = counter("prefix_cache_tokens", "Prompt tokens whose K/V came from the "
                                     "prefix cache (not evaluated again).")
        self.cache_hits = counter("prefix_cache_hits", "Generations that reused a cached prefix.")
        self.tokens = counter("generated_tokens", "Tokens generated.")
        self.decode_seconds = counter("decode_seconds", "Time spent generating (prefill excluded); "
                                      "generated_tokens / decode_seconds is tokens/s.")
        self.drafted = counter("draft_tokens", "Draft tokens verified by the target.")
        self.accepted = counter("accepted_tokens", "Draft tokens accepted.")
        self.tokens_per_s = gauge("last_tokens_per_second", "Tokens/s of the last generation.")
        self.acceptance = gauge("last_acceptance_rate", "Accepted / drafted tokens of the last generation.")
        self.running = gauge("generations_running", "Generations running now, each in a KV-cache slot of its "
                             "own (at most the model's --parallel; the others wait).")
        self.estimated_speedup = gauge("last_estimated_speedup", "Estimated speed of the last generation over "
                                       "plain decoding on this machine (from its measured batch-cost curve).")

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def generation(self, stats, estimated_speedup: float, model: str | None = None) -> None:
        m = model or self.model
        self.generations.labels(m).inc()
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens)
        self.cached_tokens.labels(m).inc(stats.cached_tokens)
        if stats.cached_tokens:
            self.cache_hits.labels(m).inc()
        self.tokens.labels(m).inc(stats.n_tokens)
        self.decode_seconds.labels(m).inc(stats.decode_s)
        self.tokens_per_s.labels(m).set(stats.tokens_per_s)
        self.estimated_speedup.labels(m).set(estimated_speedup)
        if stats.spec is not None:
            self.drafted.labels(m).inc(stats.spec.drafted)
            self.accepted.labels(m).inc(stats.spec.accepted)
            self.acceptance.labels(m).set(stats.spec.acceptance_rate)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
