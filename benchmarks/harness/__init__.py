"""The benchmark harness behind benchmarks/bench.py.

    presets      random-weight published architectures, written once as hub folders
    workloads    the inputs (screenshots, video, text, agent turns), preprocessed once
    measure      memory, bandwidth, CPU time, machine; the per-workload summary
    engine_*     one worker per engine (ours, mlx-vlm, transformers), each in its own process
    report       running the workers; rooflines, ratios, tables
"""
