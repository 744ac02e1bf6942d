# Cython's declarations for view.py (the compiled build, kvsched/compiled.py): the view as a C
# type whose replica (typed, so its reads take the replica's fields directly) and cost-model
# copy are C fields, read and written by view.py's own C functions (`@cython.cfunc`, not
# declared here: a function declared here is exported). A field fixed for the run (`_FIXED`
# in view.py) is declared here too.
cimport cython

from kvsched.sim.decode_set cimport Cohort
from kvsched.sim.replica cimport Replica


@cython.final
cdef class ReplicaView:
    cdef Replica _r
    cdef object _cost
    cdef public object _policy_name, index, role, block_size, kv_capacity_blocks, waiting, running, prefilling
    cdef public object decoding, recent_batch_times, recent_finished, _output, _admitted, declared_types
    cdef public object prefix_caching

