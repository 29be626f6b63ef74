"""Peer test suites: other projects' tests run against pdserve (tests/peer/vllm_openai.py).
Nothing here is collected by pdserve's own pytest run."""
