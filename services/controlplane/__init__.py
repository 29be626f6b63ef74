"""The control plane in Redis: the registry's keys (``registry``), a worker's own entry
kept fresh (``publisher``) and a gateway's live copy of all of them (``view``)."""
