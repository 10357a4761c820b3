"""Scripted-answer checkpoints: a real Qwen3-VL checkpoint folder whose greedy answer is given text.

`write_scripted_checkpoint(folder, answers)` writes config.json, float32 safetensors, the tiny
tokenizer (tests/fixtures/tokenizer, plus one added token per new trigger), its chat template and
preprocessor configs. The real loader, generate / ChatSession / batch_generate and the server run
it like any other checkpoint: the script lives in the weights, not in the runtime.

    write_scripted_checkpoint(tmp, "[523, 87]")                      # one answer for every prompt
    write_scripted_checkpoint(tmp, {"@open": A, "@next": B}, default=C)

With a dict, the answer is the one whose trigger occurs LAST in the prompt (so an agent loop can
script each turn: the instruction carries one trigger, the tool result the next); without any
trigger it is `default` (None: the empty answer). Each answer ends with <|im_end|>, so generation
stops with finish_reason "stop".

How it works (one decoder layer, hidden size a few hundred, untied LM head):

- The residual stream holds a constant "bias" direction (every token embeds it; it dominates the
  norm, so the RMSNorms scale every other feature by a near-constant factor) and small one-hot
  features. Tokens of the answers and of the generation prompt `<|im_start|>assistant\\n` each
  have a direction in the "current token" subspace; every other token embeds only the bias (and
  image / video positions hold the vision tower's output, which is zero: the mergers' last linear
  layers are zero).
- Attention head j = 1..n-1 looks exactly j positions back: constant q and k (from the bias),
  q pre-rotated by j*theta_i in each frequency pair, so its score sum_i cos(theta_i (delta - j))
  peaks at delta = j by >= 40 nats over every other delta up to 8192 (text tokens have T=H=W, so
  mRoPE is plain 1D RoPE there). Its value copies that token's one-hot into the "token j back"
  subspace. The last head finds the latest trigger: only trigger tokens have a key, on the slowest
  frequency pair with a phase that makes the score fall ~9 nats per position of distance.
- The MLP has one SwiGLU unit per (trigger, state of the answer): its gate is
  s * (matches - (m - 1/2)) over the m features it needs and its up input 1 - mismatches, so it
  writes 1 when all match and (about) nothing otherwise; it writes the next token's direction,
  which the LM head reads (logit 60). The LM head also gives <|im_end|> a constant 15, so a
  context off the script stops. A state is the shortest suffix of `<|im_start|>assistant\\n` +
  answer that tells it apart from every other state with a different next token; the generation
  prompt's <|im_start|> makes early states unique whatever the prompt holds before it.
- Keys and values depend only on a token and its position, so caches, prefix reuse, left padding
  (masked keys) and chunked prefill all see what a fresh run sees; every decision has a margin of
  tens of logits, so the plain MLX graph and the CPU path agree, and even sampling at
  temperature 1 draws the script.

Limits (a script outside them raises ScriptError rather than misbehaving; the first and the last
two are the caller's to keep):

- The prompt must end with the chat template's generation prompt `<|im_start|>assistant\\n`
  (every messages= / chat request does; a templated= prompt must too).
- A trigger is any string without leading or trailing whitespace; it becomes one token (an added
  token of the checkpoint's tokenizer, matched anywhere in the text, even inside words), or is
  an existing rarely used special token such as <|box_start|>. It must not occur in the chat
  template's text or a video timestamp, in any answer, or inside another trigger. At most 64.
- Answers: text whose tokens decode back to it exactly, without <|im_start|>, <|im_end|>,
  <|endoftext|> or vision tokens, up to 512 tokens. A state needs at most 16 tokens of context:
  an answer that repeats the same 16-token stretch with different continuations (e.g. a run of
  17+ identical tokens) is refused. At most 128 distinct tokens over all answers.
- Float32 only (the default on the CPU, and the dtype config.json states): the trigger head's
  scores span ~1e5, and in bfloat16 the latest trigger wins only over triggers some 200 positions
  before it. Positions up to 8192 (the context is 4096).
- The latest trigger wins by ~9 nats per position of separation (an earlier trigger repeated
  e**9 times one position before the latest one could tie with it).
"""

