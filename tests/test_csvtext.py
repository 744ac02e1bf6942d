"""CSV files written a block of columns at a time (csvtext, sim/rowlog.row_blocks) are byte for byte what
csv.writer writes for the same Python values: floats by repr, empty cells, CRLF."""
from __future__ import annotations

import csv
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsched import csvtext
from kvsched.csvtext import csv_lines as csv_blocks


@pytest.fixture(autouse=True, params=["compiled", "python"])
def layout(request, monkeypatch):
    """Every test twice: the lines laid out by the compiled leaf (`kvsched._csv.csv_block`) and
    by the pure-Python fallback (each value's repr or str)."""
    if request.param == "python":
        monkeypatch.setattr(csvtext, "_compiled", lambda: None)
    elif csvtext._compiled() is None:
        pytest.skip("kvsched._csv is not built here")
    return request.param


def csv_lines(columns) -> bytes:
    return b"".join(csv_blocks(columns))


def _reference(columns) -> bytes:
    """csv.writer over the columns' Python values, '' where a mask says absent."""
    cells = []
    for values, present in columns:
        v = values.tolist()
        cells.append(v if present is None else [x if ok else "" for x, ok in zip(v, present.tolist())])
    text = io.StringIO(newline="")
    csv.writer(text).writerows(zip(*cells))
    return text.getvalue().encode()


def _floats(rng, n: int) -> np.ndarray:
    """Floats of every kind repr treats differently: long and short decimals, halfway cases,
    neighbours of powers of two and ten, exponents, zero, negatives, non-finite values."""
    kind = rng.integers(0, 9)
    if kind == 0:
        return rng.integers(0x3F1A36E2EB1C432D, 0x4341C37937E08000, n, dtype=np.int64).view(np.float64)
    if kind == 1:
        return np.cumsum(rng.exponential(rng.choice([1e-3, 0.02, 1.0]), n))
    if kind == 2:
        t = np.cumsum(rng.exponential(0.02, n + 1))
        return t[1:] - t[:-1]
    if kind in (3, 4):          # decimals of 1..17 digits; with 4, 17 digits ending in 5 (halfway for 16)
        digits = int(rng.integers(1, 18)) if kind == 3 else 17
        m = rng.integers(10 ** (digits - 1), 10 ** digits, n, dtype=np.int64)
        m = m if kind == 3 else m - m % 10 + 5
        e = rng.integers(-6 - digits, 18 - digits, n)
        x = np.array([float(f"{a}e{b}") for a, b in zip(m.tolist(), e.tolist())])
        return np.nextafter(x, np.where(rng.random(n) < 0.5, 0, np.inf)) if rng.random() < 0.5 else x
    if kind == 5:
        x = np.ldexp(1.0, rng.integers(-20, 60, n))
        return np.where(rng.random(n) < 0.5, x, np.nextafter(x, np.where(rng.random(n) < 0.5, 0, np.inf)))
    if kind == 6:
        x = 10.0 ** rng.integers(-6, 18, n)
        return np.where(rng.random(n) < 0.4, x, np.nextafter(x, np.where(rng.random(n) < 0.5, 0, np.inf)))
    if kind == 7:
        return rng.integers(0, 10 ** 16, n).astype(np.float64) * rng.choice([1, -1, 0.5, 0.25], n)
    return rng.integers(0, 2 ** 63 - 2 ** 53, n, dtype=np.int64).view(np.float64) * rng.choice([1, -1], n)


def _column(rng, n: int):
    r = rng.random()
    if r < 0.6:
        values = _floats(rng, n)
        values[rng.random(n) < 0.02] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, 1e16, 1e-4])
    elif r < 0.9:
        top = 10 ** int(rng.integers(1, 19))
        values = rng.integers(-top if rng.random() < 0.3 else 0, top, n)
    else:
        values = rng.choice(["finished", "unfinished", "rejected", ""], n)
    present = rng.random(n) < 0.8 if rng.random() < 0.4 else None
    return values, present


