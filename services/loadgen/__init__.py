"""`pdserve bench`: a benchmark client for any OpenAI-compatible server (vLLM's metric
definitions), its workloads, reports and plots. The comparison harness around it lives in
the repository's bench/ folder, outside the installed package."""
