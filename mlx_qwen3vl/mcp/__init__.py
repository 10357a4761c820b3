"""An MCP server for GUI agents on a local Qwen3-VL / UI-Venus model:
`python -m mlx_qwen3vl.mcp --model PATH|HUB_ID [--transport stdio|http]` (the `mcp` extra).

    arguments.py their arguments as pydantic wire models (the declarations are their schemas), read
                 into the server's one request form (server.protocol.ChatRequest)
    tools.py     the tools (ground, next_action, ask) as plain functions: the screenshot read under
                 its budgets before any model work, then the answer
    server.py    the SDK's low-level Server around them; the HTTP transport's guards
    __main__.py  the command line
"""
