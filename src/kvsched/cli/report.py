"""`kvsched report DIR`: a self-contained HTML page from a sweep, compare or capacity folder."""
