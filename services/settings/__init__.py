"""Settings: one frozen dataclass per command, each field a flag and a ``PDSERVE_*``
variable (``flags``: the mechanism; ``process``, ``engine``, ``services``, ``commands``: the
classes; ``variables``: the variables that are not flags)."""
