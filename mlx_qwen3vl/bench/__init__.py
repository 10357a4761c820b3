"""`python -m mlx_qwen3vl.bench`: the benchmark a user runs on their machine and model (see
__main__.py), and what benchmarks/bench.py in a checkout builds on.

    presets         the published Qwen3-VL architectures as config.json dicts
    inputs          a synthetic screenshot of any size, a text prompt of N tokens, the agent's turns
    machine         chip, OS, memory, MLX and its device; peak-memory counters; memory limits
    run             our engine measured through the public API
    engine_mlx_vlm  mlx-vlm on the same inputs, in its own process
    report          the JSON schema (docs/bench.md), its validator, the printed table
"""
