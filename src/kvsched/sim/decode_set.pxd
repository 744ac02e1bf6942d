# Cython's declarations for decode_set.py (see sim/replica.pxd).
cimport cython


@cython.final
cdef class Cohort:
    cdef public long long block_size, clock, n, ctx, _base
    cdef public double last_time
    cdef public object _gaps
    cdef public double[:] _gaps_c
    cdef public list residue, _heap
    cdef public dict members, fresh, _finish

    cpdef progress(self, i)
    cpdef long long kv_tokens(self, i)
    cpdef double last_token(self, i)
    cpdef join(self, i, kv, gen, output, time)
    cpdef advance(self, i, e)
    cpdef step(self, end)
    cpdef list due(self)
    cpdef leave(self, i)
    cdef tuple _bounds(self, long long c0)
    cpdef double gap_max(self, Py_ssize_t lo, Py_ssize_t hi)
    cpdef window(self, i)
    cpdef _trim(self)


@cython.final
cdef class DecodeSet:
    cdef public object block_size, n, _move
    cdef public list cohorts
    cdef public dict where

    cpdef join(self, i, kv, gen, output, time)
    cpdef leave(self, i)
