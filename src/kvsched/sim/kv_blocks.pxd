# Cython's declarations for kv_blocks.py (see replica.pxd).
from kvsched.sim.replica cimport Replica

cpdef check(Replica rep, held)
cpdef allocate(Replica rep, n)
cpdef free(Replica rep, i, kv_tokens, done)
cpdef free_finished(Replica rep)
cpdef take(Replica rep, n)
