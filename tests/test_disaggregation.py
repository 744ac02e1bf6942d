"""Prefill/decode disaggregation, worked by hand, and its invariants."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.cost import ConstantCost
from kvsched.hardware import get_gpu
from kvsched.kvcache import PagedKV
from kvsched.metrics import summarize
from kvsched.policies import make_policy
from kvsched.run import Scenario, simulate
from kvsched.sim.cluster import Cluster
from kvsched.workload import Request, Uniform, Workload, synthetic


def pd_cluster(w, kv_tokens=10_000, prefill=1, decode=1, latency=0.01, b=0.1):
    pols = [make_policy("vllm-v1", {"max_num_batched_tokens": 512, "max_num_seqs": 16}, get_gpu("a30"))
            for _ in range(prefill + decode)]
    return Cluster(w, pols, ConstantCost(b), PagedKV(kv_tokens, 1), prefill_replicas=prefill,
                   kv_bytes_per_token=1000, bandwidth_gbps=1.0, latency_s=latency, record_batches=True)


def test_hand_worked_disaggregated_run():
    """b = 0.1 s per batch; KV 1000 bytes/token over 1 GB/s plus 10 ms latency.
    A (s=100, o=3) at 0, B (s=200, o=2) at 0.05.
    prefill replica: batch [0, 0.1] prefills A (first token 0.1); B waits; [0.1, 0.2] prefills B.
    link: A sends 1e5 B = 1e-4 s from 0.1 -> leaves 0.1001, lands 0.1101;
          B sends 2e5 B from 0.2 (link free) -> leaves 0.2002, lands 0.2102.
    decode replica: A lands at 0.1101, decodes [0.1101, 0.2101] (token 2) and
          [0.2101, 0.3101] (token 3, done); B lands at 0.2102 during that batch, decodes
          [0.3101, 0.4101] (token 2, done)."""
    w = Workload.from_requests([Request(0.0, 100, 3), Request(0.05, 200, 2)])
    c = pd_cluster(w)
    rec = c.run()
    assert rec.first_token.tolist() == pytest.approx([0.1, 0.2], abs=1e-9)
    assert rec.finished.tolist() == pytest.approx([0.3101, 0.4101], abs=1e-9)
    assert rec.transfer.tolist() == pytest.approx([0.0101, 0.0102], abs=1e-9)
    assert rec.itl_max.tolist() == pytest.approx([0.1101, 0.2101], abs=1e-9)
    assert rec.replica.tolist() == [0, 0] and rec.decode_replica.tolist() == [1, 1]
    assert [round(x[0], 9) for x in c.replicas[1].batches] == [0.1101, 0.2101, 0.3101]
    s = summarize(rec)
    assert s["mean_ttft_ms"] == pytest.approx((100 + 150) / 2, abs=1e-6)
    assert s["mean_transfer_ms"] == pytest.approx(10.15, abs=1e-6)
    assert s["mean_itl_ms"] == pytest.approx((110.1 + 100 + 210.1) / 3, abs=1e-6)
    assert s["prefill_busy_fraction"] == pytest.approx(0.2 / 0.4101, abs=1e-9)
    assert s["decode_busy_fraction"] == pytest.approx(0.3 / 0.4101, abs=1e-9)
    assert all(r.kv.used == 0 for r in c.replicas)


def test_transfers_queue_on_the_link():
    """Two 200-token prompts prefilled in one batch hand off together at 0.1: the second
    transfer (0.2 ms on the link) waits for the first."""
    w = Workload.from_requests([Request(0.0, 200, 5), Request(0.0, 200, 5)])
    rec = pd_cluster(w, latency=0.0).run()
    assert rec.first_token.tolist() == pytest.approx([0.1, 0.1], abs=1e-12)
    assert rec.transfer.tolist() == pytest.approx([2e-4, 4e-4], abs=1e-12)


def test_decode_replica_pulls_kv_when_it_has_room():
    """Every replica holds 1000 tokens. A (s=900, o=5) and B (s=100, o=5) at 0.
    prefill: [0, 0.1] A 512; [0.1, 0.2] A 388 + B 100 (exactly 1000 tokens): both first tokens at 0.2.
    decode replica: pulls A at 0.2 (9e5 B: lands 0.2009) and decodes it from 0.2009: done 0.6009.
    B (100 blocks + 1 for its next token) has no room beside A, so its KV stays on the prefill
    replica until A finishes at 0.6009; then it crosses (1e-4 s), lands 0.601 and decodes
    [0.601, 1.001]. No preemption; the prefill replica holds B's KV until 0.601."""
    w = Workload.from_requests([Request(0.0, 900, 5), Request(0.0, 100, 5)])
    c = pd_cluster(w, kv_tokens=1000, latency=0.0)
    seen = []
    inner = c.replicas[0].policy.schedule
    c.replicas[0]._schedule = lambda v: (seen.append((v.now, v.kv_used_blocks)), inner(v))[1]
    rec = c.run()
    assert rec.first_token.tolist() == pytest.approx([0.2, 0.2], abs=1e-12)
    assert rec.transfer.tolist() == pytest.approx([9e-4, 0.401], abs=1e-12)
    assert rec.finished.tolist() == pytest.approx([0.6009, 1.001], abs=1e-12)
    assert rec.itl_max[1] == pytest.approx(0.701 - 0.2, abs=1e-12)
    assert rec.preemptions.sum() == 0
    assert max(b[5] for b in c.replicas[1].batches) <= 1000 and max(b[5] for b in c.replicas[0].batches) == 1000
    assert c.replicas[0].kv.used == 0 and c.replicas[1].kv.used == 0


