# Cython's declarations for prefix_planner.py (see sim/replica.pxd): the lazy planner most plans
# get, its fields typed so its answers are C calls.
cimport cython

from kvsched.sim.prefix_cache cimport PrefixCache
from kvsched.sim.replica cimport Replica


@cython.final
cdef class LazyPlanner:
    cdef public PrefixCache _c
    cdef public Replica _r
    cdef public list _calls
    cdef public dict _start
    cdef public object _real

    cpdef lookup(self, i, chunk=*)
    cpdef chunk(self, i, tokens, slots=*)
    cpdef decodes(self, blocks)
    cpdef preempt(self, i)
