"""The KV block store: blocks from prefill workers, held in memory for decode workers.

``store`` is the pure-Python LRU store, ``server`` its gRPC service and command; the
client that workers use is ``pdserve.kv.client``.
"""
