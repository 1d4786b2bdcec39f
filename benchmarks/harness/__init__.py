"""What the benchmark scripts share, written once; each script keeps only its workload and its judgement.

The scripts put their own folder (``benchmarks/``) first on ``sys.path``, as Python does for a script,
and import the modules they need: ``from harness.results import write_result``. Nothing is re-exported
here, so that the GPU check can import ``harness.stats`` on a machine with PyTorch and numpy only.

- ``stats``: percentiles, Student's t intervals, interleaved A/B overheads (numpy, scipy).
- ``results``: result files (stamped with what they measured), tables, ratios, PNGs.
- ``workload``: the traces in ``data/traces``, requests and prompts.
- ``client``: the streaming client, open-loop replay, per-class reports, engine metrics and caches.
- ``engines``: the benchmark model, its measured cost model, stock and coserve engines.
- ``pool``: a local P/D pool of coserve engines and the coserve router in front of it.
- ``peers``: vLLM's own router (``vllm-router``) and other processes pinned to cores.
- ``sweep``: the best arm of a sweep and Pareto frontiers.

Freshness (``freshness.py``) follows these modules' relative imports, so a result measured through a
module here is stale when that module changes.
"""
