"""Shared prompt content in workloads: Mooncake blocks as segments, system prompts shared by a
share of requests, and multi-turn sessions issued think seconds after their previous turn."""
import json
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.run import Scenario, simulate
from kvsched.workload import (Fixed, Phase, Poisson, Ragged, RequestType, Uniform, Workload, WorkloadSpec,
                              load_trace, load_workload_file, parse_arrivals, read_trace)
from kvsched.workload.config import parse_phase_flag
from kvsched.workload.request import Segments, session_roots
from kvsched.workload.sharing import (SYSTEM_PROMPT_BASE, Sessions, SharedPrefix, parse_sessions,
                                      parse_shared_prefix, parse_think, system_prompt_id)
from kvsched.workload.source import WorkloadOptions, resolve
from kvsched.workload.traces import export_csv

from conftest import Forwarding, run


def segs(w, i) -> list[tuple[int, int]]:
    return list(zip(w.segments.ids[i].tolist(), w.segments.lengths[i].tolist()))


# ----- Mooncake hash_ids -> segments ----------------------------------------------------------
ROWS = [(0, 1024, 5, [0, 1]),           # two full blocks
        (1500, 600, 7, [0, 2]),         # one full block, then a partial one (not shared)
        (2000, 300, 3, [5]),            # only a partial block
        (2500, 512, 2, [0, 1, 9]),      # more ids than full blocks
        (3000, 2000, 4, [0, 1, 3, 4])]  # three full blocks and a partial one


def mooncake(tmp_path, rows=ROWS, name="m.jsonl"):
    f = tmp_path / name
    f.write_text("".join(json.dumps({"timestamp": t, "input_length": p, "output_length": o, "hash_ids": h}) + "\n"
                         for t, p, o, h in rows))
    return f


def test_mooncake_full_blocks_become_segments(tmp_path):
    f = mooncake(tmp_path)
    rows = read_trace(f)
    assert rows.prefix is None                              # raw hashes only when kept
    assert [rows.segments.ids[i].tolist() for i in range(5)] == [[0, 1], [0], [], [0], [0, 1, 3]]
    assert all((rows.segments.lengths[i] == 512).all() for i in range(5))
    w = load_trace(f, keep_hashes=True)
    assert segs(w, 1) == [(0, 512)] and w.prefix[1].tolist() == [0, 2]     # prefix unchanged
    assert w.segments.tokens().tolist() == [1024, 512, 0, 512, 1536]
    g = tmp_path / "g.csv"
    g.write_text("arrival_time,prompt_tokens,output_tokens\n0,5,5\n")
    assert load_trace(g).segments is None and read_trace(g).segments is None


@pytest.mark.parametrize("hashes,needle", [
    ("[0, -3]", ":2: hash_ids holds -3; block ids must be >= 0"),
    ("[0, 1.5]", ":2: hash_ids must be a list of 64-bit integers"),
    ("[0, true]", ":2: hash_ids must be a list of 64-bit integers"),
    ('"0,1"', ":2: hash_ids must be a list of 64-bit integers"),
    ("[99999999999999999999]", ":2: hash_ids must be a list of 64-bit integers"),
])
def test_bad_hash_ids_name_file_and_line(tmp_path, hashes, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}\n'
                 f'{{"timestamp": 1, "input_length": 1024, "output_length": 5, "hash_ids": {hashes}}}\n')
    with pytest.raises(KvschedError, match=f"bad.jsonl{needle}".replace("[", r"\[").replace(".", r"\.")):
        read_trace(f)
    lines = f.read_text().splitlines()
    f.write_text(lines[0] + "\n" + lines[1].replace('"timestamp": 1', '"timestamp": 0') + "\n" + lines[0][:-1].replace(
        '"timestamp": 0', '"timestamp": 2') + "\n")
    for window in ((0.001, 1.0), (0.0, 0.0005)):            # rows outside a window are checked too
        with pytest.raises(KvschedError, match=needle.replace("[", r"\[")):
            read_trace(f, window=window)
    r = CliRunner().invoke(app, ["workload", "stats", str(f)])
    assert r.exit_code == 2 and needle.split(": ", 1)[1] in r.output