@pytest.mark.parametrize("seed", range(6))
def test_csv_lines_are_what_csv_writer_writes(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        n = int(rng.integers(1, 3000))
        columns = [_column(rng, n) for _ in range(int(rng.integers(2, 6)))]
        with np.errstate(invalid="ignore", over="ignore"):
            assert csv_lines(columns) == _reference(columns)


def test_many_floats_are_their_repr():
    rng = np.random.default_rng(7)
    for _ in range(40):
        x = _floats(rng, 5000)
        with np.errstate(invalid="ignore", over="ignore"):
            assert csv_lines([(x, None), (x, None)]) == _reference([(x, None), (x, None)])


def test_other_dtypes_and_edges():
    cols = [(np.array([1.5, 2.25], np.float32), None), (np.array([7, 2 ** 64 - 1], np.uint64), None),
            (np.array([np.nan, 0.1]), np.array([False, True])), (np.array(["", "x"]), None)]
    assert csv_lines(cols) == _reference(cols) == b"1.5,7,,\r\n2.25,18446744073709551615,0.1,x\r\n"
    assert csv_lines([(np.array([]), None), (np.array([], np.int64), None)]) == b""
    assert csv_lines([(np.arange(5), None), (np.arange(5.0), None)]) == b"".join(
        b"%d,%d.0\r\n" % (k, k) for k in range(5))


def test_ints_at_the_edges_of_64_bits():
    edges = [-2 ** 63, -2 ** 63 + 1, -10 ** 18, -1, 0, 9, 10, 99, 100, 10 ** 18 - 1, 10 ** 18, 2 ** 63 - 1]
    cols = [(np.array(edges, np.int64), None),
            (np.array(edges[4:] + [10 ** 19 - 1, 10 ** 19, 2 ** 63, 2 ** 64 - 1], np.uint64), None)]
    assert csv_lines(cols) == _reference(cols)


@settings(max_examples=300, deadline=None)
@given(xs=st.lists(st.one_of(st.floats(), st.floats(1e-4, 1e16), st.floats(1e-4, 1e5)), min_size=1, max_size=40))
def test_any_float_is_its_repr(xs):
    x = np.array(xs)
    with np.errstate(invalid="ignore", over="ignore"):
        assert csv_lines([(x, None), (-x, x == x)]) == _reference([(x, None), (-x, x == x)])


@pytest.mark.parametrize("word", ["a,b", 'say "x"', "two\nlines", "cr\r", "caf\u00e9", "a\x00b"])
def test_words_csv_would_quote_are_refused(word):
    with pytest.raises(ValueError, match="not a plain word"):
        csv_lines([(np.array([word, "ok"]), None), (np.arange(2), None)])


def test_one_column_is_refused():          # csv.writer writes a lone empty cell as ""
    with pytest.raises(ValueError):
        csv_lines([(np.arange(3), None)])


def _fast_leaf():
    fast = csvtext._compiled()
    if fast is None or not csvtext._extended_works():
        pytest.skip("no compiled leaf or no 80-bit long doubles here: every float is Python's repr")
    return fast


def test_the_compiled_digits_are_repr_s_for_nearly_every_float_of_a_run(layout):
    """Times and durations get their digits in C, not from Python's repr, one in a hundred or
    so excepted (they would still be right, but slow), and those digits are repr's."""
    if layout != "compiled":
        pytest.skip("the compiled leaf's own digits")
    fast = _fast_leaf()
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.exponential(0.02, 20_000))
    for x in (t, np.diff(t), t * 7.3, rng.exponential(0.03, 20_000)):
        mine = [fast.shortest_digits(v) for v in x.tolist()]
        assert sum(m is not None for m in mine) > 0.97 * len(x)
        for m, v in zip(mine, x.tolist()):
            if m is not None:
                digits, nd, e10 = m
                mantissa, _, exp = f"{v:.{nd - 1}e}".partition("e")
                assert (int(mantissa.replace(".", "")), int(exp)) == (digits, e10) and float(repr(v)) == v
                assert len(repr(v).replace(".", "").lstrip("0").rstrip("0") or "0") <= nd


