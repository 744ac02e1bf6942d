# Cython's declarations for kvcache.py (see sim/replica.pxd).
cimport cython


@cython.final
cdef class PagedKV:
    cdef public long long block_size, capacity_blocks, used     # below TOKEN_LIMIT (checked)
