# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled twins of the replica's hottest pure-Python code (issue "Speed"), chosen in
kvsched/sim/replica.py. Each gives the results of its Python original bit for bit: the same
float operations in the same order (built with -ffp-contract=off, so no fused multiply-add),
the same calls back into Python for everything else. The Python originals stay the fallback
(no C compiler, KVSCHED_PURE_PYTHON=1, or a mirrored file edited since the build:
kvsched/sim/compiled.py) and the reference the tests compare with.
"""
from cpython.buffer cimport (PyBUF_ANY_CONTIGUOUS, PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyBuffer_Release,
                             PyObject_GetBuffer)
from libc.math cimport fabs, log
from libc.string cimport memcpy, memmove, memset, strlen

from heapq import heappop, heappush

from kvsched.errors import KvschedError
from kvsched.sim.prefix_cache import Run
from kvsched.sim.requests import DECODE, DONE, PREFILL
from kvsched.sim.rowlog import BATCHES, CHUNK, TIMELINE, layout

cdef double INF = float("inf")
cdef long long NEVER = 1 << 62          # Replica._plain_decodes' "no finish ahead"

# 'path=sha256;...' of the .pyx and every Python file it mirrors, as built (setup.py passes it;
# kvsched/sim/compiled.py compares it with the installed files before using this module)
cdef extern from *:
    """
    #ifndef KVSCHED_SOURCES
    #define KVSCHED_SOURCES ""
    #endif
    """
    const char* KVSCHED_SOURCES
SOURCES = (<bytes>KVSCHED_SOURCES).decode()
# Replica takes these twins only where every count fits its 64-bit integers: KV capacity in
# tokens below this (KV held, context sums, window positions and clocks are all bounded by it)
cdef long long LIMIT = 1 << 62
TOKEN_LIMIT = LIMIT


cdef inline long long _mod(long long a, long long b):
    """a % b with Python's sign (C's % keeps the dividend's); b > 0."""
    cdef long long r = a % b
    return r + b if r < 0 else r


cdef inline long long _residue_index(long long clock, long long bs):
    """-clock % bs, as Python computes it."""
    return _mod(-clock, bs)


