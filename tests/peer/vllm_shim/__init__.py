"""The pieces the vLLM peer run lays over vLLM's test tree (see tests/peer/vllm_openai.py):
copied as the package ``pdserve_peer_shim`` into the work directory, never imported from
here."""
