# Cython's declarations for prefix_cache.py (see sim/replica.pxd).
cimport cython

from kvsched.kvcache cimport PagedKV
from kvsched.sim.requests cimport RequestTable


@cython.final
cdef class PrefixCache:
    cdef public PagedKV kv
    cdef public RequestTable reqs
    cdef public object bs, free_q, queued, _sources, _share, _shared
    cdef public object query_tokens, hit_tokens, query_blocks, hit_blocks, evictions, spill
    cdef public dict map, dups, held, _keys

    cpdef miss(self, i)
    cpdef pin(self, i, list blocks)
    cpdef _unref(self, list blocks)
    cpdef allocate(self, n, protect=*)
    cpdef free(self, i, kv_tokens, done, hashed=*)
    cpdef free_private(self, list done, unhashed=*)
    cpdef _queue_run(self, n)