def test_cap_len_shortens_segments(tmp_path):
    f = mooncake(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = WorkloadSpec((Phase(trace=f),), cap_len=700).build()
    assert w.prompt.tolist() == [699, 600, 300, 512, 699]
    assert segs(w, 0) == [(0, 512), (1, 187)] and segs(w, 4) == [(0, 512), (1, 187)]
    assert segs(w, 1) == [(0, 512)] and segs(w, 3) == [(0, 512)] and segs(w, 2) == []
    clipped = Segments(Ragged(np.array([7, 8, 9]), np.array([0, 3])),
                       Ragged(np.array([10, 10, 10]), np.array([0, 3]))).clip(np.array([15]))
    assert clipped.ids[0].tolist() == [7, 8] and clipped.lengths[0].tolist() == [10, 5]


@pytest.mark.parametrize("how", [dict(sample=True, requests=40), dict(sample="permutation"),
                                 dict(requests=23), dict(window=(1.0, 2.6))])
def test_sampled_rows_carry_their_segments(tmp_path, how):
    rows = [(k * 100, 512 * (k % 4) + 100 + k, 3, list(range(k, k + 4))) for k in range(20)]
    f = mooncake(tmp_path, rows)
    by_prompt = {p: [h for h in hs[:p // 512]] for _, p, _, hs in rows}
    w = WorkloadSpec((Phase(trace=f, **how),), seed=3).build()
    assert len(w) == how.get("requests", len(w))
    for i in range(len(w)):
        assert w.segments.ids[i].tolist() == by_prompt[int(w.prompt[i])]


def test_mooncake_synthetic_repeats_like_the_readme(traces_dir):
    """The README: 64 % of the synthetic trace's blocks repeat an earlier id. Segment tokens whose
    whole chain (every segment up to and including it) appeared in an earlier request: ~66 %
    (full blocks only; the README counts partial blocks too)."""
    s = read_trace(traces_dir / "mooncake-synthetic.jsonl").segments
    seen, repeated, total = {}, 0, 0
    for i in range(len(s)):
        node = 0
        for h, n in zip(s.ids[i].tolist(), s.lengths[i].tolist()):
            key = (node, h)
            repeated += n * (key in seen)
            node = seen.setdefault(key, len(seen) + 1)
            total += n
    assert abs(repeated / total - 0.64) < 0.03


# ----- system prompts shared by a share of requests ------------------------------------------------
def shared_spec(seed=0, n=10_000, prefixes=((1000, 0.3), (200, 0.2))):
    return WorkloadSpec((Phase(n, (RequestType(Uniform(10, 100), Fixed(5)),), arrivals=Poisson(50.0),
                               shared_prefix=tuple(SharedPrefix(t, s) for t, s in prefixes)),
                         Phase(100, (RequestType(Fixed(50), Fixed(5)),), arrivals=Poisson(50.0),
                               shared_prefix=(SharedPrefix(300, 1.0),)),
                         Phase(10, (RequestType(Fixed(50), Fixed(5)),), arrivals=Poisson(50.0))), seed=seed)


def test_shared_prefix_shares_lengths_and_ids():
    w = shared_spec().build()
    first = w.phase == 0
    sys0 = np.array([w.segments.ids[i][0] if len(w.segments.ids[i]) else -1 for i in range(len(w))])
    assert abs((sys0[first] == system_prompt_id(0, 0)).mean() - 0.3) < 0.015
    assert abs((sys0[first] == system_prompt_id(0, 1)).mean() - 0.2) < 0.015
    assert abs((sys0[first] == -1).mean() - 0.5) < 0.015
    lens = {system_prompt_id(0, 0): 1000, system_prompt_id(0, 1): 200, -1: 0}
    drawn = w.prompt[first] - np.array([lens[x] for x in sys0[first]])
    assert drawn.min() >= 10 and drawn.max() <= 100           # the system prompt is prepended
    assert (sys0[w.phase == 1] == SYSTEM_PROMPT_BASE + (1 << 20)).all()
    assert (w.segments.tokens()[w.phase == 2] == 0).all()      # a phase without: no segments
    assert SYSTEM_PROMPT_BASE > 2 ** 61 and w.declared_types is None


def test_shared_prefix_seeded():
    a, b, c = shared_spec(1, 2000).build(), shared_spec(1, 2000).build(), shared_spec(2, 2000).build()
    assert a.prompt.tobytes() == b.prompt.tobytes() and a.segments.ids.values.tobytes() == b.segments.ids.values.tobytes()
    assert a.prompt.tobytes() != c.prompt.tobytes()
    plain = WorkloadSpec((Phase(50, (RequestType(Uniform(10, 100), Fixed(5)),)),), seed=4).build()
    assert plain.segments is None and not plain.has_sessions      # unchanged without the options


@pytest.mark.parametrize("value,needle", [
    ([{"tokens": 10, "share": 1.2}], "share must be a number in \\[0, 1\\]"),
    ([{"tokens": 10, "share": 0.6}, {"tokens": 5, "share": 0.6}], "shares sum to 1.2"),
    ([{"tokens": 0, "share": 0.1}], "tokens must be an integer"),
    ([{"tokens": 1.5, "share": 0.1}], "tokens must be an integer"),
    ([{"tokens": 10}], "needs exactly tokens and share"),
    ("100:x", "TOKENS is an integer, SHARE a number"),
    ("100", "expected TOKENS:SHARE items"),
    (5, "shared_prefix must be a list"),
])
def test_shared_prefix_bad_input(value, needle):
    with pytest.raises(KvschedError, match=needle) as err:
        parse_shared_prefix(value)
    assert "\n" not in str(err.value) and "shared_prefix" in str(err.value)


def test_workload_file_and_flags(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text('seed = 2\n[[phases]]\nrequests = 300\nprompt = "fixed:20"\noutput = "fixed:4"\n'
                 'arrivals = "poisson:5"\nshared_prefix = [{tokens = 100, share = 0.5}]\n'
                 'sessions = {turns = "uniform:1:3", think = "exponential:2"}\n')
    spec = load_workload_file(f)
    assert spec.phases[0].shared_prefix == (SharedPrefix(100, 0.5),)
    assert str(spec.phases[0].sessions) == "turns=Uniform(low=1, high=3),think=exponential:2"
    w = spec.build()
    assert len(w) == 300 and w.has_sessions
    f.write_text('requests = 3\nprompt = "fixed:20"\noutput = "fixed:4"\nshared_prefix = [{tokens = 100, share = 2}]\n')
    with pytest.raises(KvschedError, match=r"w.toml: phase 1: shared_prefix: share must be"):
        load_workload_file(f)
    ph = parse_phase_flag("requests=10 prompt=fixed:5 output=fixed:5 shared_prefix=50:0.5 sessions=turns=2,think=1", 0)
    assert ph.shared_prefix == (SharedPrefix(50, 0.5),) and ph.sessions == Sessions(Fixed(2), parse_think(1.0))
    spec = resolve(WorkloadOptions(shared_prefix="50:1", sessions="turns=3"))
    assert spec.phases[0].shared_prefix == (SharedPrefix(50, 1.0),) and spec.phases[0].sessions.turns == Fixed(3)
    with pytest.raises(KvschedError, match="--shared-prefix: shared_prefix: shares sum to 1.5"):
        resolve(WorkloadOptions(shared_prefix="50:1,20:0.5"))
    with pytest.raises(KvschedError, match="apply to synthetic workloads, not to a trace"):
        resolve(WorkloadOptions(trace=mooncake(tmp_path), sessions="turns=3"))


# ----- sessions ----------------------------------------------------------------------------------
def session_workload(n=300, turns="uniform:1:5", think="exponential:0.5", prefixes=((400, 0.5),), seed=5,
                     rate=3.0) -> Workload:
    ph = Phase(n, (RequestType(Uniform(10, 200), Uniform(2, 40)),), arrivals=Poisson(rate),
               shared_prefix=tuple(SharedPrefix(t, s) for t, s in prefixes),
               sessions=parse_sessions(f"turns={turns},think={think}"))
    return WorkloadSpec((Phase(20, (RequestType(Fixed(30), Fixed(3)),), arrivals=Poisson(rate)), ph),
                        seed=seed).build()


def test_session_prompts_grow_and_segments_chain():
    w = session_workload()
    assert len(w) == 320 and w.has_sessions
    prev = w.previous_turn()
    later = np.flatnonzero(prev >= 0)
    assert len(later) > 100 and (w.session_prev[later] == w.ids[prev[later]]).all()
    tokens = w.segments.tokens()
    for s in later.tolist():
        p = prev[s]
        new = w.prompt[s] - w.prompt[p] - w.output[p]
        assert 10 <= new <= 200                                     # the new user tokens
        own = w.prompt[p] - tokens[p] + w.output[p]
        assert segs(w, s) == segs(w, p) + [(-(int(w.ids[p]) + 1), int(own))]
        assert w.arrival[s] == w.arrival[p] and w.think[s] >= 0 and s > p
        assert w.phase[s] == 1
    firsts = np.flatnonzero((prev < 0) & (w.phase == 1))
    assert (w.think[firsts] == 0).all() and (w.session_prev[firsts] == -1).all()
    assert (w.segments.ids.values[w.segments.ids.values >= 0] == system_prompt_id(1, 0)).all()
    # a session keeps its system prompt: every turn or none
    has_sys = np.array([len(w.segments.ids[i]) > 0 and w.segments.ids[i][0] >= 0 for i in range(len(w))])
    assert (has_sys[later] == has_sys[prev[later]]).all()


def test_session_turns_and_determinism():
    a, b = session_workload(seed=9), session_workload(seed=9)
    for f in ("arrival", "prompt", "output", "session_prev", "think"):
        assert getattr(a, f).tobytes() == getattr(b, f).tobytes()
    w = session_workload(n=1000, turns="4", think="2")
    prev = w.previous_turn()
    assert set(w.think[prev >= 0].tolist()) == {2.0}
    sizes = np.bincount(session_roots(prev)[w.phase == 1])
    assert sorted(set(sizes[sizes > 0].tolist())) == [4] and len(sizes[sizes > 0]) == 250


def issue_gaps(w, rec) -> np.ndarray:
    """Each later turn's arrival minus (its previous turn's end + think); a rejected turn ends when
    it would have arrived."""
    prev = w.previous_turn()
    s = prev >= 0
    end = np.where(rec.rejected, rec.arrival, rec.finished)
    return rec.arrival[s] - (end[prev[s]] + w.think[s])


def scenario(w, **kw) -> Scenario:
    return Scenario(w, cost="constant", cost_params={"b": 0.01}, kv_capacity=50_000, **kw)


@pytest.mark.parametrize("kw", [{}, {"replicas": 2}, {"replicas": 3, "router": "least-outstanding"},
                                {"prefill_replicas": 1, "decode_replicas": 2}])
def test_turn_arrives_think_after_its_previous_turn_finishes(kw):
    w = session_workload()
    r = simulate(scenario(w, **kw), "vllm-v1")
    rec = r.records
    assert r.summary["completed"] == len(w) and not rec.rejected.any()
    assert (issue_gaps(w, rec) == 0).all()                  # exactly, not approximately
    assert (rec.arrival[w.session_prev < 0] == w.arrival[w.session_prev < 0]).all()
    if kw.get("replicas", 1) > 1:
        assert len(set(rec.replica.tolist())) == kw["replicas"]


def test_rejected_turn_finishes_when_it_would_arrive():
    w = session_workload(n=200, turns="6", think="0.25", prefixes=())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = simulate(scenario(w, max_model_len=400), "sarathi")
    rec = r.records
    assert 0 < rec.rejected.sum() < len(w) and r.summary["completed"] == len(w) - rec.rejected.sum()
    assert (issue_gaps(w, rec) == 0).all()
    prev = w.previous_turn()
    assert (rec.rejected & (prev >= 0) & rec.rejected[np.maximum(prev, 0)]).any()   # chains of rejections


class Probe(Forwarding):
    """Records (now, arrivals pending, next arrival) at every plan."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.seen: list[tuple[float, bool, float | None]] = []

    def schedule(self, v):
        self.seen.append((v.now, v.arrivals_pending, v.next_arrival))
        return self.inner.schedule(v)


def test_arrivals_pending_until_the_last_turn_is_issued():
    from kvsched.hardware import get_gpu
    from kvsched.policies import make_policy
    w = session_workload(n=150, turns="3", think="1.0")
    probe = Probe(make_policy("vllm-v1", {}, get_gpu("a100-80gb")))
    _, rec, _ = run(w, probe, checked=False, cost_params={"b": 0.01})
    last = rec.arrival.max()
    times = set(rec.arrival.tolist())
    for now, pending, nxt in probe.seen:
        assert pending == (now < last)
        if nxt is not None:
            assert nxt >= now and nxt in times
    # one session: while a turn runs, the next is pending at a time not known yet (as in a closed loop)
    w = Workload.build([0, 0, 0], [10, 20, 30], [5, 5, 5], session_prev=[-1, 0, 1], think=[0, 0.5, 0.25])
    probe = Probe(make_policy("vllm-v1", {}, get_gpu("a100-80gb")))
    _, rec, _ = run(w, probe, checked=False, cost_params={"b": 0.01})
    assert rec.arrival.tolist() == [0, rec.finished[0] + 0.5, rec.finished[1] + 0.25]
    assert [seen[1:] for seen in probe.seen] == [(True, None)] * 10 + [(False, None)] * 5


def test_without_sessions_runs_exactly_as_before():
    """The new fields at their defaults change nothing: the same summary as a workload built
    from the old fields alone, through one replica and a cluster."""
    base = WorkloadSpec((Phase(400, (RequestType(Uniform(10, 300), Uniform(1, 60)),), arrivals=Poisson(300.0)),),
                        seed=3).build()
    old = Workload(base.arrival, base.prompt, base.output, base.output_known, base.tier_index, base.tiers)
    new = Workload.build(base.arrival, base.prompt, base.output, session_prev=np.full(len(base), -1),
                         think=np.zeros(len(base)))
    for kw in ({}, {"replicas": 2}):
        a = simulate(Scenario(old, kv_capacity=2000, cost="linear", **kw), "vllm-v1").summary
        b = simulate(Scenario(new, kv_capacity=2000, cost="linear", **kw), "vllm-v1").summary
        c = simulate(Scenario(base, kv_capacity=2000, cost="linear", **kw), "vllm-v1").summary
        drop = lambda s: json.dumps({k: v for k, v in s.items() if k != "wall_seconds"}, sort_keys=True)  # noqa: E731
        assert drop(a) == drop(b) == drop(c)
        assert a["preemptions"] > 0


# ----- checks -----------------------------------------------------------------------------------------
def ragged(rows):
    sizes = [len(r) for r in rows]
    return Ragged(np.array([x for r in rows for x in r], np.int64), np.concatenate(([0], np.cumsum(sizes))))


def with_segments(seg_ids, seg_lengths, prev=(-1, -1, -1), **kw):
    return Workload.build([0, 1, 2], [100, 100, 100], [5, 5, 5], session_prev=list(prev),
                          segments=Segments(ragged(seg_ids), ragged(seg_lengths)), **kw)


@pytest.mark.parametrize("args,needle", [
    (([[1], [], []], [[101], [], []]), "request 0's segments hold 101 tokens, more than its prompt of 100"),
    (([[1], [], []], [[0], [], []]), "request 0 has a segment of 0 tokens"),
    (([[1], [], []], [[1, 2], [], []]), "differ in shape"),
    (([[], [-3], []], [[], [5], []]), "request 1 has a segment of request 2's own tokens, which is not an earlier turn"),
    (([[], [-1], []], [[], [5], []]), "not an earlier turn of its session"),            # no session
    (([[], [], [-1]], [[], [], [5]], (-1, -1, 1)), "not an earlier turn of its session"),  # another session
    (([[], [], []], [[], [], []], (-1, 2, -1)), "request 1's previous turn 2 is not an earlier request"),
    (([[], [], []], [[], [], []], (-1, 0, 0)), "request 0 has two follow-up turns"),
    (([[], [], []], [[], [], []], (-1, 7, -1)), "previous turn 7 is not an earlier request"),
])
def test_bad_segments_and_sessions(args, needle):
    with pytest.raises(KvschedError, match=needle):
        with_segments(*args)


def test_session_ids_are_caller_ids():
    w = with_segments([[], [-11], [-11, -21]], [[], [50], [50, 30]], (-1, 10, 20), ids=[10, 20, 30])
    assert w.previous_turn().tolist() == [-1, 0, 1]
    with pytest.raises(KvschedError, match="sessions need open-loop arrivals"):
        Workload.build([0, 0], [5, 5], [5, 5], session_prev=[-1, 0], concurrency=[2, 2])
    with pytest.raises(KvschedError, match=r"think\[1\] must be a finite number of seconds >= 0"):
        Workload.build([0, 0], [5, 5], [5, 5], session_prev=[-1, 0], think=[0, -1])


def test_sessions_refused_where_they_cannot_apply(tmp_path):
    sess = parse_sessions("turns=3")
    with pytest.raises(KvschedError, match="sessions need open-loop arrivals"):
        WorkloadSpec((Phase(10, (RequestType(Fixed(5), Fixed(5)),), arrivals=parse_arrivals("closed:4"),
                            sessions=sess),)).build()
    with pytest.raises(KvschedError, match="cap_len does not apply to sessions"):
        WorkloadSpec((Phase(10, (RequestType(Fixed(5), Fixed(5)),), sessions=sess),), cap_len=100).build()
    with pytest.raises(KvschedError, match="not to a trace"):
        WorkloadSpec((Phase(trace=mooncake(tmp_path), sessions=sess),)).build()
    with pytest.raises(KvschedError, match="no arrival times to export for its later turns"):
        export_csv(session_workload(n=20), tmp_path / "out.csv")
    for bad in ("turns=0", "think=2", "turns=3,think=-1", "turns=3,think=uniform:3:1", "turns=3,pause=2", "3"):
        with pytest.raises(KvschedError, match="sessions"):
            parse_sessions(bad)
