# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CSV lines of columns of numbers, laid out in C (kvsched/csvtext.py's compiled leaf): the
bytes csv.writer writes for the columns' Python values (ints in decimal, floats by repr, an
empty cell where a value is missing, CRLF). It does one job, which Python does not also do:
the pure-Python fallback (no C compiler) writes each value's `repr` / `str` itself.

A float's text is repr's, by the rule repr follows (Python's dtoa, mode 0): the fewest
significant digits p such that some p-digit decimal reads back as x, and of those decimals the
nearest to x. `_shortest` decides this with 80-bit long-double arithmetic and known error
bounds; a float it cannot decide for certain gets Python's own repr (PyOS_double_to_string,
as float.__repr__), and so does every float outside [1e-4, 1e16) (where repr writes an
exponent), zero, negatives, powers of two (the floats reading back as them are not centred on
them), non-finite values, and every float without 80-bit long doubles at run time.
"""
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer
from libc.math cimport fabs
from libc.string cimport memcpy, memmove, memset, strlen

cdef double INF = float("inf")


cdef inline void _untaken(Py_buffer* view):
    """A buffer not taken yet: releasing it does nothing (its object is NULL)."""
    memset(view, 0, sizeof(Py_buffer))


cdef extern from "Python.h":
    bytearray PyByteArray_FromStringAndSize(const char* s, Py_ssize_t n)
    char* PyByteArray_AS_STRING(object o)
    int PyByteArray_Resize(object o, Py_ssize_t n) except -1
    char* PyOS_double_to_string(double val, char format_code, int precision, int flags, int* ptype) except NULL
    void PyMem_Free(void* p)
    void* PyMem_Malloc(size_t n)
    int Py_DTSF_ADD_DOT_0

cdef extern from "<float.h>":
    int LDBL_MANT_DIG

cdef extern from "<math.h>":
    long long llrintl(long double x) nogil
    double log10(double x) nogil
    double floor(double x) nogil
    double frexp(double x, int* e) nogil
    double nextafter(double x, double y) nogil

cdef enum:
    FLOAT_CELL = 0
    INT_CELL = 1
    UINT_CELL = 2
    WORD_CELL = 3

cdef unsigned long long[19] POW10
cdef double[28] POW10_FLOAT
cdef long double[28] POW10_LONG
POW10[0] = 1
POW10_FLOAT[0] = 1.0
POW10_LONG[0] = 1.0
for _k in range(1, 28):
    if _k < 19:
        POW10[_k] = POW10[_k - 1] * 10
    POW10_FLOAT[_k] = 10.0 ** _k                # as numpy's 10.0 ** arange(28): correctly rounded
    POW10_LONG[_k] = POW10_LONG[_k - 1] * 10    # exact up to 10**27 in a 64-bit significand


cdef class _Column:
    """One column of `csv_block`: its arrays held as buffers while it writes."""
    cdef int kind
    cdef Py_buffer values, shown
    cdef Py_ssize_t stride

    def __cinit__(self):
        _untaken(&self.values)
        _untaken(&self.shown)

    def __dealloc__(self):
        PyBuffer_Release(&self.values)
        PyBuffer_Release(&self.shown)


ctypedef struct _Cells:                 # a column as the layout loop reads it (without the GIL)
    int kind
    const char* values
    const unsigned char* shown
    Py_ssize_t stride


cdef int _bytes_of(object array, Py_buffer* view, Py_ssize_t n, Py_ssize_t itemsize) except -1:
    """A C-contiguous buffer of n rows of `itemsize` bytes."""
    PyObject_GetBuffer(array, view, PyBUF_C_CONTIGUOUS)
    if view.len != n * itemsize:
        PyBuffer_Release(view)
        raise ValueError("a CSV column's array has the wrong length")
    return 0


def csv_block(list columns, Py_ssize_t n, bint extended):
    """The CSV lines (CRLF) of n rows of `columns`, as bytes, for kvsched/csvtext.py's `_lines`
    (`_column` there prepares the columns), laid out without the GIL
    (another thread may write another file meanwhile). A column is (kind, values, shown) or,
    for words, ("w", values, width, shown): "f" float64 values (repr's text), "i" int64 and
    "u" uint64 (decimal), "w" a NUL-padded uint8 byte matrix n x width (the bytes up to the
    first NUL); `shown` (uint8) is 0 where the cell is empty. `extended`: csvtext's
    `_extended_works()` (80-bit long doubles now; without them every float is Python's repr)."""
    cdef list cols = []
    cdef _Column col
    cdef Py_ssize_t width = 2, j, ncol = len(columns)
    for spec in columns:
        col = _Column()
        kind = spec[0]
        if kind == "w":
            col.kind, col.stride = WORD_CELL, spec[2]
            width += col.stride + 1
        else:
            col.kind, col.stride = {"f": FLOAT_CELL, "i": INT_CELL, "u": UINT_CELL}[kind], 8
            width += 33                         # repr of a float is at most 24 bytes, an int 20
        _bytes_of(spec[1], &col.values, n, col.stride)
        _bytes_of(spec[len(spec) - 1], &col.shown, n, 1)
        cols.append(col)
    cdef _Cells* cells = <_Cells*>PyMem_Malloc(ncol * sizeof(_Cells) + 1)
    if cells == NULL:
        raise MemoryError()
    out = PyByteArray_FromStringAndSize(NULL, n * width)
    cdef char* start = PyByteArray_AS_STRING(out)
    cdef char* end
    try:
        for j in range(ncol):
            col = <_Column>cols[j]
            cells[j].kind, cells[j].stride = col.kind, col.stride
            cells[j].values, cells[j].shown = <const char*>col.values.buf, <const unsigned char*>col.shown.buf
        with nogil:
            end = _layout(start, cells, ncol, n, extended)
    finally:
        PyMem_Free(cells)
    PyByteArray_Resize(out, end - start)
    return bytes(out)


cdef char* _layout(char* p, _Cells* cells, Py_ssize_t ncol, Py_ssize_t n, bint extended) except NULL nogil:
    """csv_block's lines from p on; the end of them."""
    cdef Py_ssize_t r, j, k
    cdef long long v
    cdef const unsigned char* w
    cdef _Cells* col
    for r in range(n):
        for j in range(ncol):
            col = &cells[j]
            if j:
                p[0] = 44                       # ','
                p += 1
            if not col.shown[r]:
                continue                        # an empty cell
            if col.kind == FLOAT_CELL:
                p += _float_text(p, (<const double*>col.values)[r], extended)
            elif col.kind == INT_CELL:
                v = (<const long long*>col.values)[r]
                if v < 0:
                    p[0] = 45                   # '-'
                    p += 1
                    p += _decimal(p, <unsigned long long>(-(v + 1)) + 1)
                else:
                    p += _decimal(p, <unsigned long long>v)
            elif col.kind == UINT_CELL:
                p += _decimal(p, (<const unsigned long long*>col.values)[r])
            else:
                w = <const unsigned char*>col.values + r * col.stride
                for k in range(col.stride):
                    if not w[k]:
                        break
                    p[0] = w[k]
                    p += 1
        p[0] = 13                               # CRLF
        p[1] = 10
        p += 2
    return p


cdef Py_ssize_t _float_text(char* out, double x, bint extended) except -1 nogil:
    """repr(x) at out (its length): "whole.fraction" from `_shortest`'s digits where it is
    certain of them, else Python's own repr (PyOS_double_to_string, as float.__repr__)."""
    cdef unsigned long long digits
    cdef long long nd, e10, after
    cdef Py_ssize_t m
    cdef char* text
    cdef int e
    if extended and 1e-4 <= x < 1e16 and frexp(x, &e) != 0.5 and _shortest(x, &digits, &nd, &e10):
        after = nd - 1 - e10                    # digits after the point; <= 0: the point ends them
        if after <= 0:                          # digits, zeros, ".0"
            m = _padded(out, digits, nd)
            memset(out + m, 48, -after)
            m -= after
            out[m], out[m + 1] = 46, 48
            return m + 2
        if after < nd:                          # digits with the point inside
            _padded(out + 1, digits, nd)
            memmove(out, out + 1, nd - after)
            out[nd - after] = 46
            return nd + 1
        out[0], out[1] = 48, 46                 # "0.", zeros, digits
        memset(out + 2, 48, after - nd)
        return 2 + after - nd + _padded(out + 2 + after - nd, digits, nd)
    with gil:                                   # Python's repr (about 1% of a run's floats)
        text = PyOS_double_to_string(x, b'r', 0, Py_DTSF_ADD_DOT_0, NULL)
        m = strlen(text)
        memcpy(out, text, m)
        PyMem_Free(text)
    return m


cdef bint _shortest(double x, unsigned long long* digits_out, long long* nd_out, long long* e10_out) noexcept nogil:
    """For a float x in [1e-4, 1e16), not a power of two: repr's significant digits, how many,
    the power of ten of the first; False where it is not certain of them.

    The floats reading back as x are those within h, half its spacing, on either side. Take
    p0, the fewest digits whose spacing is finer than 2h (some p0-digit decimal is within h),
    and y = x * 10**s, with s such that the p0-digit decimals are the integers: the
    (p0 - k)-digit decimals are then the multiples of 10**k, and repr's p is p0 - k for the
    largest k whose nearest multiple lies within h (if one does for k, one does for k - 1).
    y is one long-double product (10**s is exact), off by at most 2**-64 y; a comparison
    closer than that bound, plus float64 rounding, is left undecided."""
    cdef long long exp10 = <long long>floor(log10(x))
    cdef double spacing = nextafter(x, INF) - x      # np.spacing of a positive float
    cdef long long p0 = <long long>floor(<double>(exp10 + 1) - log10(spacing)) + 1
    if p0 > 17:
        p0 = 17
    cdef long long scale = p0 - 1 - exp10
    if not 0 <= scale < 28:
        return False
    cdef long double y = <long double>x * POW10_LONG[scale]
    if not (y >= 1048576.0 and y < 4611686018427387904.0):         # [2**20, 2**62)
        return False
    cdef long long whole = llrintl(y)           # y's integer part (a rounding and a fix-up: C's
    if <long double>whole > y:                  # truncating cast switches the x87 rounding mode)
        whole -= 1
    cdef double fraction = <double>(y - <long double>whole)
    cdef double h = spacing * 0.5 * POW10_FLOAT[scale]
    cdef double err = <double>y * 1.0842021724855044e-19 + 1e-12   # 2**-63
    cdef double rests[4]
    cdef double gap, rest, half
    cdef long long j, k = -1, ten = 1, nd
    cdef unsigned long long digits
    rests[0] = <double>0 + fraction             # whole % 10**j, by constants (no division instruction)
    rests[1] = <double>(whole % 10) + fraction
    rests[2] = <double>(whole % 100) + fraction
    rests[3] = <double>(whole % 1000) + fraction
    for j in range(4):
        gap = rests[j] if rests[j] < ten - rests[j] else ten - rests[j]
        if k == j - 1:
            if fabs(gap - h) <= err:
                return False
            if gap < h:
                k = j
        ten *= 10
    if not 0 <= k < 3:
        return False
    rest, half = rests[k], <double>POW10[k] / 2
    if fabs(rest - half) <= err:
        return False
    digits = <unsigned long long>(whole if k == 0 else whole // 10 if k == 1 else whole // 100) + (rest > half)
    nd = p0 - k if p0 - k > 1 else 1
    if not (POW10[nd - 1] <= digits < POW10[nd]):
        return False
    digits_out[0], nd_out[0], e10_out[0] = digits, nd, exp10
    return True


cdef inline Py_ssize_t _decimal(char* out, unsigned long long v) noexcept nogil:
    """v in decimal at out; its length."""
    cdef Py_ssize_t k = 1
    cdef unsigned long long t = 10
    while k < 20 and v >= t:                    # its digits: 10**19 is the last power below 2**64
        k += 1
        if k < 20:
            t *= 10
    return _padded(out, v, k)


cdef char[200] PAIRS                    # "00".."99"
for _k in range(100):
    PAIRS[2 * _k], PAIRS[2 * _k + 1] = 48 + _k // 10, 48 + _k % 10


cdef inline Py_ssize_t _padded(char* out, unsigned long long v, Py_ssize_t width) noexcept nogil:
    """v in decimal with leading zeros to `width` digits (v < 10**width), two digits a step."""
    cdef Py_ssize_t j = width
    cdef unsigned long long q
    while j >= 2:
        q = v // 100
        memcpy(out + j - 2, PAIRS + 2 * (v - q * 100), 2)
        v = q
        j -= 2
    if j:
        out[0] = <char>(48 + v % 10)
    return width


def shortest_digits(double x):
    """(digits, how many, power of ten of the first) of repr(x) as `_float_text` finds them with
    80-bit long doubles, or None where it leaves x to Python's repr (tests compare it with repr)."""
    cdef unsigned long long digits
    cdef long long nd, e10
    cdef int e
    if 1e-4 <= x < 1e16 and frexp(x, &e) != 0.5 and _shortest(x, &digits, &nd, &e10):
        return digits, nd, e10
    return None

