"""The KV block store: blocks from prefill workers, held in memory for decode workers.

``store`` is the pure-Python LRU store, ``server`` its gRPC service, ``client`` the
async client, ``cli`` the process's command line, ``launch`` starts one as a process.
"""