import json
import math
import shutil
import unicodedata
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER = FIXTURES / "tokenizer"
SIDECARS = ["chat_template.jinja", "tokenizer_config.json", "preprocessor_config.json",
            "video_preprocessor_config.json"]

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
VISION = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
GENERATION_PROMPT = IM_START + "assistant\n"
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 412, 413, 409, 410
EOS_IDS = [402, 400]  # <|im_end|>, <|endoftext|> (the tiny checkpoints' generation_config.json)

MAX_CONTEXT = 16  # tokens a state may need (offset heads + the current token)
MAX_TOKENS = 512  # per answer
MAX_TRIGGERS = 64
MAX_DISTINCT = 128  # distinct answer / generation-prompt tokens (one head's value width)
MAX_POSITION = 8192  # positions the offset and recency heads are designed for

HEAD_DIM = 128
EPS = 0.01  # feature size relative to the bias direction
OFFSET_GAP = 40.0  # nats between an offset head's target and any other position
RECENCY_SCALE = 2.0e5  # the trigger head's score amplitude
RECENCY_SPAN, RECENCY_PHASE = 1.1, 0.35  # its angle runs over [phase, phase + span] for positions 0..MAX_POSITION
GATE_SCALE, GATE_FLOOR = 16.0, 80.0  # a unit's gate is s * (matches - (m - 1/2)), never below -GATE_FLOOR
LOGIT, STOP_LOGIT = 60.0, 15.0  # the scripted token's logit; <|im_end|>'s constant one


class ScriptError(ValueError):
    """A script this construction cannot carry out."""


def _silu(x):
    return x / (1 + math.exp(-x))


def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))


def _template_text():
    """The chat template's text: whatever it renders around the user's text comes from it."""
    return (TOKENIZER / "chat_template.jinja").read_text(encoding="utf-8")


def _check_trigger(trigger, special, others):
    if not isinstance(trigger, str) or not trigger or trigger != trigger.strip():
        raise ScriptError(f"trigger {trigger!r}: use a non-empty string without leading or trailing whitespace")
    if unicodedata.normalize("NFC", trigger) != trigger:
        raise ScriptError(f"trigger {trigger!r} is not in NFC form (the tokenizer normalizes prompts to NFC)")
    if trigger in (IM_START, IM_END, ENDOFTEXT, *VISION):
        raise ScriptError(f"trigger {trigger!r} is a token the template or the vision input places; use another")
    if trigger not in special and any(s in trigger or trigger in s for s in special):
        raise ScriptError(f"trigger {trigger!r} overlaps the special token(s) "
                          f"{[s for s in special if s in trigger or trigger in s]}")
    if trigger in _template_text():
        raise ScriptError(f"trigger {trigger!r} occurs in the chat template's text, so every prompt could hold it")
    digits = "".join("0" if c.isdigit() else c for c in trigger)
    if digits in "<" + "0" * len(trigger) + ".0 seconds>":
        raise ScriptError(f"trigger {trigger!r} can occur in a video timestamp such as '<1.5 seconds>'")
    inside = [o for o in others if o != trigger and (trigger in o or o in trigger)]
    if inside:
        raise ScriptError(f"trigger {trigger!r} and {inside[0]!r} overlap: one would hide the other")


def _encode_answer(tok, text, special_ids):
    if not isinstance(text, str):
        raise ScriptError(f"an answer must be a string, not {type(text).__name__}")
    ids = tok.encode(text).ids
    bad = sorted({tok.id_to_token(i) for i in ids if i in special_ids})
    if bad:
        raise ScriptError(f"answer {text[:40]!r} contains {', '.join(bad)}, which end or shape the prompt")
    if tok.decode(ids, skip_special_tokens=False) != text:
        raise ScriptError(f"answer {text[:40]!r} does not decode back to itself through the tokenizer")
    if len(ids) > MAX_TOKENS:
        raise ScriptError(f"answer {text[:40]!r} is {len(ids)} tokens; at most {MAX_TOKENS}")
    return ids


