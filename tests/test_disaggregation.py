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


def test_decode_replica_waits_for_kv_then_decodes():
    """Every replica holds 1000 tokens. A (s=900, o=5) and B (s=100, o=5) at 0.
    prefill: [0, 0.1] A 512; [0.1, 0.2] A 388 + B 100 (exactly 1000 tokens): both first tokens at 0.2.
    link: A 9e5 B lands 0.2009; B 1e5 B queues behind it, lands 0.2010.
    decode: A decodes from 0.2009 (4 steps, done 0.6009). B needs 100 + 1 more blocks than are
    free while A runs, so it waits (no preemption) and decodes from 0.6009: done 1.0009."""
    w = Workload.from_requests([Request(0.0, 900, 5), Request(0.0, 100, 5)])
    c = pd_cluster(w, kv_tokens=1000, latency=0.0)
    rec = c.run()
    assert rec.first_token.tolist() == pytest.approx([0.2, 0.2], abs=1e-12)
    assert rec.transfer.tolist() == pytest.approx([9e-4, 1e-3], abs=1e-12)
    assert rec.finished.tolist() == pytest.approx([0.6009, 1.0009], abs=1e-12)
    assert rec.itl_max[1] == pytest.approx(0.7009 - 0.2, abs=1e-12)
    assert rec.preemptions.sum() == 0
    assert max(b[5] for b in c.replicas[1].batches) <= 1000 and max(b[5] for b in c.replicas[0].batches) == 1000


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
