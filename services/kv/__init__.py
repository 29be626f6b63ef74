"""KV blocks between processes: their layout and keys (``blocks``), the chained content
hash (``hashing``), the layout's wire message (``convert``) and the kvstore client
(``client``)."""
