"""The rollout's speculation figures per step (opd_patches/rollout/spec_metrics.py): vLLM's draft counters read
over HTTP from each server's /metrics, here from servers exposing counters through prometheus_client as vLLM's
do, and the engine made to log its statistics when a speculative_config is given."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import composed
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from opd_patches import main
from opd_patches.checks import speculation
from opd_patches.rollout import spec_metrics


class Server:
    """An HTTP server whose /metrics is a registry holding vLLM's three spec-decode counters, one label set per engine."""

    def __init__(self, engines=1):
        self.registry = CollectorRegistry()
        self.counters = {key: Counter(name, key, ["engine"], registry=self.registry)
                         for key, name in spec_metrics.COUNTERS.items()}
        for counter in self.counters.values():
            for engine in range(engines):
                counter.labels(engine=str(engine))  # exposed at 0 from the start, as vLLM's are
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = generate_latest(registry) if self.path == "/metrics" else b""
                self.send_response(200 if body else 404)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def add(self, engine=0, **counts):
        for key, n in counts.items():
            self.counters[key].labels(engine=str(engine)).inc(n)


@pytest.fixture
def servers():
    made = [Server(engines=2), Server()]
    yield made
    for s in made:
        s.http.shutdown()


def test_a_step_reads_the_counters_summed_over_servers_and_engines(servers):
    addresses = [s.address for s in servers]
    servers[0].add(drafts=3, drafted=12, accepted=5)  # before the step: not this step's
    before = spec_metrics.read(addresses)
    servers[0].add(engine=1, drafts=10, drafted=40, accepted=20)
    servers[1].add(drafts=30, drafted=120, accepted=10)
    after = spec_metrics.read(addresses)
    assert after == {"drafts": 43.0, "drafted": 172.0, "accepted": 35.0}
    m = spec_metrics.step_metrics(before, after)
    assert m == {"rollout/spec_drafted_tokens": 160.0, "rollout/spec_accepted_tokens": 30.0,
                 "rollout/spec_engine_accept_rate": pytest.approx(30 / 160),
                 "rollout/spec_engine_accept_length": pytest.approx(1 + 30 / 40)}


def test_a_step_without_drafts_logs_zero_totals_and_no_ratio(servers):
    before = spec_metrics.read([servers[1].address])
    assert spec_metrics.step_metrics(before, spec_metrics.read([servers[1].address])) == {
        "rollout/spec_drafted_tokens": 0.0, "rollout/spec_accepted_tokens": 0.0}


def test_an_unreachable_server_gives_no_figures(servers):
    gone = Server()
    gone.http.shutdown()
    gone.http.server_close()
    assert spec_metrics.read([servers[0].address, gone.address], timeout_s=2) is None
    assert spec_metrics.step_metrics(None, spec_metrics.read([servers[0].address])) == {}


def test_a_page_without_the_counters_gives_no_figures(servers):
    """A server whose engine does not speculate serves no spec-decode counters: no figures, not zero drafts."""
    plain = Server()
    plain.registry.unregister(plain.counters["drafted"])
    try:
        assert spec_metrics.read([servers[0].address]) is not None
        assert spec_metrics.read([servers[0].address, plain.address]) is None
    finally:
        plain.http.shutdown()


def test_a_speculative_config_makes_the_engine_log_its_statistics():
    plain = composed.compose_placeholder("topk")
    main.apply_speculation(plain)
    assert plain.actor_rollout_ref.rollout.disable_log_stats is True  # upstream's default, left alone
    spec = composed.compose_placeholder("topk", f"+{speculation.KEY}={{method: ngram, num_speculative_tokens: 4}}")
    main.apply_speculation(spec)
    assert spec.actor_rollout_ref.rollout.disable_log_stats is False


def test_an_offline_engines_metrics_give_the_same_totals():
    """vLLM's LLM.get_metrics() names counters without `_total`, one entry per engine; its per-position
    acceptance is a vector without a single value (tools/spec_exactness.py, tools/bench/spec_decode.py)."""
    pairs = [("vllm:spec_decode_num_drafts", 4), ("vllm:spec_decode_num_drafts", 6),
             ("vllm:spec_decode_num_draft_tokens", 40), ("vllm:spec_decode_num_accepted_tokens", 15),
             ("vllm:spec_decode_num_accepted_tokens_per_pos", None), ("vllm:num_requests_running", 3)]
    assert spec_metrics.totals(pairs) == {"drafts": 10.0, "drafted": 40.0, "accepted": 15.0}