def test_without_extended_precision_every_float_is_repr(monkeypatch, layout):
    monkeypatch.setattr(csvtext, "_EXTENDED", False)
    assert not csvtext._extended_works()
    x = np.cumsum(np.random.default_rng(4).exponential(0.02, 3000))
    assert csv_lines([(x, None), (x, None)]) == _reference([(x, None), (x, None)])


# ---- per-batch rows from RowLog and MergedRows -------------------------------------------

def _written(tmp_path, rows, name="rows.csv") -> bytes:
    from kvsched.run import _write_rows
    _write_rows(tmp_path / name, ["time", "a", "b"], rows)
    return (tmp_path / name).read_bytes()


def _csv_of(rows) -> bytes:
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(["time", "a", "b"])
    w.writerows(rows)
    return text.getvalue().encode()


def _log(rows, checks=7):
    from kvsched.sim.rowlog import RowLog
    log = RowLog("fii")
    for k, row in enumerate(rows):
        log.append(row)
        if k % checks == 0:
            log.check()
    return log


def test_row_log_blocks_are_its_rows(tmp_path, monkeypatch):
    from kvsched.sim.rowlog import row_blocks
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 100)
    rows = [(k * 0.1 + 1e-9, k, 2 ** 40 - k) for k in range(1050)]
    log = _log(rows)
    assert log._spilled and len(log) > log._spilled and row_blocks(log) is not None
    assert _written(tmp_path, log) == _csv_of(rows)
    assert _written(tmp_path, _log([])) == _csv_of([])


def test_rows_the_blocks_cannot_hold_go_row_by_row(tmp_path, monkeypatch):
    """An int in a float column among the rows in memory reads back as an int (a spilled one
    as a float), and a plain list is not a RowLog: csv.writer writes those."""
    from kvsched.sim.rowlog import row_blocks
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 100)
    rows = [(k * 0.5, k, k) for k in range(150)] + [(3, 1, 1), (2.5, True, 1)]
    log = _log(rows)
    assert row_blocks(log) is None and row_blocks(rows) is None
    assert _written(tmp_path, log) == _csv_of(list(log)) == _csv_of(rows[:100] + rows[100:])
    assert _written(tmp_path, rows) == _csv_of(rows)


def test_merged_rows_blocks_are_heapq_merges_order(tmp_path, monkeypatch):
    from kvsched.sim.rowlog import row_blocks
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 64)
    rng = np.random.default_rng(5)
    logs = []
    for k in (2, 0, 1):         # replicas out of order, times tied within and across replicas
        t = np.sort(rng.integers(0, 300, int(rng.integers(0, 700))) * 0.25)
        logs.append((k, _log([(float(x), k, j) for j, x in enumerate(t.tolist())], checks=int(rng.integers(1, 90)))))
    merged = rowlog.MergedRows(logs)
    assert row_blocks(merged) is not None
    assert _written(tmp_path, merged) == _csv_of(list(merged))


def test_merged_rows_out_of_time_order_go_row_by_row(tmp_path, monkeypatch):
    from kvsched.sim.rowlog import row_blocks
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 64)
    late = _log([(float(x), 0, 0) for x in [5, 1, 2] * 50])
    merged = rowlog.MergedRows([(0, late), (1, _log([(float(x), 1, 1) for x in range(100)]))])
    assert row_blocks(merged) is None
    assert _written(tmp_path, merged) == _csv_of(list(merged))
    same_number = rowlog.MergedRows([(0, _log([(1.0, 0, 0)])), (0, _log([(1.0, 0, 1)]))])
    assert row_blocks(same_number) is None
    assert _written(tmp_path, same_number) == _csv_of(list(same_number))


# ---- a run's files ---------------------------------------------------------------------------

