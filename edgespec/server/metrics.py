"""``GET /metrics``: the server's counters in Prometheus' text format
(prometheus-client, one registry per server).

Requests by endpoint and status; per generation: prompt, cached-prefix and
generated tokens, decode time (rate(tokens) / rate(seconds) is tokens/s over
any window), drafted and accepted draft tokens (acceptance), prefix-cache
hits; the generations running now, and the last generation's tokens/s,
acceptance and estimated speedup over plain decoding as gauges.

Beside them, llama-server's own names (``llamacpp:prompt_tokens_total``,
``llamacpp:tokens_predicted_total``, ``llamacpp:predicted_tokens_seconds``,
``llamacpp:requests_processing``, the ``spec_decode`` counters, ...) over all
the server's models, so that dashboards made for llama-server read it."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

PREFIX = "edgespec"
LLAMACPP = "llamacpp:"   # llama-server's prefix (its metrics carry no labels)


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

        self._llamacpp(r)

    def _llamacpp(self, r: CollectorRegistry) -> None:
        """llama-server's metrics (tools/server: server_task_result_metrics::to_metrics)."""
        def counter(name, doc):
            return Counter(f"{LLAMACPP}{name}", doc, registry=r)

        def gauge(name, doc, value):
            g = Gauge(f"{LLAMACPP}{name}", doc, registry=r)
            g.set_function(value)
            return g

        self.lc_prompt = counter("prompt_tokens", "Number of prompt tokens processed, excluding cached tokens")
        self.lc_cached = counter("prompt_tokens_cached", "Number of prompt tokens reused from the cache")
        self.lc_prompt_s = counter("prompt_seconds", "Total time spent processing prompts")
        self.lc_predicted = counter("tokens_predicted", "Number of generation tokens processed")
        self.lc_predicted_s = counter("tokens_predicted_seconds", "Total time spent generating tokens")
        self.lc_decodes = counter("n_decode", "Total number of target evaluations (prompts and steps)")
        self.lc_drafted = counter("spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated")
        self.lc_accepted = counter("spec_decode_num_accepted_tokens",
                                   "Speculative: Total draft tokens accepted by the target model")
        self.lc_drafts = counter("spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps")
        self._n_tokens_max = 0
        self._turns: dict[str, tuple[int, int]] = {}   # model -> (running, waiting)
        self._sums = {"prompt": 0.0, "prompt_s": 0.0, "predicted": 0.0, "predicted_s": 0.0}

        def per_second(what):
            return lambda: self._sums[what] / self._sums[f"{what}_s"] if self._sums[f"{what}_s"] > 0 else 0.0

        gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s", per_second("prompt"))
        gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s", per_second("predicted"))
        gauge("requests_processing", "Number of requests processing", lambda: sum(r for r, _ in self._turns.values()))
        gauge("requests_deferred", "Number of requests deferred", lambda: sum(w for _, w in self._turns.values()))
        gauge("n_tokens_max", "Largest observed sequence length (prompt + generation)", lambda: self._n_tokens_max)

    def turns(self, model: str, running: int, waiting: int) -> None:
        """A model's generations running now and those waiting for a turn."""
        self.running.labels(model).set(running)
        self._turns[model] = running, waiting

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
        added = {"prompt": stats.prompt_tokens - stats.cached_tokens, "prompt_s": stats.prefill_s,
                 "predicted": stats.n_tokens, "predicted_s": stats.decode_s}
        for key, counter in (("prompt", self.lc_prompt), ("prompt_s", self.lc_prompt_s),
                             ("predicted", self.lc_predicted), ("predicted_s", self.lc_predicted_s)):
            self._sums[key] += added[key]
            counter.inc(added[key])
        self.lc_cached.inc(stats.cached_tokens)
        steps = stats.spec.target_steps if stats.spec is not None else max(stats.n_tokens - 1, 0)
        self.lc_decodes.inc(1 + steps)
        if stats.spec is not None:
            self.lc_drafted.inc(stats.spec.drafted)
            self.lc_accepted.inc(stats.spec.accepted)
            self.lc_drafts.inc(stats.spec.spec_steps)
        self._n_tokens_max = max(self._n_tokens_max, stats.prompt_tokens + stats.n_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
