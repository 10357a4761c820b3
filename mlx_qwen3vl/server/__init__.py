"""An OpenAI-compatible HTTP server for Qwen3-VL: `python -m mlx_qwen3vl.server --model PATH|HUB_ID`.

    app.py       routes, API key, Host / Origin, CORS, error bodies
    service.py   the one admission path (key, body, parse off the loop, queue place, build) and waiting
                 for an answer
    protocol.py  the one internal request (ChatRequest), errors, pydantic validation, shared field checks
    chat.py      OpenAI chat completions: its wire models, answer and stream chunks
    grounding.py POST /v1/ground: agent.ground_with with each pass a request through the engine
    ui.py        the playground page at / (static/: HTML, JS, CSS; off with --no-ui)
    model_inputs.py  a request → model inputs (media under the request's budget, chat template, tools,
                 grammar)
    limits.py    what one request may cost, checked before decoding (pixels, frames)
    fetch.py     image / video URLs → bytes or allowed local files (checked hosts, one deadline)
    connections.py  below the app: connection cap, read deadlines, stopping on SIGTERM / SIGINT
    prepared.py  a request turned into model inputs, and the HTTP side's handle on it
    model_thread.py  the model thread around the library's engine (mlx_qwen3vl.engine): HTTP requests
                 in, events out, places in the queue; replica.py: the same under mlx.launch
    tool_calls.py  <tool_call> blocks → OpenAI tool_calls
    grammar.py   json_object / json_schema / forced tool calls via llguidance
    responses.py OpenAI's Responses API (store.py: recent responses for previous_response_id)
    messages.py  Anthropic's Messages API
    conversation.py  every protocol's conversation in one form (turns of parts), rendered as the chat
                 template's messages
    computer.py  computer-use tools: the trained prompt, answers → the tool's actions
    computer_answers.py  the answers behind the computer-use calls issued, for replays (bounded)
    answer_stream.py  an answer split into reasoning, text and tool calls while it streams
"""


def build_server(model, processor, *, model_id="model", api_key=None, max_body_bytes=64 << 20, cors_origins=None,
                 media_policy=None, limits=None, grammar_timeout_s=None, bound_host=None, ui=True, agent_format="qwen",
                 responses_store=256, responses_store_bytes=256 << 20, computer_answers=1024,
                 computer_answers_bytes=16 << 20, agent_history=None, **engine_kwargs):
    """(model, processor) → (Starlette app, engine); the engine's model thread is already running."""
    from .app import create_app
    from .computer_answers import ComputerAnswers
    from .model_thread import ModelThread
    from .fetch import MediaPolicy
    from .grammar import GrammarFactory
    from .limits import DEFAULT_GRAMMAR_TIMEOUT_S
    from .model_inputs import PromptBuilder
    from .store import ResponseStore

    engine = ModelThread(model, processor, **engine_kwargs)
    tok = processor.tokenizer
    grammars = GrammarFactory(tok, model.config.text_config.vocab_size, tok.eos_token_id,
                              timeout_s=grammar_timeout_s or DEFAULT_GRAMMAR_TIMEOUT_S)
    builder = PromptBuilder(engine, media_policy or MediaPolicy(), grammars, limits)
    app = create_app(engine, builder, model_id=model_id, api_key=api_key, max_body_bytes=max_body_bytes,
                     cors_origins=cors_origins, bound_host=bound_host, ui=ui, agent_format=agent_format,
                     response_store=ResponseStore(responses_store, responses_store_bytes),
                     computer_answers=ComputerAnswers(computer_answers, computer_answers_bytes),
                     agent_history=agent_history)
    return app, engine