def _old_request_rows(r) -> list:
    """requests.csv's rows as the csv-module writer built them (the reference)."""
    def where(ok, values):
        return [v if o else "" for v, o in zip(values.tolist(), ok.tolist())]
    done, first_ok = np.isfinite(r.finished), np.isfinite(r.first_token)
    with np.errstate(invalid="ignore"):
        ttft, e2el, itl_sum = r.first_token - r.arrival, r.finished - r.arrival, r.finished - r.first_token
    status = np.where(r.rejected, "rejected", np.where(done, "finished", "unfinished")).tolist()
    replica = r.replica.tolist() if r.replica is not None else np.where(r.rejected, -1, 0).tolist()
    cols = [r.ids.astype(np.int64).tolist(), r.arrival.tolist(), r.prompt.astype(np.int64).tolist(),
            r.output.astype(np.int64).tolist(), status, where(np.isfinite(r.admitted), r.admitted),
            where(first_ok, r.first_token), where(done, r.finished), where(first_ok, ttft), where(done, e2el),
            r.preemptions.astype(np.int64).tolist(), r.recomputed.astype(np.int64).tolist(),
            where(done, r.output.astype(np.int64) - 1), where(done, r.itl_max), where(done, itl_sum),
            r.tbt_violations.astype(np.int64).tolist(), replica]
    if r.decode_replica is not None:
        dr = r.decode_replica.astype(np.int64)
        cols += [where(dr >= 0, dr), where(np.isfinite(r.transfer), r.transfer.astype(np.float64))]
    return list(zip(*cols))


@pytest.mark.filterwarnings("ignore:.*can never be served")
@pytest.mark.parametrize("pools", [{}, {"replicas": 3, "router": "least-kv"},
                                   {"prefill_replicas": 1, "decode_replicas": 2}])
def test_run_files_are_what_csv_writer_writes(tmp_path, monkeypatch, pools):
    """Spilled row logs, clusters, disaggregated pools, rejected requests (empty cells)."""
    import kvsched.run as run_module
    from kvsched.run import Scenario, simulate
    from kvsched.sim import rowlog
    from kvsched.workload.source import WorkloadOptions, load
    monkeypatch.setattr(rowlog, "CHUNK", 500)
    monkeypatch.setattr(run_module, "ROWS_PER_WRITE", 333)
    r = simulate(Scenario(load(WorkloadOptions(num_requests=1500, rate=40, seed=3)), kv_capacity=20000,
                          max_model_len=1300, **pools),
                 "vllm-v1", record_timeline=True, record_batches=True)
    r.write(tmp_path / "out")
    from kvsched.sim.rowlog import row_blocks
    assert row_blocks(r.timeline) is not None and row_blocks(r.batches) is not None    # the fast path
    rows = _old_request_rows(r.records)
    assert r.records.rejected.any() and any(v == "" for row in rows for v in row)
    for name, got in (("requests.csv", rows), ("timeline.csv", list(r.timeline)), ("batches.csv", list(r.batches))):
        text = io.StringIO(newline="")
        w = csv.writer(text)
        w.writerow((tmp_path / "out" / name).read_bytes().decode().split("\r\n", 1)[0].split(","))
        w.writerows(got)
        assert (tmp_path / "out" / name).read_bytes() == text.getvalue().encode(), name


# ----- found by the independent review -----------------------------------------------------
def test_a_spill_after_the_blocks_are_taken_repeats_no_row():
    from kvsched.sim.rowlog import CHUNK, RowLog, row_blocks
    log = RowLog("fi")
    for i in range(CHUNK + 3):
        log.append((i + 0.5, i))
    blocks = row_blocks(log)
    rows = iter(log)
    len(log)                                    # spills the first chunk
    assert sum(len(columns[0][0]) for columns in blocks) == CHUNK + 3
    assert len(list(rows)) == CHUNK + 3


def test_replica_numbers_that_are_not_ints_go_row_by_row():
    from kvsched.sim.rowlog import MergedRows, RowLog, row_blocks
    a, b = RowLog("fi"), RowLog("fi")
    a.append((0.5, 1))
    b.append((0.25, 2))
    assert row_blocks(MergedRows([(True, a), (2, b)])) is None
    assert row_blocks(MergedRows([(1, a), (2, b)])) is not None


