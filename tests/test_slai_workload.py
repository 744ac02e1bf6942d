"""The SLAI workload (rad-slai.txt section 7): truncated-Poisson arrivals, ShareGPT rows read
without replacement from a seeded shuffle, paying / free tiers drawn per request."""
from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import Poisson, PoissonTruncated, parse_arrivals
from kvsched.workload.config import load_workload_file
from kvsched.workload.bundled import find_named
from kvsched.workload.presets import PRESETS, SHAREGPT_FILE, slai_workload
from kvsched.workload.readers import read_trace
from kvsched.workload.source import WorkloadOptions, load, resolve
from kvsched.workload.spec import Phase, WorkloadSpec

E3 = 1 - math.exp(-3)


@pytest.fixture
def sharegpt():
    """The bundled ShareGPT length file."""
    return find_named(SHAREGPT_FILE)


def quiet(fn, *args, **kw):
    """Call without warnings (the 8,192-token cap's, for one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


# ----- poisson-trunc:RATE:K ----------------------------------------------------------------

@pytest.mark.parametrize("rate,k", [(1.0, 3.0), (0.2, 3.0), (7.5, 1.0), (2.0, 0.25)])
def test_truncated_gaps_capped_and_mean_rate(rate, k):
    a = PoissonTruncated(rate, k)
    assert a.mean_rate == pytest.approx(rate / (1 - math.exp(-k)), rel=1e-12)
    t = a.times(np.random.default_rng(7), 200_000)
    gaps = np.diff(t, prepend=0.0)
    assert gaps.min() > 0
    assert gaps.max() <= k / rate + 1e-9 * t[-1]              # cumsum rounding only
    assert abs(gaps.mean() * a.mean_rate - 1) < 0.01
    capped = (gaps > k / rate * (1 - 1e-9)).mean()           # P(X > K / rate) = e^-K
    assert abs(capped - math.exp(-k)) < 5 * math.sqrt(math.exp(-k) * (1 - math.exp(-k)) / len(gaps))


def test_truncated_k3_is_1_0524_rate():
    assert PoissonTruncated(1.0, 3).mean_rate == pytest.approx(1 / E3)
    assert round(PoissonTruncated(1.0, 3).mean_rate, 4) == 1.0524


def test_truncated_parse_str_and_with_rate():
    a = parse_arrivals("poisson-trunc:1.6:3")
    assert a == PoissonTruncated(1.6, 3.0) and str(a) == "poisson-trunc:1.6:3"
    assert parse_arrivals(str(a)) == a
    b = a.with_rate(0.4)                                      # nominal rate set, K kept
    assert b == PoissonTruncated(0.4, 3.0) and b.mean_rate == pytest.approx(0.4 / E3)


@pytest.mark.parametrize("spec,match", [
    ("poisson-trunc", "expected poisson-trunc:RATE:K"),
    ("poisson-trunc:1", "expected poisson-trunc:RATE:K"),
    ("poisson-trunc:1:", "expected poisson-trunc:RATE:K"),
    ("poisson-trunc::3", "expected poisson-trunc:RATE:K"),
    ("poisson-trunc:1:3:4", "expected poisson-trunc:RATE:K"),
    ("poisson-trunc:1:0", "K .* must be a finite number > 0"),
    ("poisson-trunc:1:-2", "K .* must be a finite number > 0"),
    ("poisson-trunc:1:inf", "K .* must be a finite number > 0"),
    ("poisson-trunc:1:nan", "K .* must be a finite number > 0"),
    ("poisson-trunc:0:3", "rate must be a positive number"),
    ("poisson-trunc:-1:3", "rate must be a positive number"),
    ("poisson-trunc:inf:3", "rate must be a positive number"),
    ("poisson-trunc:fast:3", "values must be numbers"),
])
def test_truncated_parse_errors(spec, match):
    with pytest.raises(KvschedError, match=match) as exc:
        parse_arrivals(spec)
    assert "\n" not in str(exc.value)


def test_truncated_in_workload_files_and_flags(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text('requests = 500\nprompt = "fixed:10"\noutput = "fixed:5"\narrivals = "poisson-trunc:2:3"\n')
    spec = load_workload_file(f)
    assert spec.phases[0].arrivals == PoissonTruncated(2.0, 3.0)
    w = spec.build()
    assert np.diff(w.arrival, prepend=0.0).max() <= 1.5 + 1e-9
    assert spec.declared_types() == ((10, 5, pytest.approx(2 / E3)),)    # the effective rate
    w = load(WorkloadOptions(arrivals="poisson-trunc:4:2", num_requests=100))
    assert np.diff(w.arrival, prepend=0.0).max() <= 0.5 + 1e-9
    f.write_text('requests = 5\nprompt = "fixed:10"\noutput = "fixed:5"\narrivals = "poisson-trunc:2"\n')
    with pytest.raises(KvschedError, match="poisson-trunc:RATE:K"):
        load_workload_file(f)


# ----- sample = "permutation" ------------------------------------------------------------

@pytest.fixture(scope="module")
def unique_rows(tmp_path_factory):
    """A length-only trace of 50 rows with distinct prompt lengths 1..50."""
    f = tmp_path_factory.mktemp("rows") / "rows.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{p},{p % 7 + 1}\n" for p in range(1, 51)))
    return f


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 50), st.integers(0, 2**32 - 1))
def test_permutation_never_repeats_a_row(unique_rows, n, seed):
    ph = Phase(n, trace=unique_rows, arrivals=Poisson(1.0), sample="permutation")
    w = WorkloadSpec((ph,), seed=seed).build()
    assert len(w) == n and len(set(w.prompt.tolist())) == n
    assert np.array_equal(w.output, w.prompt % 7 + 1)           # rows stay whole


def test_permutation_is_a_seeded_shuffle(unique_rows):
    def prompts(seed, n=None):
        return WorkloadSpec((Phase(n, trace=unique_rows, arrivals=Poisson(1.0), sample="permutation"),),
                            seed=seed).build().prompt.tolist()
    assert sorted(prompts(0)) == list(range(1, 51)) and prompts(0) != list(range(1, 51))
    assert prompts(0) == prompts(0) and prompts(0) != prompts(1)
    assert prompts(3, 20) == prompts(3)[:20]                   # the first N of one shuffle


def test_permutation_errors(unique_rows, tmp_path):
    with pytest.raises(KvschedError, match=r"51 requests drawn without replacement .* has 50"):
        WorkloadSpec((Phase(51, trace=unique_rows, arrivals=Poisson(1.0), sample="permutation"),)).build()
    with pytest.raises(KvschedError, match="sample must be"):
        WorkloadSpec((Phase(5, trace=unique_rows, arrivals=Poisson(1.0), sample="shuffle"),)).build()
    f = tmp_path / "w.toml"
    f.write_text(f'trace = "{unique_rows}"\nrequests = 10\narrivals = "poisson:1"\nsample = "permutation"\n')
    assert load_workload_file(f).phases[0].sample == "permutation"
    f.write_text(f'trace = "{unique_rows}"\nrequests = 10\narrivals = "poisson:1"\nsample = "perm"\n')
    with pytest.raises(KvschedError, match='sample must be true .* "permutation"'):
        load_workload_file(f)


# ----- slai_workload and the slai-* presets ------------------------------------------------

@pytest.mark.parametrize("rate", [0.2, 0.4, 1.0, 1.2, 1.6])
def test_request_count_is_effective_rate_times_duration(rate):
    spec = quiet(slai_workload, 0.05, rate)
    assert spec.phases[0].arrivals == PoissonTruncated(rate, 3.0)
    assert spec.phases[0].requests == math.ceil(round(rate / E3 * 2100, 9))
    plain = quiet(slai_workload, 0.05, rate, truncated=False)
    assert plain.phases[0].arrivals == Poisson(rate)
    assert plain.phases[0].requests == round(rate * 2100)      # 0.2 x 2100 = 420, not 421
    assert quiet(slai_workload, 0.05, 1.0).phases[0].requests == 2211
    assert quiet(slai_workload, 0.05, 1.0, duration=60).phases[0].requests == math.ceil(60 / E3)


def test_slai_rows_without_replacement(sharegpt):
    rows = read_trace(sharegpt)
    file_pairs = Counter(zip(rows.prompt.tolist(), rows.output.tolist()))
    spec = replace(slai_workload(0.05, 1.6), cap_len=None)     # uncapped: the file's own rows
    w = spec.build()
    assert spec.phases[0].sample == "permutation" and len(w) == math.ceil(1.6 / E3 * 2100)
    drawn = Counter(zip(w.prompt.tolist(), w.output.tolist()))
    assert not drawn - file_pairs                             # no row more often than the file has it
    # every row once: the whole file, shuffled
    everything = WorkloadSpec((Phase(None, trace=sharegpt, arrivals=Poisson(1.0), sample="permutation"),),
                              seed=5).build()
    assert Counter(zip(everything.prompt.tolist(), everything.output.tolist())) == file_pairs
    assert not np.array_equal(everything.prompt, rows.prompt)


def test_slai_seeded_determinism(sharegpt):
    a, b = slai_workload(0.05, 1.0, seed=3).build(), slai_workload(0.05, 1.0, seed=3).build()
    for name in ("arrival", "prompt", "output", "tier_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    c = slai_workload(0.05, 1.0, seed=4).build()
    assert not np.array_equal(a.prompt, c.prompt) and not np.array_equal(a.arrival, c.arrival)
    assert (a.prompt + a.output).max() <= 8192


def test_slai_arrivals_span_35_minutes(sharegpt):
    w = slai_workload(0.05, 1.0).build()
    gaps = np.diff(w.arrival, prepend=0.0)
    assert gaps.max() <= 3.0 + 1e-9
    assert abs(w.arrival[-1] / 2100 - 1) < 0.05


@pytest.mark.parametrize("paying", [0.05, 0.5, 0.95])
def test_slai_tiers_drawn_independently(sharegpt, paying):
    counts = []
    for seed in range(4):
        w = slai_workload(paying, 1.0, seed=seed).build()
        tiers = {t.name: t for t in w.tiers}
        assert (tiers["paying"].tbt_slo, tiers["paying"].priority) == (0.1, 0)
        assert (tiers["free"].tbt_slo, tiers["free"].priority) == (0.5, 1)
        paid = int((w.tier_index == [t.name for t in w.tiers].index("paying")).sum())
        assert abs(paid / len(w) - paying) <= 4 * math.sqrt(paying * (1 - paying) / len(w))
        assert (w.tier_index >= 0).all()
        counts.append(paid)
    assert len(set(counts)) > 1                               # a draw per request, not a fixed split


def test_slai_presets(sharegpt):
    for name, paying in (("slai-paying-5", 0.05), ("slai-paying-50", 0.5), ("slai-paying-95", 0.95)):
        p = PRESETS[name]
        spec = p.make()
        ph = spec.phases[0]
        assert ph.arrivals == PoissonTruncated(1.0, 3.0) and ph.sample == "permutation"
        assert ph.requests == 2211 and spec.cap_len == 8192 and spec.name == name
        assert [ts.share for ts in spec.tiers] == [paying, pytest.approx(1 - paying)]
        assert "rad-slai.txt" in p.source and "section 5" not in p.source
        assert "without replacement" in p.description
    assert "section 7" in PRESETS["slai-paying-5"].source
    spec = resolve(WorkloadOptions(workload="slai-paying-5", rate=1.6, seed=2))
    assert spec.phases[0].arrivals == PoissonTruncated(1.6, 3.0) and spec.seed == 2


def test_slai_too_many_requests_for_the_file(sharegpt):
    with pytest.raises(KvschedError, match="without replacement"):
        slai_workload(0.05, 1.6, duration=50_000).build()


def test_slai_reads_the_bundled_trace_when_kvsched_traces_lacks_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path))       # an empty folder: never a stand-in
    spec = PRESETS["slai-paying-5"].make()
    assert spec.phases[0].trace == find_named(SHAREGPT_FILE) and spec.phases[0].arrivals == PoissonTruncated(1.0, 3.0)
    w = quiet(spec.build)
    assert len(w) == 2211 and np.diff(w.arrival, prepend=0.0).max() <= 3.0 + 1e-9


def test_slai_workload_argument_errors():
    for kw in ({"paying": 1.5, "rate": 1.0}, {"paying": -0.1, "rate": 1.0}, {"paying": 0.5, "rate": 0.0},
               {"paying": 0.5, "rate": 1.0, "duration": 0.0}):
        with pytest.raises(KvschedError):
            quiet(slai_workload, **kw)
