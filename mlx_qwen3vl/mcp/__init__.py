"""An MCP server for GUI agents on a local Qwen3-VL / UI-Venus model:
`python -m mlx_qwen3vl.mcp --model PATH|HUB_ID [--transport stdio|http]` (the `mcp` extra).

    tools.py     the tools (ground, next_action, ask) as plain functions, and their declarations;
                 every argument checked against its allow-list and budget before any model work
    server.py    the SDK's low-level Server around them; the HTTP transport's guards
    __main__.py  the command line
"""
