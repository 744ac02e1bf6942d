# Cython's declarations for kvcache.py (see sim/replica.pxd).
cimport cython


@cython.final
cdef class PagedKV:
    cdef public object block_size, capacity_blocks, used
