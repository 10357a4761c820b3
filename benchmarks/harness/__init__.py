"""The benchmark harness behind benchmarks/bench.py.

    preset_folders  random-weight published architectures (mlx_qwen3vl.architectures), as hub folders
    workloads    the inputs (screenshots, video, text, agent turns), preprocessed once
    measure      memory, bandwidth, CPU time, machine; the per-workload summary
    worker_*     one worker per engine (ours, mlx-vlm, transformers), each in its own process;
                 worker_mlx_vlm runs the installed benchmark's mlx-vlm runner (mlx_qwen3vl/bench)
    analysis     running the workers; rooflines, ratios, tables
"""