def test_full_decode_pool_pushes_back_on_prefill():
    """With a small decode pool, KV waits on the prefill replicas (never in no pool at all):
    every replica stays within its capacity and every request finishes."""
    w = synthetic(Uniform(50, 150), Uniform(100, 300), rate=200, n=300, seed=9)
    c = pd_cluster(w, kv_tokens=2000, prefill=2, decode=1, latency=0.0, b=0.01)
    rec = c.run()
    assert np.isfinite(rec.finished).all()
    for r in c.replicas:
        assert max(b[5] for b in r.batches) <= 2000 and r.kv.used == 0
    assert np.nanmax(rec.transfer) > 0.5        # requests waited for decode room


@pytest.mark.parametrize("decode_policy", ["vllm-v1", "sarathi", "vllm-v0"])
def test_pools_conserve_tokens_and_finish(decode_policy):
    w = synthetic(Uniform(1, 600), Uniform(1, 300), rate=25, n=600, seed=4)
    r = simulate(Scenario(w, kv_capacity=30_000, prefill_replicas=2, decode_replicas=3, cost="linear"),
                 "vllm-v1", decode_policy=decode_policy)
    rec = r.records
    assert r.summary["completed"] == len(w)
    one = rec.output == 1
    assert np.isnan(rec.transfer[one]).all() and np.isfinite(rec.transfer[~one]).all()
    assert set(rec.replica.tolist()) == {0, 1} and set(rec.decode_replica[~one].tolist()) == {2, 3, 4}
    assert rec.itl.n == int((w.output - 1).sum())
    assert 0 < r.summary["prefill_busy_fraction"] <= 1 and 0 < r.summary["decode_busy_fraction"] <= 1
    assert r.summary["decode_policy"] == decode_policy


def test_cli_disaggregated_json_and_csv(tmp_path):
    out = tmp_path / "pd"
    res = CliRunner().invoke(app, ["simulate", "--num-requests", "60", "--rate", "10", "--prefill-replicas", "1",
                                   "--decode-replicas", "2", "--kv-transfer-bandwidth", "5", "--json", "--out",
                                   str(out)])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["prefill_replicas"] == 1 and s["decode_replicas"] == 2 and s["mean_transfer_ms"] > 0
    assert [row["role"] for row in s["replica_breakdown"]] == ["prefill", "decode", "decode"]
    header = (out / "requests.csv").read_text().splitlines()[0].split(",")
    assert header[-3:] == ["replica", "decode_replica", "transfer_s"]