def test_an_int_mask_is_a_mask_and_long_doubles_are_refused():
    x = np.array([0.1234567890123456, 0.2234567890123457, 0.3234567890123457])
    cols = [(x, np.array([1, 0, 1])), (np.array([1, 2, 3]), None)]
    assert csv_lines(cols) == _reference([(x, np.array([True, False, True])), cols[1]])
    with pytest.raises(TypeError):
        csv_lines([(x.astype(np.longdouble), None), (np.array([1, 2, 3]), None)])


# ---- the row log's chunk: rows written into it, rows kept as given ----------------------------

_VALUE = st.one_of(st.floats(allow_nan=False), st.integers(-2 ** 70, 2 ** 70), st.booleans())


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.one_of(st.tuples(st.floats(allow_nan=False), st.integers(-2 ** 62, 2 ** 62)),
                               st.tuples(_VALUE, _VALUE)),
                     max_size=60),
       checks=st.sets(st.integers(0, 60)))
def test_row_log_gives_back_each_row(rows, checks, monkeypatch):
    """Every row comes back: as given while in memory, as numpy's conversion once spilled (an
    int in a float column then reads as a float); written rows are never lost or reordered,
    whatever the mix of rows the chunk holds and rows kept as given, and the spill points."""
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 7)
    log = rowlog.RowLog("fi")
    convertible = []
    for k, row in enumerate(rows):
        try:
            np.array([row], dtype=log.dtype)
        except (OverflowError, ValueError, TypeError):
            break                                   # numpy could not spill it: not a row the engine makes
        log.append(row)
        convertible.append(row)
        if k in checks:
            log.check()
    assert len(log) == len(convertible)
    spilled = log._spilled
    assert spilled % 7 == 0 and spilled <= len(convertible)
    want = [np.array([row], dtype=log.dtype).tolist()[0] if k < spilled else row
            for k, row in enumerate(convertible)]
    got = list(log)
    typed = lambda rs: [[(type(v), v) for v in r] for r in rs]      # noqa: E731 (3 and 3.0 differ here)
    assert typed(got) == typed(want)
    assert typed([log[k] for k in range(len(log))]) == typed(want)


def test_row_log_pickles_and_copies_as_its_rows(monkeypatch):
    """A run's result pickles (joblib, multiprocessing) and copies: a log is rebuilt from its
    layout and rows as they read, with its own chunk and file."""
    import copy
    import pickle
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 4)
    log = rowlog.RowLog("fi")
    rows = [(k + 0.5, k) for k in range(9)] + [(3, 1), (2.5, 2)]
    for row in rows:
        log.append(row)
    typed = lambda rs: [[(type(v), v) for v in r] for r in rs]      # noqa: E731
    for other in (pickle.loads(pickle.dumps(log)), copy.deepcopy(log), copy.copy(log)):
        assert typed(other) == typed(log) and len(other) == len(log) == 11
        other.append((99.5, 99))
        assert len(log) == 11 and list(log)[-1] == (2.5, 2) and list(other)[-1] == (99.5, 99)


def test_a_row_that_is_not_a_tuple_or_list_spills_as_numpy_converts_it(monkeypatch):
    """Either build: a scalar, a dict or a set row is not packed by the typed pass (numpy
    converts the chunk, as it always did); a list row is, as a tuple would be."""
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 2)
    log = rowlog.RowLog("fi")
    log.append((1, 2))
    log.append(5)
    assert len(log) == 2 and list(log) == np.array([(1, 2), 5], dtype=log.dtype).tolist()
    for odd in ({0: 1.5, 1: 2}, {1.5, 2}, 5):
        assert rowlog.exact_chunk([(0.5, 1), odd], log.dtype) is None
    assert rowlog.exact_chunk([[0.5, 1]], log.dtype).tolist() == [(0.5, 1)]


def test_a_pickled_log_keeps_its_chunk_size(monkeypatch):
    import pickle
    from kvsched.sim import rowlog
    log = rowlog.RowLog("fi")
    for row in [(0.5, 1), (3, 2)]:               # an int in the float column: kept as given
        log.append(row)
    monkeypatch.setattr(rowlog, "CHUNK", 1)
    again = pickle.loads(pickle.dumps(log))
    assert list(again) == list(log) and type(list(again)[1][0]) is int and again._cap == log._cap
