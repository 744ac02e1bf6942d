# Cython's declarations for cost/roofline.py (see sim/replica.pxd): DenseTime's terms as C
# numbers, so a batch's time is a C call.
cimport cython


@cython.final
cdef class DenseTime:
    cdef public double gemm, attn, flop_rate, weights, byte_rate, overhead, cpu_request, cpu_token
    cdef public long long kv_bytes, weights_int, ctx_limit
    cdef public bint int_weights, overlap

    cpdef double _batch(self, long long tokens, long long requests, double pairs, long long ctx)    # cpdef: an interpreted engine module calls it too
