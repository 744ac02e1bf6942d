# Cython's declarations for lifecycle.py (see replica.pxd): its functions as C calls on the
# replica's C fields.
from kvsched.metrics cimport GapHistogram
from kvsched.sim.decode_set cimport Cohort, DecodeSet
from kvsched.sim.kv_blocks cimport free
from kvsched.sim.records cimport fold
from kvsched.sim.replica cimport Replica
from kvsched.sim.requests cimport RequestTable

cpdef admit(Replica rep, i)
cpdef load_instead(Replica rep, i, ends)
cpdef preempt(Replica rep, i, defer=*)
cpdef requeue(Replica rep, i, recomputed, backlog)
cpdef requeue_decoder(Replica rep, i, kv_tokens)
cpdef prefill_complete(Replica rep, i, t)
cpdef land_ready(Replica rep)
cpdef finish(Replica rep, i, t, kv_tokens)
cpdef leave_decode(Replica rep, i, defer=*)
cpdef move(Replica rep, i, Cohort src, Cohort dst)