def _states(seq, k):
    """For the sequence generation prompt + answer (k prompt tokens), each state's shortest
    distinguishing context → [(context tokens, oldest first), next token].

    A state conflicts with another one that has another next token and the same context. A state
    with fewer tokens before it than the context's length cannot match that context (its
    <|im_start|> sits where the context holds a later token), so it is left out at that length."""
    nexts = seq[k:] + [EOS_IDS[0]]
    found = [None] * len(nexts)
    for length in range(1, MAX_CONTEXT + 1):
        seen = {}
        for t in range(len(nexts)):
            if k + t >= length:
                seen.setdefault(tuple(seq[k + t - length:k + t]), set()).add(nexts[t])
        for t, y in enumerate(nexts):
            if found[t] is None and k + t >= length and len(seen[tuple(seq[k + t - length:k + t])]) == 1:
                found[t] = (seq[k + t - length:k + t], y)
    for t, state in enumerate(found):
        if state is None:
            raise ScriptError(f"answer {seq[k:]!r}: its token {t} needs more than {MAX_CONTEXT} tokens of context; "
                              "this model cannot count through a long run of one repeated stretch")
    return found


def _frequencies(theta, hd):
    return theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)


def _rope():
    """(rope_theta, offset-head pairs, recency pair) for HEAD_DIM: the slowest pair turns by
    RECENCY_SPAN over MAX_POSITION; the others, from 1 rad down, place every offset head."""
    hd = HEAD_DIM
    theta = (RECENCY_SPAN / MAX_POSITION) ** (-hd / (hd - 2))
    half = hd // 2
    return theta, np.arange(half - 1), half - 1


def _offset_weight(theta, pairs, n_offsets):
    """q/k norm weight of the offset heads' dims giving every head a gap of OFFSET_GAP nats."""
    freqs = _frequencies(theta, HEAD_DIM)[pairs]
    d = np.concatenate([np.arange(-n_offsets, 0), np.arange(1, MAX_POSITION + 1)]).astype(np.float64)
    gap = (1 - np.cos(np.outer(d, freqs))).sum(1).min()  # sum_i (1 - cos(theta_i * d)), d != 0
    per_unit = math.sqrt(HEAD_DIM) / len(pairs) * gap  # score gap when the weights are 1
    return math.sqrt(OFFSET_GAP / per_unit)


def _vision(rng, out_hidden):
    """A tiny vision tower (one block, one DeepStack tap) whose mergers output zero."""
    cfg = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": out_hidden,
           "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
           "temporal_patch_size": 2, "num_position_embeddings": 2304, "deepstack_visual_indexes": [0],
           "initializer_range": 0.1, "model_type": "qwen3_vl"}
    E, I, M = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] * 4
    rand = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    w = {"patch_embed.proj.weight": rand(E, 3, 2, 16, 16), "patch_embed.proj.bias": rand(E),
         "pos_embed.weight": rand(cfg["num_position_embeddings"], E)}
    for b in range(cfg["depth"]):
        p = f"blocks.{b}."
        w.update({p + "norm1.weight": np.ones(E, np.float32), p + "norm1.bias": np.zeros(E, np.float32),
                  p + "norm2.weight": np.ones(E, np.float32), p + "norm2.bias": np.zeros(E, np.float32),
                  p + "attn.qkv.weight": rand(3 * E, E), p + "attn.qkv.bias": rand(3 * E),
                  p + "attn.proj.weight": rand(E, E), p + "attn.proj.bias": rand(E),
                  p + "mlp.linear_fc1.weight": rand(I, E), p + "mlp.linear_fc1.bias": rand(I),
                  p + "mlp.linear_fc2.weight": rand(E, I), p + "mlp.linear_fc2.bias": rand(E)})
    for p, norm in (("merger.", E), ("deepstack_merger_list.0.", M)):
        w.update({p + "norm.weight": np.ones(norm, np.float32), p + "norm.bias": np.zeros(norm, np.float32),
                  p + "linear_fc1.weight": rand(M, M), p + "linear_fc1.bias": rand(M),
                  # zero: image and video features are zero, so they never disturb the script
                  p + "linear_fc2.weight": np.zeros((out_hidden, M), np.float32),
                  p + "linear_fc2.bias": np.zeros(out_hidden, np.float32)})
    return cfg, {"model.visual." + k: v for k, v in w.items()}


