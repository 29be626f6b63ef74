"""What a process imported, read from its ``-X importtime`` trace, and the services that must
start without the engine's packages (torch, transformers, triton)."""

from __future__ import annotations

# (service, its flags, the READY lines it owes) of the services that start without torch
LIGHT_SERVICES = [
    ("kvstore", ["--capacity-bytes", "8MiB"], ["kvstore"]),
    (
        "gateway",
        ["--decode", "127.0.0.1:1", "--disaggregation", "off", "--http-port", "0"],
        ["gateway", "gateway-http"],
    ),
]


def imported_modules(log: str) -> set[str]:
    """Module names from ``-X importtime`` lines: "import time: self | cumulative | name"."""
    names = set()
    for line in log.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names
