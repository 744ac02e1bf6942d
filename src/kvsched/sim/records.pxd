# Cython's declarations for records.py (see replica.pxd).
from kvsched.metrics cimport GapHistogram
from kvsched.sim.decode_set cimport Cohort
from kvsched.sim.replica cimport Replica
from kvsched.sim.requests cimport RequestTable

cpdef fold(Replica rep, i, gen, last, Cohort c, Py_ssize_t lo, Py_ssize_t hi)
cpdef first_gaps(Replica rep, Cohort ch, end)
cpdef tier_first_gaps(Replica rep, end, cohorts)
cpdef spill_logs(Replica rep)
