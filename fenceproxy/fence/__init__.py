"""The fence's rules, with no I/O: the fencing headers and the decisions on
generations and keys (:mod:`.fencing`), signed tokens (:mod:`.tokens`), and a fenced
write read from its request and followed through its turn (:mod:`.write`)."""
