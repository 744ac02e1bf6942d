# Cython's declarations for decode_run.py (see replica.pxd).
from kvsched.cost.roofline cimport DenseTime
from kvsched.kvcache cimport PagedKV
from kvsched.metrics cimport GapHistogram
from kvsched.sim.batch cimport batch_end, execute
from kvsched.sim.decode_set cimport Cohort, DecodeSet
from kvsched.sim.kv_blocks cimport free_finished, take
from kvsched.sim.lifecycle cimport finish, leave_decode
from kvsched.sim.records cimport first_gaps, spill_logs
from kvsched.sim.replica cimport Replica

cpdef idle_fits(Replica rep)
cpdef decode_run(Replica rep, double until)
cpdef plain_decodes(Replica rep, Cohort c, double until)
cpdef end_run(Replica rep, k0, k, kv_integral, busy, peak, now)
cpdef write_back(Replica rep, Cohort c, clock, ctx, now, allocated, used)
