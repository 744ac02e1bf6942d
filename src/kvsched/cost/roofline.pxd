# Cython's declarations for cost/roofline.py (see sim/replica.pxd): DenseDecode's terms as C
# numbers, so a decode run's batch time is a C call.
cimport cython


@cython.final
cdef class DenseDecode:
    cdef public double gemm, attn, flop_rate, weights, byte_rate, overhead
    cdef public long long kv_bytes, weights_int, ctx_limit
    cdef public bint int_weights

    cpdef double seconds(self, long long n, long long ctx)
