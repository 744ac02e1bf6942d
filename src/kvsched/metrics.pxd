# Cython's declarations for metrics.py (see sim/replica.pxd).
cimport cython


@cython.final
cdef class GapHistogram:
    cdef public double _log_low, _scale, _ratio, low, total, total_sq, max
    cdef public Py_ssize_t _top
    cdef public long long n
    cdef public list counts

    cpdef add(self, double gap, long long n=*)
