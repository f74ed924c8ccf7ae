"""Prometheus metrics: scraped over real HTTP from `serve`, parsed, checked against what we sent."""

from __future__ import annotations

import io
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from messages import (
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Message,
    Output,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler.cli.top import metrics_url, run_top
from scheduler.core.metrics import Histogram, reject_reason
from tests.scheduler.served import Served as ServedBase

CODEC: Codec[Message] = Codec(Message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Served(ServedBase):
    """``serve`` with a metrics port, one batch slot and a one-request queue."""

    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        super().__init__(tmp, "--metrics-port", str(self.port), "--max-batch", "1",
                         "--max-queued-requests", "1")
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def read_until_terminal(self, rids: set[str]) -> dict[str, str]:
        codec: Codec[Output] = Codec(Output)
        done: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while set(done) != rids:
            assert time.monotonic() < deadline, f"unanswered: {rids - set(done)}"
            if not self.out.poll(100):
                continue
            got = codec.decode_any(self.out.recv_multipart())  # one output, or a burst
            for msg in got if isinstance(got, list) else [got]:
                if isinstance(msg, ErrorOut):
                    done[msg.rid] = msg.code
                elif isinstance(msg, BatchTokenIDOut):
                    for rid, _, fin in msg.items():
                        if fin is not None:
                            done[rid] = fin
        return done


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_scrape_counts_what_was_sent(served: Served) -> None:
    s = served
    for _ in range(3):
        assert s.rpc.call("get_load", timeout=120).success
    assert s.rpc.call("token_digest", timeout=30).success
    n = 6
    rids = {f"r{i}" for i in range(n)}
    for rid in sorted(rids):
        s.work.send_multipart(CODEC.encode(TokenizedGenerateReqInput(
            rid=rid, input_ids=token_ids([1, 2, 3]), sampling=SamplingParams(max_new_tokens=3))))
    for junk in (b"\xc1", b"not msgpack at all", b"\x93\x01\x02"):
        s.work.send(junk)
    answers = s.read_until_terminal(rids)
    refused = sum(1 for code in answers.values() if code == "overloaded")
    assert refused >= 1  # one slot, one queue place: the burst overflows it
    m = _samples(s.url)
    work = (("inbox", "work"), ("type", "TokenizedGenerateReqInput"))
    assert m[("tsb_received_total", work)] == n
    assert sum(v for (name, labels), v in m.items() if name == "tsb_rejected_total") == 3
    assert m[("tsb_refused_total", (("reason", "queue_requests"),))] == refused
    assert m[("tsb_rpc_seconds_count", (("method", "get_load"),))] == 3
    assert m[("tsb_rpc_seconds_count", (("method", "token_digest"),))] == 1
    served_n = n - refused
    assert m[("tsb_time_to_first_token_seconds_count", ())] == served_n
    assert m[("tsb_request_seconds_count", ())] == served_n
    assert m[("tsb_generated_tokens_total", ())] == 3 * served_n
    assert m[("tsb_inter_token_seconds_count", ())] == 2 * served_n
    assert m[("tsb_step_seconds_count", ())] > 0
    routed = (("sink", "TransportSink"), ("type", "ErrorOut"))
    assert m[("tsb_routed_total", routed)] == refused  # rid-less junk has nobody to answer
    # The same text over rpc (what Engine.metrics() reads in zmq mode).
    reply = s.rpc.call("metrics", timeout=30)
    assert reply.success and reply.result is not None
    text = reply.result["text"]
    assert isinstance(text, list) and "tsb_received_total" in "".join(map(str, text))
    # And the live view reads it.
    buf = io.StringIO()
    assert run_top(str(s.port), frames=2, interval=0.01, out=buf, clear=False) == 0
    view = buf.getvalue()
    assert "requests received" in view and "time to first token" in view


def test_top_reports_an_unreachable_endpoint() -> None:
    assert run_top(str(_free_port()), frames=1, out=io.StringIO()) == 1
    assert metrics_url("9100") == "http://127.0.0.1:9100/metrics"
    assert metrics_url("http://h:1/") == "http://h:1/metrics"


def test_histogram_batches_match_single_observations() -> None:
    one, many = Histogram(), Histogram()
    values = [0.00005, 0.0001, 0.0003, 0.02, 0.5, 7.0, 100.0]
    for v in values:
        one.observe(v)
    many.observe_many(values)
    assert one.counts == many.counts
    assert one.total == pytest.approx(many.total)


def test_reject_reasons_are_a_bounded_set() -> None:
    from messages import DecodeError
    from scheduler.core.metrics import REJECT_REASONS

    cases = [DecodeError("junk"), DecodeError("more than max_frames=64 frames"),
             DecodeError("sampling.top_p: bad", rid="r", message_type="X")]
    assert {reject_reason(c) for c in cases} <= set(REJECT_REASONS)