cdef inline long long _blocks(long long tokens, long long bs):
    """-(-tokens // bs), as Python computes it (a ceiling for any sign)."""
    return -((-tokens - _mod(-tokens, bs)) // bs)


cdef inline long long _bin(double gap, double low, double log_low, double scale, long long top):
    """GapHistogram.add's bin of `gap` (kvsched/metrics.py), its operations in its order."""
    cdef long long b
    if gap > low:
        b = <long long>((log(gap) - log_low) * scale) + 1
        return top if b >= top else b
    return 0


cdef class _Sink:
    """Rows of a RowLog written straight into its `writable` array (8-byte cells): what
    `log.append(row)` keeps, without a tuple per row. The rows Python appended since the last
    write are moved in first, where each comes back from the array as the same values (else
    they become a block of their own, `seal_rows`). `close` hands the count back."""
    cdef object log
    cdef bytes kinds
    cdef Py_buffer buf
    cdef bint held
    cdef Py_ssize_t fill, cap
    cdef char* base

    def __cinit__(self, log, bytes kinds):
        self.log = log
        self.kinds = kinds
        self.held = False
        self._open()
        self._absorb()

    cdef int _open(self) except -1:
        array = self.log.writable()
        PyObject_GetBuffer(array, &self.buf, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS)
        if self.buf.ndim != 1 or self.buf.itemsize != 8 * len(self.kinds):
            PyBuffer_Release(&self.buf)
            raise TypeError("a row log's array must be 1-d with 8-byte cells")
        self.held = True
        self.base = <char*>self.buf.buf
        self.fill = self.log._fill
        self.cap = len(array)
        return 0

    cdef int _absorb(self) except -1:
        cdef list rows = self.log._rows
        if not rows:
            return 0
        if not _exact_rows(rows, self.kinds):
            self.close()
            self.log.seal_rows()
            self._open()
            return 0
        for row in rows:
            self.put(row)
        rows.clear()
        return 0

    cdef int put(self, tuple row) except -1:
        """A row of Python numbers, as `log.append(row)` would keep it."""
        cdef long long* cell = self.row()
        cdef const char* kinds = self.kinds
        cdef Py_ssize_t j
        for j in range(len(self.kinds)):
            if kinds[j] == 102:                 # 'f'
                (<double*>cell)[j] = <double>row[j]
            else:
                cell[j] = <long long>row[j]
        return 0

    cdef long long* row(self) except NULL:
        """The next row's 8-byte cells (float columns are written through a double*)."""
        cdef char* r
        if self.fill == self.cap:
            self.close()
            self._open()
        r = self.base + self.fill * self.buf.itemsize
        self.fill += 1
        return <long long*>r

    cdef void close(self):
        if self.held:
            self.held = False
            self.log._fill = self.fill
            PyBuffer_Release(&self.buf)


cdef bint _exact_rows(list rows, bytes kinds):
    """Whether every row has the layout's length and types (float, or int within int64):
    then an array holds it and gives it back as the same Python values."""
    cdef Py_ssize_t width = len(kinds), j
    for row in rows:
        if type(row) is not tuple or len(row) != width:
            return False
        for j in range(width):
            x = row[j]
            if kinds[j] == 102:
                if type(x) is not float:
                    return False
            elif type(x) is not int or not -(1 << 63) <= x < (1 << 63):
                return False
    return True


cdef object _sink(object log, str kinds):
    """A _Sink for `log` if its layout is `kinds` (8-byte cells, no padding), else None."""
    return _Sink(log, kinds.encode()) if _sinkable(log, kinds) else None


cdef bint _sinkable(object log, str kinds):
    """Whether `log` is a row log of layout `kinds` (a RowLog's layout is set when it is made)."""
    return log is not None and log.dtype == _LAYOUTS[kinds]


_LAYOUTS = {k: layout(k) for k in (TIMELINE.kinds, BATCHES.kinds)}      # the replica's row logs


def window_max(object window) -> float:
    """float(numpy.maximum.reduce(window)) of a non-empty 1-d float64 gap window
    (`Replica._fold`), without numpy's per-call cost. Gaps are finite, so no NaN rules apply."""
    cdef Py_buffer buf
    cdef double m
    _cells(window, &buf, b"d", False)
    try:
        if not buf.len:
            raise ValueError("window_max needs a non-empty window")
        m = _max_of(<double*>buf.buf, 0, buf.len // 8)
    finally:
        PyBuffer_Release(&buf)
    return m


cdef inline double _max_of(double* p, Py_ssize_t lo, Py_ssize_t hi):
    """The largest of p[lo:hi] (hi > lo), compared as numpy's maximum does finite values: four
    running maxima side by side (independent comparisons), then theirs (the same value: a
    maximum of finite floats does not depend on the order)."""
    cdef double m0 = p[lo], m1 = p[lo], m2 = p[lo], m3 = p[lo]
    cdef Py_ssize_t k = lo + 1
    while k + 4 <= hi:
        if p[k] > m0:
            m0 = p[k]
        if p[k + 1] > m1:
            m1 = p[k + 1]
        if p[k + 2] > m2:
            m2 = p[k + 2]
        if p[k + 3] > m3:
            m3 = p[k + 3]
        k += 4
    while k < hi:
        if p[k] > m0:
            m0 = p[k]
        k += 1
    if m1 > m0:
        m0 = m1
    if m2 > m0:
        m0 = m2
    if m3 > m0:
        m0 = m3
    return m0


def roofline_terms(cost, decode_time):
    """The constants of `RooflineCost.time` and `decode_time` when `decode_time` is exactly that
    method of a dense RooflineCost (not a subclass) whose `time` is the class's too, both as
    kvsched/cost/roofline.py defines them (`COMPILED_TWINS`: not patched since), and whose
    terms convert to C without changing a bit, else None: then the compiled decode run and
    `batch_time` are not used. Read when a replica is built (as the Python code binds
    `decode_time` then): a class patched during a run is not seen."""
    from kvsched.cost.roofline import COMPILED_TWINS, RooflineCost
    time, decode = COMPILED_TWINS
    if type(cost) is not RooflineCost or getattr(decode_time, "__func__", None) is not decode \
            or getattr(decode_time, "__self__", None) is not cost \
            or getattr(cost.time, "__func__", None) is not time or cost._dense is not True:
        return None
    floats = (cost._gemm_flops, cost._attn_flops, cost._flop_rate, cost._weights, cost._byte_rate, cost.overhead)
    if any(type(x) is not float for x in floats) or type(cost._kv_bytes) not in (int, float):
        return None
    if type(cost._kv_bytes) is int and not 0 <= cost._kv_bytes < TOKEN_LIMIT:
        return None
    return floats + (cost._kv_bytes,)


cdef inline double _roofline(double gemm, double attn, double flop_rate, double weights, double byte_rate,
                             double overhead, double tokens, double pairs, double kvpart):
    """RooflineCost.time's last lines (kvsched/cost/roofline.py), its operations in its order:
    flops, then compute and memory time, then their maximum written as (a + b + |a - b|) / 2."""
    cdef double compute = (gemm * tokens + attn * pairs) / flop_rate
    cdef double memory = (weights + 0.0 + kvpart) / byte_rate     # weights + 0 * tokens + kv
    return overhead + (compute + memory + fabs(compute - memory)) / 2


def batch_time(tuple roof, object pt, object pattn, object pctx, object nd, object dctx):
    """`RooflineCost.time(BatchShape(pt, _, pattn, pctx, nd, dctx, _, _))` of the dense roofline
    whose `roofline_terms` are `roof`, bit for bit: Python's int sums are exact in 64 bits
    (the replica takes this twin only below TOKEN_LIMIT tokens), its int-to-float
    conversions round as C's. None where a count is not a Python int in [0, LIMIT) (numpy's
    would give numpy results in the Python code), `pattn` is neither that nor a float, or
    `kv_bytes * (pctx + dctx)` would pass 64 bits: then the caller asks the cost model."""
    cdef double dt
    if not (_count(pt) and _count(nd) and _count(pctx) and _count(dctx)):
        return None
    if type(pattn) is float:
        dt = _batch_time(roof, pt, True, pattn, 0, pctx, nd, dctx)
    elif _count(pattn):
        dt = _batch_time(roof, pt, False, 0.0, pattn, pctx, nd, dctx)
    else:
        return None
    return None if dt < 0 else dt


cdef double _batch_time(tuple roof, long long pt, bint float_pairs, double pattn_f, long long pattn_i,
                        long long pctx, long long nd, long long dctx) except? -2:
    """batch_time's arithmetic on counts in [0, LIMIT) and `pattn` as the float `pattn_f`
    (`float_pairs`) or the int `pattn_i`; -1 where kv_bytes * context would pass 64 bits."""
    cdef double gemm = roof[0], attn = roof[1], flop_rate = roof[2], weights = roof[3]
    cdef double byte_rate = roof[4], overhead = roof[5]
    cdef double pairs, kvpart
    cdef long long ctx = pctx + dctx
    kv_bytes = roof[6]
    if float_pairs:
        pairs = pattn_f + <double>dctx          # float + int: the int converted first
    else:
        pairs = <double>(pattn_i + dctx)
    if type(kv_bytes) is float:
        kvpart = <double>kv_bytes * <double>ctx
    elif not kv_bytes or ctx < LIMIT // <long long>kv_bytes:
        kvpart = <double>(<long long>kv_bytes * ctx)
    else:
        return -1
    return _roofline(gemm, attn, flop_rate, weights, byte_rate, overhead, <double>(pt + nd), pairs, kvpart)


cdef inline bint _count(object x):
    """A Python int in [0, LIMIT): a count C holds and sums exactly."""
    return type(x) is int and 0 <= x < LIMIT


cdef class Tables:
    """A replica's containers the twins read and write, taken once: the request table's
    per-request lists and arrays (the arrays `itl_max`, `finished`, `viol` held as buffers)
    and the replica's own dicts and lists. Neither replaces any of them in its life
    (kvsched/sim/requests.py, replica.py), so a call need not look them up again."""
    cdef object reqs, decoders, kv, cache, recent, queue, itl, times, timeline, batches
    cdef list counts
    cdef double log_low, scale, low
    cdef long long top
    cdef bint sink_timeline, sink_batches, shared
    cdef dict keyed
    cdef dict where, running, order, prefilling
    cdef set fresh
    cdef list finishing, status, gen, last_tok, output, prompt, computed, tbt, target
    cdef Py_buffer mb, fb, vb, ab, sb
    cdef double* itl_max
    cdef double* finished
    cdef long long* viol
    cdef double* admitted
    cdef double* first
    cdef long long bs

    def __cinit__(self, replica):
        _untaken(&self.mb)
        _untaken(&self.fb)
        _untaken(&self.vb)
        _untaken(&self.ab)
        _untaken(&self.sb)
        r = self.reqs = replica.reqs
        _cells(r.itl_max, &self.mb, b'd', True)
        _cells(r.finished, &self.fb, b'd', True)
        _cells(r.viol, &self.vb, b'q', True)
        _cells(r.admitted, &self.ab, b'd', True)
        _cells(r.first, &self.sb, b'd', True)
        self.itl_max, self.finished, self.viol = <double*>self.mb.buf, <double*>self.fb.buf, <long long*>self.vb.buf
        self.admitted, self.first = <double*>self.ab.buf, <double*>self.sb.buf
        self.status, self.gen, self.last_tok, self.output = r.status, r.gen, r.last_tok, r.output
        self.prompt, self.computed, self.tbt, self.target = r.prompt, r.computed, r.tbt, r.target
        self.decoders, self.kv, self.cache = replica._decoders, replica.kv, replica.cache
        self.where, self.running, self.order = replica._decoders.where, replica._running, replica._order
        self.finishing, self.recent = replica._finishing, replica.recent_finished.append
        self.queue, self.prefilling, self.fresh = replica._queue, replica._prefilling, replica._fresh
        self.bs = replica.block_size
        itl = self.itl = replica.itl            # its bins' constants are set once (kvsched/metrics.py)
        self.counts, self.log_low, self.scale, self.low, self.top = itl.counts, itl._log_low, itl._scale, itl.low, itl._top
        self.times = replica.recent_batch_times.append
        self.timeline, self.batches = replica.timeline, replica.batches
        self.sink_timeline = _sinkable(self.timeline, TIMELINE.kinds)
        self.sink_batches = _sinkable(self.batches, BATCHES.kinds)
        if self.cache is not None:              # PrefixCache.inert's terms: its map, and whether
            self.keyed, self.shared = self.cache.map, self.cache._shared    # requests share (both fixed)

    def __dealloc__(self):
        PyBuffer_Release(&self.mb)
        PyBuffer_Release(&self.fb)
        PyBuffer_Release(&self.vb)
        PyBuffer_Release(&self.ab)
        PyBuffer_Release(&self.sb)


def finish_due(object self, object c, double t, Tables tables not None):
    """`for i in c.due(): self._finish(i, t, self._leave_decode(i))` compiled, with Cohort.due,
    DecodeSet.leave, Cohort.leave, Replica._fold and Replica._finish inline, for a replica
    without tiers (so every TBT SLO is infinite: no gap counts as a violation) and without
    finish hooks (`on_finish`, `on_done`). Counters are updated once for the batch's
    finishes (the same sums). True; False, having done nothing, where a number is not a
    Python float or int (numpy's would stay numpy's in the Python code). Keep in step with
    those: the tests run both."""
    return _finish_due(self, c, t, tables) == 1


cdef int _finish_due(object self, object c, double t, Tables tb) except -1:
    """finish_due's work: 1 done, 0 declined (nothing done)."""
    if not (type(c.clock) is int and type(c.ctx) is int and type(c.n) is int
            and type(tb.kv.used) is int and type(self.outstanding) is int):
        return 0
    cdef list heap = c._heap
    cdef dict finish = c._finish, members = c.members, fresh = c.fresh
    cdef long long clock = c.clock
    cdef list due = []
    while heap and <long long>heap[0][0] <= clock:
        f, i = heappop(heap)
        if finish.get(i) == f:
            del finish[i]
            due.append(i)
    if not due:
        return 1
    for i in due:
        state = members[i]
        if type(state[0]) is not int or type(state[1]) is not int:
            for i in due:                   # the Python code, on the due list it would have made
                self._finish(i, t, self._leave_decode(i))
            return 1
    ds = tb.decoders
    cdef dict where = tb.where, running = tb.running
    r = tb.reqs
    cdef list status = tb.status, gen = tb.gen, last_tok = tb.last_tok, output = tb.output, prompt = tb.prompt
    cdef list computed = tb.computed, residue = c.residue
    cdef long long bs = c.block_size, base = c._base, lo, hi, c0, k0, steps, kvt
    cdef long long k = 0, ctx_sum = 0, blocks_sum = 0
    cdef bint plain_kv = tb.cache is None
    cdef Py_ssize_t glen
    cdef double m
    cdef double* gp
    cdef double* itl_max = tb.itl_max
    cdef double* finished = tb.finished
    cdef Py_buffer gb
    cdef list finishing = tb.finishing
    recent = tb.recent
    gaps = c._gaps
    glen = len(gaps)
    _cells(gaps, &gb, b'd', False)
    try:
        gp = <double*>gb.buf
        for i in due:
            if where.pop(i) is not c:
                raise RuntimeError(f"request {i} finished in a cohort it is not in")
            c0, k0, _, _ = members.pop(i)          # Cohort.leave
            steps = clock - c0
            kvt = k0 + steps
            k += 1
            ctx_sum += kvt
            residue[_mod(k0 - c0, bs)] -= 1
            if steps == 0:
                del fresh[i]
            lo, hi = c0 + 2 - base, clock + 1 - base    # its gap window (Replica._fold)
            if lo < 0 or hi > glen:
                raise RuntimeError(f"request {i}'s gap window [{lo}, {hi}) is outside the buffer")
            if hi > lo:
                m = _max_of(gp, lo, hi)
                if m > itl_max[i]:
                    itl_max[i] = m
            status[i] = DONE                        # Replica._finish
            finished[i] = t
            del running[i]
            if plain_kv:
                blocks_sum += _blocks(kvt, bs)
            else:
                finishing.append((i, kvt))
            recent((prompt[i], output[i]))
            gen[i] = output[i]
            computed[i] = 0
            last_tok[i] = 0.0
    finally:
        PyBuffer_Release(&gb)
        if k:                                   # the counters, for the finishes done
            ds.n -= k
            c.n -= k
            c.ctx -= ctx_sum
            r.done += k
            r.in_flight -= k
            self.outstanding -= k
            if plain_kv:
                tb.kv.used -= blocks_sum
    return 1


def plain_decodes(object self, object c, double until, tuple roof, Tables tables not None):
    """`Replica._plain_decodes(c, until)` compiled, for a replica whose decode time is a dense
    roofline's (`roof` = `roofline_terms`); True. False, having done nothing, where the state
    holds other types than the Python code would keep (numpy scalars: a C run would turn them
    into Python ones) or numbers past its 64-bit integers. Keep the two in step: the tests
    run both."""
    kv, itl = tables.kv, tables.itl
    now_o, last_o, n_o, clock_o, ctx_o, used_o = self.now, c.last_time, c.n, c.clock, c.ctx, kv.used
    total_o, sq_o, max_o, hn_o = itl.total, itl.total_sq, itl.max, itl.n
    kvi_o, busy_o, peak_o, k_o = self.kv_integral, self.busy, self.peak_kv, self.iterations
    if not (type(now_o) is float and type(last_o) is float and type(ctx_o) is int and type(clock_o) is int
            and type(n_o) is int and type(used_o) is int and type(total_o) is float and type(sq_o) is float
            and type(max_o) is float and type(hn_o) is int and type(kvi_o) is float and type(busy_o) is float
            and type(peak_o) is int and type(k_o) is int) or ctx_o >= TOKEN_LIMIT:
        return False
    cdef double gemm = roof[0], attn = roof[1], flop_rate = roof[2], weights = roof[3]
    cdef double byte_rate = roof[4], overhead = roof[5]
    kv_bytes = roof[6]
    cdef bint kv_int = type(kv_bytes) is int
    cdef long long kvb = kv_bytes if kv_int else 0
    cdef double kvb_f = 0.0 if kv_int else kv_bytes
    cdef long long kv_limit = TOKEN_LIMIT // kvb if kv_int and kvb else TOKEN_LIMIT   # kvb * ctx exact below it
    cdef long long bs = tables.bs
    cdef long long cap = kv.capacity_blocks
    cdef list residue = c.residue
    fresh = c.fresh
    cdef list heap = c._heap
    cdef long long n = n_o, clock = clock_o, ctx = ctx_o, used = used_o
    cdef long long f = heap[0][0] if heap else NEVER
    last_kind = self._last_kind
    cdef bint switch = last_kind != 2 and last_kind != 0
    cdef double now = now_o, last = last_o
    cdef list counts = tables.counts
    cdef double log_low = tables.log_low, scale = tables.scale, low = tables.low
    cdef long long top = tables.top
    cdef double total = total_o, total_sq = sq_o, gmax = max_o
    cdef long long hn = hn_o
    cdef double kv_integral = kvi_o, busy = busy_o
    cdef long long peak = peak_o, k = k_o
    cdef long long k0 = k
    recent = tables.times
    timeline = tables.timeline.append if tables.timeline is not None else None
    batches = tables.batches.append if tables.batches is not None else None
    cdef _Sink tsink = None, bsink = None
    cdef long long* cell
    cdef long long running = len(tables.running)
    cdef long long base = c._base
    gaps = c._gaps
    cdef long long glen = len(gaps)
    cdef long long allocated = 0
    cdef bint track = self.track_start
    cdef bint hooks = self._on_finish is not None or self._on_done is not None
    cdef long long nf = len(fresh)
    cdef long long dnew = residue[_residue_index(clock, bs)]
    cdef long long held, nb, m
    cdef double dt, start, gap
    cdef Py_buffer gb
    cdef double* gp
    _cells(gaps, &gb, b'd', True)
    try:
        if tables.sink_timeline:
            tsink = _Sink(tables.timeline, TIMELINE.kinds.encode())
        if tables.sink_batches:
            bsink = _Sink(tables.batches, BATCHES.kinds.encode())
        while True:
            held = used + dnew
            nb = n
            if track:
                self._snap = (self.outstanding, held, self.prefill_backlog)
            if ctx + n < kv_limit:
                dt = _roofline(gemm, attn, flop_rate, weights, byte_rate, overhead, <double>n, <double>(ctx + n),
                               <double>(kvb * (ctx + n)) if kv_int else kvb_f * <double>(ctx + n))
            else:                               # kv_bytes * context past 64 bits: Python's exact ints
                dt = self._decode_time(n, ctx + n, switch)
            switch = False
            start = now
            now = now + dt
            if not (start < now < INF):
                self._batch_end(start, dt)
            clock += 1
            if clock - base >= glen:
                c.clock = clock
                c._trim()
                PyBuffer_Release(&gb)
                base, gaps = c._base, c._gaps
                glen = len(gaps)
                _cells(gaps, &gb, b'd', True)
            gp = <double*>gb.buf
            gap = now - last
            gp[clock - base] = gap
            last = now
            ctx += n
            if ctx >= TOKEN_LIMIT:
                raise KvschedError(f"replica {self.index}: the decoders' summed context passed 2**62 tokens, "
                                   "beyond the compiled path's 64-bit integers (KVSCHED_PURE_PYTHON=1 runs it)")
            allocated += dnew
            used = held
            m = n - nf
            if m > 0:                           # GapHistogram.add(gap, m)
                counts[_bin(gap, low, log_low, scale, top)] += m
                hn += m
                total += gap * <double>m
                total_sq += gap * gap * <double>m
                if gap > gmax:
                    gmax = gap
            if nf:
                itl.total, itl.total_sq, itl.max, itl.n = total, total_sq, gmax, hn
                if not _first_gaps(itl, fresh, now, tables):
                    self._first_gaps(c, now)
                total, total_sq, gmax, hn = itl.total, itl.total_sq, itl.max, itl.n
                nf = 0
            if clock >= f:
                _write_back(self, c, clock, ctx, now, allocated, used, tables)
                allocated = 0
                if hooks:                       # what a hook may look at: the figures so far
                    self.kv_integral, self.busy, self.peak_kv, self.iterations = kv_integral, busy, peak, k
                    self.now, self._last_kind = now, 2
                    itl.total, itl.total_sq, itl.max, itl.n = total, total_sq, gmax, hn
                if hooks or not _finish_due(self, c, now, tables):
                    for i in c.due():
                        self._finish(i, now, self._leave_decode(i))
                if tables.finishing:
                    _free_finished(self, tables)
                f = heap[0][0] if heap else NEVER
                n, ctx, used, running = c.n, c.ctx, kv.used, len(tables.running)
                if c._gaps is not gaps:
                    PyBuffer_Release(&gb)
                    gaps = c._gaps
                    _cells(gaps, &gb, b'd', True)
                base = c._base
                glen = len(gaps)
            recent(dt)
            if tsink is not None:               # timeline((now, 0, running, used * bs))
                cell = tsink.row()
                (<double*>cell)[0] = now
                cell[1] = 0
                cell[2] = running
                cell[3] = used * bs
            elif timeline is not None:
                timeline((now, 0, running, used * bs))
            if bsink is not None:               # batches((start, dt, 0, 0, nb, held * bs))
                cell = bsink.row()
                (<double*>cell)[0] = start
                (<double*>cell)[1] = dt
                cell[2] = 0
                cell[3] = 0
                cell[4] = nb
                cell[5] = held * bs
            elif batches is not None:
                batches((start, dt, 0, 0, nb, held * bs))
            kv_integral += <double>held * dt
            busy += dt
            if held > peak:
                peak = held
            k += 1
            dnew = residue[_residue_index(clock, bs)]
            if not now < until or not n or used + dnew > cap:
                break
    finally:
        PyBuffer_Release(&gb)
        if tsink is not None:
            tsink.close()
        if bsink is not None:
            bsink.close()
    _write_back(self, c, clock, ctx, now, allocated, used, tables)
    itl.total, itl.total_sq, itl.max, itl.n = total, total_sq, gmax, hn
    self._end_run(k0, k, kv_integral, busy, peak, now)
    return True


# ----- a baseline's batch, planned and run in one call ------------------------------------
VLLM_V1, SARATHI = 1, 2                 # the policies `admit_step` plans for (Replica picks)
cdef long long EXACT = 1 << 52          # token counts whose float sums below are exact


def admit_step(object self, object policy, int kind, tuple roof, Tables tables not None):
    """`self._execute(policy.schedule(self.view))` compiled, for `kind` VLLM_V1 (an exact
    VllmV1, policies/baselines.py) or SARATHI (an exact Sarathi, order fcfs), where the plan
    preempts nothing: it is planned here as `schedule` plans it (the same comparisons on the
    same ints) and run as `_execute` runs it (`_admit`, `_prefill_shape` on no cache or an
    inert one, `_decode_step` of the one cohort, `_prefill_complete`, the batch's records).
    The replica has no tiers, no batch hook and no hand-off (it is not a prefill replica: the
    caller's `_compiled_plan` decides that once). True; False, having done nothing, where the
    plan would preempt or be empty, the replica is in a state this does not cover (several
    cohorts, a keyed cache), or a number is not what Python would hold (numpy's, or past the
    64-bit or 2**52 bounds): then the policy plans and `_execute` runs. Keep in step with
    those (tests/test_compiled.py runs both)."""
    return _admit_step(self, policy, kind, roof, tables) == 1


cdef inline bint _inert(Tables tb):
    """PrefixCache.inert of the replica's cache: nothing keyed, no request sharing blocks."""
    return not tb.keyed and not tb.shared


cdef inline bint _int(object x):
    return type(x) is int and 0 <= x < EXACT


cdef int _admit_step(object self, object policy, int kind, tuple roof, Tables tb) except -1:
    """admit_step's work: 1 done, 0 declined (nothing changed)."""
    cache = tb.cache
    if cache is not None and not _inert(tb):
        return 0
    ds, kv, itl = tb.decoders, tb.kv, tb.itl
    cdef list cohorts = ds.cohorts
    if len(cohorts) != 1:
        return 0
    c = cohorts[0]
    if not (_int(kv.used) and _int(kv.capacity_blocks) and _int(c.clock) and _int(c.ctx) and _int(c.n)
            and _int(ds.n) and type(self.now) is float and type(self.prefill_backlog) is int
            and type(c.last_time) is float and type(itl.total) is float and type(itl.total_sq) is float
            and type(itl.max) is float and type(itl.n) is int and type(self.kv_integral) is float
            and type(self.busy) is float and type(self.peak_kv) is int and type(self.iterations) is int):
        return 0
    cdef long long bs = tb.bs, used = kv.used, cap = kv.capacity_blocks
    cdef long long nd = ds.n, clock = c.clock, dctx = c.ctx if nd else 0
    cdef list residue = c.residue
    cdef long long dnew = residue[_residue_index(clock, bs)]      # make_room's decode_new_blocks
    cdef list chunks = []
    cdef long long n_admit = 0
    cdef int planned
    if kind == VLLM_V1:
        planned = _plan_vllm_v1(self, policy, tb, cap - used - dnew, nd, chunks, &n_admit)
    else:
        planned = _plan_sarathi(self, policy, tb, cap - used, dnew, nd, chunks, &n_admit)
    if not planned or not chunks and not nd:
        return 0
    # _prefill_shape's sums, and the checks _execute would make, before anything changes
    cdef list computed = tb.computed, target = tb.target
    cdef long long new_blocks = 0, pt = 0, pctx = 0, p, ck, i
    cdef double pattn = 0.0
    for i, ck in chunks:
        p = computed[i]
        if not 0 < ck <= <long long>target[i] - p:
            return 0                            # _prefill_shape's error: the Python code raises it
        new_blocks += _blocks(p + ck, bs) - _blocks(p, bs)
        pt += ck
        pattn += <double>ck * (<double>p + <double>(ck + 1) / 2.0)
        pctx += p + ck
    cdef long long held = used + new_blocks + (dnew if nd else 0)
    if held > cap:
        return 0
    cdef double dt = _batch_time(roof, pt, pt > 0, pattn, 0, pctx, nd, dctx + nd)
    if dt < 0:
        return 0
    # the plan runs (Replica._execute)
    cdef double start = self.now, end = start + dt
    cdef object q = tb.queue
    cdef dict prefilling = tb.prefilling, running = tb.running, order = tb.order
    cdef set fresh = tb.fresh
    cdef list status = tb.status
    cdef double* admitted = tb.admitted
    for _ in range(n_admit):                    # _admit: the plan admits the queue's front
        i = q.popleft()
        status[i] = PREFILL
        running[i] = None
        prefilling[i] = None
        if cache is not None:
            fresh.add(i)
            self._admissions += 1
            order[i] = self._admissions
        if admitted[i] == INF:
            admitted[i] = start
    cdef long long q_tokens = 0, q_blocks = 0
    if cache is not None:                       # _prefill_shape on an inert cache: every lookup misses
        for i, ck in chunks:
            if i in fresh:
                fresh.discard(i)
                q_tokens += <long long>target[i]
                q_blocks += (<long long>target[i] - 1) // bs
        if q_tokens:
            cache.query_tokens += q_tokens
            cache.query_blocks += q_blocks
        if held > used:                         # Replica._allocate(new_blocks + decode step)
            _allocate(cache, kv, held - used)
    cdef long long kind_now = (pt > 0) + 2 * (nd > 0)
    self._last_kind = kind_now
    if not start < end < INF:
        end = self._batch_end(start, dt)
    if self.track_start:
        self._snap = (self.outstanding, held, self.prefill_backlog - pt)
    kv.used = held
    self.now = end
    if nd:
        _cohort_decode(self, c, end, tb)
        if self._stall:
            self._stall = 0
    cdef bint out = nd > 0
    if pt:
        self.prefill_backlog -= pt
        for i, ck in chunks:
            computed[i] += ck
            if computed[i] == target[i]:
                _prefill_complete(self, i, end, tb)
                out = True
        if out and self._stall:                 # (its plans preempt nothing: never a stalled batch)
            self._stall = 0
    if tb.finishing:
        _free_finished(self, tb)
    tb.times(dt)
    if tb.timeline is not None:
        tb.timeline.append((end, len(q), len(running), <long long>kv.used * bs))
    if tb.batches is not None:
        tb.batches.append((start, dt, pt, len(chunks), nd, held * bs))
    self.kv_integral += <double>held * dt
    self.busy += dt
    if held > self.peak_kv:
        self.peak_kv = held
    self.iterations += 1
    if not self.iterations % CHUNK:
        self._spill_logs()
    return 1


cdef int _plan_vllm_v1(object self, object policy, Tables tb, long long free, long long nd,
                       list chunks, long long* n_admit) except -1:
    """VllmV1.schedule on the replica's state where it preempts nothing (make_room's decode
    step fits, every running chunk fits): its chunks into `chunks`, the admitted count (the
    queue's front) into n_admit; 1, or 0 where it would preempt or a number is not a count
    C holds (declined: `chunks` is then not used)."""
    tokens, seqs, cap_tokens = policy.max_num_batched_tokens, policy.max_num_seqs, policy._cap
    if free < 0 or not (_int(tokens) and _int(seqs) and (cap_tokens is None or _int(cap_tokens))):
        return 0
    cdef long long bs = tb.bs, budget = <long long>tokens - nd, capc = 0, done, ck, need, t
    cdef object q = tb.queue
    cdef dict running = tb.running
    cdef list computed = tb.computed, target = tb.target
    if cap_tokens and len(running) + len(q) > 1:    # a lone request is not capped
        capc = cap_tokens
    for i in tb.prefilling:
        if not (_int(computed[i]) and _int(target[i])):
            return 0
        done = computed[i]
        ck = _min3(budget, <long long>target[i] - done, capc if capc else budget)
        if ck <= 0:
            break
        need = _blocks(done + ck, bs) - _blocks(done, bs)
        if need > free:
            return 0                           # it would preempt
        chunks.append((i, ck))
        free -= need
        budget -= ck
    cdef long long n = len(running)
    whole_o = policy.reserve_full_prompt
    if type(whole_o) is not bool:               # Python reads its truth only where it decides
        return 0
    cdef bint whole = whole_o
    for i in q:
        if n >= <long long>seqs or budget <= 0:
            break
        if not (_int(target[i]) and _int(computed[i])):
            return 0
        t = target[i]
        ck = _min3(budget, t, capc if capc else budget)
        if ck <= 0:
            return 0
        need = _blocks(ck, bs)
        if need > free or whole and _blocks(t, bs) > free:
            break
        chunks.append((i, ck))
        n_admit[0] += 1
        free -= need
        budget -= ck
        n += 1
    return 1


cdef int _plan_sarathi(object self, object policy, Tables tb, long long free, long long dnew,
                       long long nd, list chunks, long long* n_admit) except -1:
    """Sarathi.schedule (order fcfs) on the replica's state where make_room preempts nothing,
    as _plan_vllm_v1: chunks, admitted count; 1, or 0 (declined)."""
    size, seqs, watermark = policy.chunk_size, policy.max_num_seqs, policy.watermark
    if policy.order != "fcfs" or not (_int(size) and _int(seqs)) or type(watermark) not in (float, int):
        return 0
    cdef long long bs = tb.bs, budget, reserve = 0, ck, need, t, seats, keep = 0
    cdef object q = tb.queue
    cdef dict running = tb.running, prefilling = tb.prefilling
    cdef list computed = tb.computed, target = tb.target
    for i in prefilling:
        if not (_int(computed[i]) and _int(target[i])):
            return 0
        reserve += _blocks(target[i], bs) - _blocks(computed[i], bs)
    free -= reserve
    if dnew > free:
        return 0                               # make_room would preempt
    free -= dnew
    budget = <long long>size - nd
    for i in prefilling:
        if budget <= 0:
            break
        ck = _min3(budget, <long long>target[i] - <long long>computed[i], budget)
        chunks.append((i, ck))
        budget -= ck
    if q and budget > 0:                        # admit_reserving
        seats = <long long>seqs - len(running)
        if running:
            if not -INF < watermark < INF:      # int() of it raises: the policy's own error, in Python
                return 0
            k = int(watermark * self.kv_capacity_blocks)
            if not _int(k):
                return 0
            keep = k
        for i in q:
            if budget <= 0 or seats <= 0:
                break
            if not (_int(target[i]) and _int(computed[i])):
                return 0
            t = target[i]
            need = _blocks(t, bs)
            if free - need < keep:
                break
            ck = _min3(budget, t, budget)
            if ck <= 0:
                return 0
            chunks.append((i, ck))
            n_admit[0] += 1
            free -= need
            budget -= ck
            seats -= 1
    return 1


cdef inline long long _min3(long long a, long long b, long long c):
    if b < a:
        a = b
    return c if c < a else a


cdef int _allocate(object cache, object kv, long long n) except -1:
    """PrefixCache.allocate(n) (n > 0), its common cases inline: no eviction, or evictions the
    oldest run of free blocks covers; any other case calls it."""
    used, capacity, queued = kv.used, kv.capacity_blocks, cache.queued
    if not (_count(used) and _count(capacity) and _count(queued)):
        cache.allocate(n)
        return 0
    cdef long long evict = n - (<long long>capacity - <long long>used - <long long>queued)
    if evict > 0:
        q = cache.free_q
        b = next(iter(q)) if q else None
        if type(b) is not Run or not b.n > evict:
            cache.allocate(n)
            return 0
        b.n -= evict
        cache.evictions += evict
        cache.queued = queued - evict
    kv.used = used + n
    return 0


cdef int _cohort_decode(object self, object c, double end, Tables tb) except -1:
    """Replica._decode_step(end, [c]) for a cohort with members: Cohort.step and
    GapHistogram.add inline, the fresh members' first gaps and the due finishes compiled
    (or their Python code where they decline)."""
    cdef long long clock = c.clock + 1, base = c._base
    cdef double gap = end - <double>c.last_time
    gaps = c._gaps
    if clock - base >= len(gaps):
        c.clock = clock
        c._trim()
        base, gaps = c._base, c._gaps
    cdef Py_buffer gb
    _cells(gaps, &gb, b'd', True)
    (<double*>gb.buf)[clock - base] = gap
    PyBuffer_Release(&gb)
    c.clock = clock
    c.last_time = end
    c.ctx += c.n
    fresh = c.fresh
    itl = tb.itl
    cdef long long m = <long long>c.n - len(fresh)
    if m > 0:                                   # GapHistogram.add(gap, m)
        tb.counts[_bin(gap, tb.low, tb.log_low, tb.scale, tb.top)] += m
        itl.n += m
        itl.total += gap * <double>m
        itl.total_sq += gap * gap * <double>m
        if gap > <double>itl.max:
            itl.max = gap
    if fresh and not _first_gaps(itl, fresh, end, tb):
        self._first_gaps(c, end)
    fd = self._finish_due
    if fd is None or not fd(self, c, end, tb):
        for i in c.due():
            self._finish(i, end, self._leave_decode(i))
    return 0


cdef int _prefill_complete(object self, object i, double t, Tables tb) except -1:
    """Replica._prefill_complete(i, t), its first-token case inline (DecodeSet.join and
    Cohort.join with it); a resumed request, or one done at its first token, runs the Python
    code."""
    cdef list gen = tb.gen, output = tb.output
    if gen[i] != 0 or not (type(output[i]) is int and output[i] > 1):
        self._prefill_complete(i, t)
        return 0
    del tb.prefilling[i]
    gen[i] = 1
    tb.first[<Py_ssize_t>i] = t
    tb.last_tok[i] = t
    tb.status[i] = DECODE
    ds = tb.decoders
    c = ds.cohorts[0]
    kvt = tb.computed[i]
    clock = c.clock
    c.members[i] = (clock, kvt, 1, t)
    c.fresh[i] = None
    c.n += 1
    c.ctx += kvt
    c.residue[(kvt - clock) % tb.bs] += 1
    f = clock + output[i] - 1
    c._finish[i] = f
    heappush(c._heap, (f, i))
    tb.where[i] = c
    ds.n += 1
    return 0


cdef inline int _write_back(object self, object c, long long clock, long long ctx, double now,
                            long long allocated, long long used, Tables tb) except -1:
    """Replica._write_back, with PrefixCache.allocate's common cases inline (`_allocate`)."""
    c.clock, c.ctx, c.last_time = clock, ctx, now
    cache = tb.cache
    if cache is None:
        tb.kv.used = used
    elif allocated:
        _allocate(cache, tb.kv, allocated)
    return 0


cdef int _free_finished(object self, Tables tb) except -1:
    """Replica._free_finished, with its inert-cache case (PrefixCache.free_private and
    _queue_run) inline."""
    cdef list done = tb.finishing
    cache = tb.cache
    for item in done:
        if type(item[1]) is not int or not 0 <= item[1] < LIMIT:
            self._free_finished()
            return 0
    if not _inert(tb):
        self._free_finished()
        return 0
    cdef long long bs = cache.bs, full = 0, released = 0, kvt
    cdef dict held = cache.held, keys = cache._keys, order = tb.order
    for i, kv_tokens in done:
        kvt = kv_tokens
        full += kvt // bs
        released += _blocks(kvt, bs)
        held.pop(i, None)
        keys.pop(i, None)
    if full:
        q = cache.free_q                    # _queue_run(full): runs side by side are one run
        last = next(reversed(q), None) if q else None
        if type(last) is Run:
            last.n += full
        else:
            q[Run(full)] = None
        cache.queued += full
    cache.kv.used -= released
    for i, _ in done:
        order.pop(i, None)
    done.clear()
    return 0


def first_gaps(object itl, dict fresh, double end, Tables tables not None):
    """`Replica._first_gaps` compiled: each fresh decoder's first gap (end - its last token)
    into the histogram (`GapHistogram.add(g)`, inline) and its own records; `fresh` emptied;
    True. False, having done nothing, where a number is not a Python float or int (numpy's
    would stay numpy's in the Python code)."""
    return _first_gaps(itl, fresh, end, tables) == 1


cdef int _first_gaps(object itl, dict fresh, double end, Tables tb) except -1:
    """first_gaps' work: 1 done, 0 declined (nothing done)."""
    if not (type(itl.total) is float and type(itl.total_sq) is float
            and type(itl.max) is float and type(itl.n) is int):
        return 0
    cdef list last = tb.last_tok, tbt = tb.tbt
    for j in fresh:
        if type(last[j]) is not float:
            return 0
    cdef list counts = itl.counts
    cdef double log_low = itl._log_low, scale = itl._scale, low = itl.low
    cdef long long top = itl._top
    cdef double total = itl.total, total_sq = itl.total_sq, gmax = itl.max, g
    cdef long long hn = itl.n
    cdef Py_ssize_t i
    cdef double* itl_max = tb.itl_max
    cdef long long* viol = tb.viol
    for i in fresh:
        g = end - <double>last[i]
        counts[_bin(g, low, log_low, scale, top)] += 1
        hn += 1
        total += g * 1.0
        total_sq += g * g * 1.0
        if g > gmax:
            gmax = g
        if g > itl_max[i]:
            itl_max[i] = g
        if g > <double>tbt[i]:
            viol[i] += 1
    itl.total, itl.total_sq, itl.max, itl.n = total, total_sq, gmax, hn
    fresh.clear()
    return 1


cdef inline void _untaken(Py_buffer* view):
    """A buffer not taken yet: releasing it does nothing (its object is NULL)."""
    memset(view, 0, sizeof(Py_buffer))


cdef int _cells(object array, Py_buffer* view, char kind, bint writable) except -1:
    """A contiguous one-dimensional buffer of 8-byte items of `kind` (b'd' float64, b'q' int64)."""
    cdef const char* f
    PyObject_GetBuffer(array, view, (PyBUF_WRITABLE if writable else 0) | PyBUF_FORMAT | PyBUF_ANY_CONTIGUOUS)
    f = view.format
    if f[0] in b"@=":
        f += 1
    if view.ndim != 1 or view.itemsize != 8 or f[1] != 0 or not (
            f[0] == kind or kind == b"q" and f[0] == b"l"):
        PyBuffer_Release(view)
        raise TypeError("a contiguous 1-d float64 or int64 array of the replica's is needed here")
    return 0


def sink_rows(log, str kinds, list rows) -> None:
    """Write `rows` into `log` as the compiled decode run does (tests: the RowLog seams)."""
    cdef _Sink sink = _sink(log, kinds)
    if sink is None:
        raise ValueError(f"the log's layout is not {kinds!r}")
    try:
        for row in rows:
            sink.put(row)
    finally:
        sink.close()
