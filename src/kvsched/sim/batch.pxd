# Cython's declarations for batch.py (see replica.pxd).
from kvsched.cost.roofline cimport DenseTime
from kvsched.kvcache cimport PagedKV
from kvsched.metrics cimport GapHistogram
from kvsched.sim.decode_set cimport Cohort, DecodeSet
from kvsched.sim.kv_blocks cimport allocate, check, free_finished, take
from kvsched.sim.lifecycle cimport admit, finish, leave_decode, preempt, prefill_complete
from kvsched.sim.records cimport first_gaps, spill_logs, tier_first_gaps
from kvsched.sim.replica cimport Replica

cpdef execute(Replica rep, plan)
cpdef prefill_shape(Replica rep, chunks, decode_blocks=*, lazy=*, defer=*, decoders=*, pads=*)
cpdef selected(Replica rep, d)
cpdef stalled(Replica rep, end)
cpdef decode_step(Replica rep, end, cohorts)
cpdef batch_end(start, dt)
