"""The fence's rules, with no I/O: the fencing headers and the decisions on
generations and keys (:mod:`.fencing`) and signed tokens (:mod:`.tokens`)."""