def write_scripted_checkpoint(folder, answers, default=None):
    """Write a scripted checkpoint into `folder` (created) and return its Path.

    answers: a string (the answer to every prompt) or {trigger: answer} (the answer of the trigger
    that occurs last in the prompt; `default` when none occurs, None = the empty answer). See the
    module docstring for the rules; a script outside them raises ScriptError."""
    from tokenizers import AddedToken

    folder = Path(folder)
    if isinstance(answers, str):
        if default is not None:
            raise ScriptError("default= goes with a {trigger: answer} dict; a single answer is every prompt's")
        script, triggers = [(None, answers)], []
    elif isinstance(answers, dict) and answers:
        script, triggers = list(answers.items()), list(answers)
        if default is not None:
            script.append((None, default))
    else:
        raise ScriptError("answers must be a string or a non-empty {trigger: answer} dict")
    if len(triggers) > MAX_TRIGGERS:
        raise ScriptError(f"{len(triggers)} triggers; at most {MAX_TRIGGERS}")

    tok = _tokenizer()
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    for trigger in triggers:
        _check_trigger(trigger, special, triggers)
    texts = [a for _, a in script]
    for trigger in triggers:
        holder = next((a for a in texts if isinstance(a, str) and trigger in a), None)
        if holder is not None:
            raise ScriptError(f"trigger {trigger!r} occurs in the answer {holder[:40]!r}, where it would win the next turn")
    new = [t for t in triggers if t not in special]
    tok.add_tokens([AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)
                    for t in new])
    trigger_ids = [tok.token_to_id(t) for t in triggers]

    banned = {special[s] for s in (IM_START, IM_END, ENDOFTEXT, *VISION)} | set(trigger_ids)
    prompt = tok.encode(GENERATION_PROMPT).ids
    k = len(prompt)
    rules = []  # (trigger index or None, context tokens oldest first, next token)
    for trigger, text in script:
        g = None if trigger is None else triggers.index(trigger)
        ids = _encode_answer(tok, text, banned)
        rules += [(g, window, y) for window, y in _states(prompt + ids, k)]
    rules = sorted(set((g, tuple(w), y) for g, w, y in rules), key=lambda r: (r[0] is None, r[0] or 0, len(r[1]), r))

    known = sorted({t for _, w, _ in rules for t in w})
    outputs = sorted({y for _, _, y in rules})
    if len(known) > MAX_DISTINCT:
        raise ScriptError(f"the answers use {len(known)} distinct tokens; at most {MAX_DISTINCT}")
    kidx, yidx = {t: i for i, t in enumerate(known)}, {t: i for i, t in enumerate(outputs)}
    n_off = max(len(w) for _, w, _ in rules) - 1
    H, hd, G, nK = n_off + 1, HEAD_DIM, max(len(triggers), 1), len(known)
    feat = lambda j, t: 1 + j * nK + kidx[t]  # noqa: E731  (token t, j positions back; j = 0: the current one)
    trig0 = 1 + (n_off + 1) * nK  # trigger tokens' own directions, and the trigger head's output
    out0 = trig0 + G
    D = out0 + len(outputs)
    V = max(448, -(-(tok.get_vocab_size()) // 64) * 64)
    R = len(rules)
    rescale = 1 / (EPS * math.sqrt(D))  # norm weight that brings an EPS-sized feature back to 1

    theta, pairs, rec = _rope()
    half = hd // 2
    freqs = _frequencies(theta, hd)

    embed = np.zeros((V, D), np.float32)
    embed[:, 0] = 1
    for t in known:
        embed[t, feat(0, t)] = EPS
    for g, t in enumerate(trigger_ids):
        embed[t, trig0 + g] = EPS
    norm_in = np.ones(D, np.float32)
    norm_in[0] = 1 / math.sqrt(D)
    norm_in[1:out0] = rescale

    q = np.zeros((H * hd, D), np.float32)
    kp = np.zeros((H * hd, D), np.float32)
    v = np.zeros((H * hd, D), np.float32)
    o = np.zeros((D, H * hd), np.float32)
    for j in range(1, n_off + 1):
        base = (j - 1) * hd
        q[base + pairs, 0] = np.cos(j * freqs[pairs])
        q[base + half + pairs, 0] = -np.sin(j * freqs[pairs])
        kp[base + pairs, 0] = 1
        for t in known:
            v[base + kidx[t], feat(0, t)] = 1
            o[feat(j, t), base + kidx[t]] = EPS
    base = n_off * hd  # the trigger head
    q[base + rec, 0], q[base + half + rec, 0] = math.cos(RECENCY_PHASE), math.sin(RECENCY_PHASE)
    for g in range(len(triggers)):
        kp[base + rec, trig0 + g] = 1
        v[base + g, trig0 + g] = 1
        o[trig0 + g, base + g] = EPS
    w_off = _offset_weight(theta, pairs, n_off)
    w_rec = math.sqrt(RECENCY_SCALE / math.sqrt(hd))
    qk_norm = np.full(hd, w_off, np.float32)
    qk_norm[[rec, half + rec]] = w_rec

    gate = np.zeros((R, D), np.float32)
    up = np.zeros((R, D), np.float32)
    down = np.zeros((D, R), np.float32)
    for r, (g, window, y) in enumerate(rules):
        needed = [feat(j, t) for j, t in enumerate(reversed(window))]
        if g is not None:
            needed.append(trig0 + g)
        s = min(GATE_SCALE, GATE_FLOOR / (len(needed) + 0.5))
        gate[r, needed] = s
        gate[r, 0] = -s * (len(needed) - 0.5)
        # up = 1 - mismatches: a unit one feature short writes nothing (silu(-s/2) is not 0)
        up[r, needed] = 1
        up[r, 0] = -(len(needed) - 1)
        if g is None and triggers:  # the default answer: only while no trigger is in the prompt
            gate[r, trig0:trig0 + len(triggers)] = -s
            up[r, trig0:trig0 + len(triggers)] = -1
        down[out0 + yidx[y], r] = EPS / _silu(s / 2)
    norm_out = np.ones(D, np.float32)
    norm_out[0] = 1 / math.sqrt(D)
    norm_out[out0:] = rescale
    head = np.zeros((V, D), np.float32)
    for y in outputs:
        head[y, out0 + yidx[y]] = LOGIT
    head[EOS_IDS[0], 0] = STOP_LOGIT

    p = "model.language_model."
    a = p + "layers.0."
    weights = {
        p + "embed_tokens.weight": embed, p + "norm.weight": norm_out, "lm_head.weight": head,
        a + "input_layernorm.weight": norm_in, a + "post_attention_layernorm.weight": norm_in.copy(),
        a + "self_attn.q_proj.weight": q, a + "self_attn.k_proj.weight": kp, a + "self_attn.v_proj.weight": v,
        a + "self_attn.o_proj.weight": o, a + "self_attn.q_norm.weight": qk_norm,
        a + "self_attn.k_norm.weight": qk_norm.copy(),
        a + "mlp.gate_proj.weight": gate, a + "mlp.up_proj.weight": up, a + "mlp.down_proj.weight": down,
    }
    vision_config, vision_weights = _vision(np.random.default_rng(0), D)
    weights.update(vision_weights)
    section = hd // 2 * 5 // 16
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": IMAGE_TOKEN_ID, "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID, "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.57.0",
        "text_config": {
            "model_type": "qwen3_vl_text", "hidden_size": D, "intermediate_size": R, "num_hidden_layers": 1,
            "num_attention_heads": H, "num_key_value_heads": H, "head_dim": hd, "hidden_act": "silu",
            "vocab_size": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": theta,
            "rope_scaling": {"rope_type": "default", "mrope_interleaved": True,
                             "mrope_section": [hd // 2 - 2 * section, section, section]},
            "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 400, "eos_token_id": 402,
        },
        "vision_config": vision_config,
        "scripted": {"answers": answers if isinstance(answers, str) else dict(answers), "default": default},
    }

    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 400, "eos_token_id": EOS_IDS, "pad_token_id": 400, "do_sample": False}, indent=2))
    tok.save(str(folder / "tokenizer.json"))
    for name in SIDECARS:
        shutil.copy(TOKENIZER / name, folder / name)
    return folder
