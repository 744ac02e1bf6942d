# Cython's declarations for requests.py (see sim/replica.pxd).
cimport cython


@cython.final
cdef class RequestTable:
    cdef public object workload, n, admitted, first, finished, itl_max, viol, preempts, recomputed, replica
    cdef public object output_ro, rejected, remaining, done, issued, in_flight, rows
    cdef public list arrival, prompt, output, known, tier, tbt, priority, target, computed, gen, status, last_tok
    cdef public list rejected_list
    cdef public double[:] admitted_c, first_c, finished_c, itl_max_c
