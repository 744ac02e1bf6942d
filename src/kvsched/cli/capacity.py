"""`kvsched capacity`: the largest arrival rate at which a configuration meets its SLOs."""
