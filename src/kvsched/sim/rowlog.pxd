# Cython's declarations for rowlog.py (the compiled build, kvsched/compiled.py): a row log as a C
# type whose chunk is written through typed views of its memory.
cdef class RowLog:
    cdef public object dtype, _buf, _file, _kinds
    cdef public list _floats, _rows
    cdef public Py_ssize_t _width, _cap, _n, _spilled
    cdef double[:, ::1] _f
    cdef long long[:, ::1] _q
    cdef object __weakref__

    cpdef append(self, row)
