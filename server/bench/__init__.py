"""`jaxserve bench serve|throughput|latency` (vLLM's benchmark commands): datasets.py makes the
prompts, serve.py drives a server over HTTP, offline.py the in-process `LLM`, metrics.py computes
and prints the report, results.py and plot.py write it out; cli.py holds the flags."""
