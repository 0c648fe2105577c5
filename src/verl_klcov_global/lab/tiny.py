"""A tiny local Qwen2 model and trainer-shaped actor minibatches (no downloads).

* :func:`build_tiny_model` -- random Qwen2 (~140k params) + a byte-level BPE
  tokenizer trained locally, saved as an HF model directory
  (:func:`build_random_model`: the same for any Qwen2 config, e.g. the GPU kit's 0.5B shape,
  and either tokenizer of :func:`build_tokenizer`: ``"bpe"`` or the 64-id word-level ``"words"``;
  :func:`build_words_model`: the 64-id model the learning experiments train from scratch).
* :func:`build_peaked_model` -- a copy of a model folder with its LM head scaled: a sharper next-token
  distribution (``diagnose``'s policy for the rows of a mode that reads a min-p proxy, Lp-Reg).
* :func:`make_minibatch` -- one actor-update minibatch shaped exactly as verl
  0.9.1 hands it to ``TrainingWorker.train_batch`` / ``engine.train_batch``,
  in the v1-trainer layout (every per-sample field nested/jagged) or the
  legacy-trainer layout (``input_ids``/``position_ids`` nested, response-level
  fields padded ``(bsz, resp_len)``).
* :func:`compute_current_log_probs`, :func:`set_micro_batching`,
  :func:`shard_for_rank`, :func:`make_actor_config`.

Layouts (verl 0.9.1):

legacy (``trainer.use_v1=False``, ``trainer/ppo/ray_trainer.py``
``_update_actor`` ~1327): ``DataProto.to_tensordict()`` ->
``workers/utils/padding.py left_right_2_no_padding`` (~23). Nested:
``input_ids``, ``position_ids``. Padded: ``prompts`` (B, P) left-padded,
``responses``/``response_mask``/``loss_mask``/``old_log_probs``/
``advantages``/[``rollout_is_weights``, ``ref_log_prob``] (B, R),
``attention_mask`` (B, P+R). Non-tensor: ``max_seq_len``,
``max_response_len``, ``indices`` (from the conversion), ``uid`` (stack),
``temperature``, ``multi_turn`` (meta_info).

v1 (default, ``trainer/ppo/v1/trainer_base.py``): samples are stored per
sample in TransferQueue (``agent_loop_tq.py`` ~182: ``prompts``,
``responses``, ``response_mask``, ``loss_mask``, ``input_ids``,
``position_ids``) and response-level results are written back nested
(``response_from_nested`` for ``old_log_probs`` ~1667, ``response_to_nested``
for ``advantages``/``rollout_is_weights`` ~1797; ``ref_log_prob`` ~1716). No
``attention_mask``, no ``max_seq_len``/``max_response_len``/``indices``.

Both then get (trainer, ``_update_actor``): ``calculate_entropy``,
``distillation_use_topk``, ``distillation_only``, ``global_batch_size``,
``temperature`` [+ ``compute_loss`` in legacy]; (``TrainingWorker.
train_mini_batch`` ~307): ``global_token_num``, ``update_lr_scheduler``,
``disable_auto_offload``; (``TrainingWorker.train_batch`` ~352):
``use_remove_padding``, ``use_dynamic_bsz``, ``max_token_len_per_gpu``,
``micro_batch_size_per_gpu``, ``use_fused_kernels``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Optional

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict
from verl.utils.model import compute_position_id_with_mask

from ..layout import fit_width

__all__ = [
    "TINY_MODEL_KWARGS",
    "PAD_TOKEN",
    "EOS_TOKEN",
    "WORDS_MODEL_KWARGS",
    "WORDS_VOCAB_SIZE",
    "TOKENIZERS",
    "build_tokenizer",
    "build_tiny_model",
    "build_words_model",
    "build_random_model",
    "build_peaked_model",
    "make_minibatch",
    "compute_current_log_probs",
    "set_micro_batching",
    "shard_for_rank",
    "make_actor_config",
]

TINY_MODEL_KWARGS = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)
#: The ``"words"`` tokenizer's model (:func:`build_words_model`): the learning experiments' 64-id Qwen2.
WORDS_VOCAB_SIZE = 64
WORDS_MODEL_KWARGS = dict(TINY_MODEL_KWARGS, vocab_size=WORDS_VOCAB_SIZE, max_position_embeddings=64)
PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"  # the "words" tokenizer's
_WORDS = ["user", "assistant", "system", "What", "is", "+", "?"] + [str(d) for d in range(10)]
_SPECIAL_TOKENS = [PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN]  # ids 0, 1, 2
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 35? The answer is 47.",
    "Let x be the number of apples. Then 3x + 4 = 19, so x = 5.",
    "def add(a, b):\n    return a + b\n",
    "Question: how many legs does a spider have?\nAnswer: 8\n",
    "Reinforcement learning from verifiable rewards uses a policy gradient.",
    "The covariance between advantage and log-probability selects tokens.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "user\nSolve the equation.\nassistant\nFirst, subtract 4 from both sides.\n",
    "#### 42\n",
]


# ---------------------------------------------------------------------------
# Model + tokenizer
# ---------------------------------------------------------------------------


def _bpe_tokenizer(vocab_size: int = 400):
    """Byte-level BPE (``tokenizers``) trained on a few lines, as a fast HF tokenizer.

    ``"\\n"`` is a single token (byte-level alphabet), ids 0/1/2 are
    ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _words_tokenizer():
    """A word-level fast tokenizer of exactly :data:`WORDS_VOCAB_SIZE` ids: 4 special tokens (pad, im_start,
    eos, unk), the learning prompts' words and single digits, then fillers ``<|t..|>``. Whitespace (also
    ``\\n``) only separates words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN, UNK_TOKEN] + _WORDS
    names += [f"<|t{i}|>" for i in range(len(names), WORDS_VOCAB_SIZE)]
    tok = Tokenizer(models.WordLevel(vocab={name: i for i, name in enumerate(names)}, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens([PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN, UNK_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=UNK_TOKEN)
    fast.chat_template = _CHAT_TEMPLATE
    if len(fast) != WORDS_VOCAB_SIZE:
        raise RuntimeError(f"the word-level tokenizer has {len(fast)} ids, expected {WORDS_VOCAB_SIZE}")
    return fast


_TOKENIZER_BUILDERS = {"bpe": _bpe_tokenizer, "words": _words_tokenizer}
#: The tokenizers :func:`build_tokenizer` and :func:`build_random_model` know.
TOKENIZERS = tuple(_TOKENIZER_BUILDERS)


def build_tokenizer(tokenizer: str = "bpe"):
    """A local fast HF tokenizer with the chat template (no downloads); ids 0/1/2 are pad, ``<|im_start|>``, eos.

    ``"bpe"``: byte-level BPE of 400 ids trained on a few lines (every text encodes; the tiny model's).
    ``"words"``: word-level, exactly :data:`WORDS_VOCAB_SIZE` (64) ids -- pad, im_start, eos, ``<|unk|>``,
    the words ``user assistant system What is + ?`` and the 10 digits (ids 4-20), then fillers
    ``<|t21|>`` .. ``<|t63|>`` (the learning task's target set is among them).
    """
    if tokenizer not in _TOKENIZER_BUILDERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    return _TOKENIZER_BUILDERS[tokenizer]()


def build_tiny_model(path: str, seed: int = 0) -> str:
    """Write a random tiny Qwen2 + tokenizer + generation config to ``path``.

    Model: ``TINY_MODEL_KWARGS`` (hidden 64, 2 layers, 4 heads / 2 kv heads,
    vocab 512), fp32 safetensors, weights from ``torch.manual_seed(seed)``.
    Idempotent: returns immediately when ``path/config.json`` exists. Built in
    a sibling temp dir and renamed, so concurrent callers are safe.
    """
    return build_random_model(path, TINY_MODEL_KWARGS, seed=seed)


def build_words_model(path: str, seed: int = 0) -> str:
    """Write the random Qwen2 of :data:`WORDS_MODEL_KWARGS` (vocab 64, hidden 64, 2 layers, 4 heads / 2 kv
    heads, 82,496 parameters, fp32; weights from ``torch.manual_seed(seed)``) with the ``"words"``
    tokenizer to ``path``: the model the learning experiments train from scratch. Idempotent and safe
    for concurrent callers, like :func:`build_tiny_model`."""
    return build_random_model(path, WORDS_MODEL_KWARGS, seed=seed, tokenizer="words")


def build_random_model(
    path: str, model_kwargs: dict[str, Any], *, seed: int = 0, tokenizer: str = "bpe",
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> str:
    """Write a random Qwen2 of config ``model_kwargs`` (``Qwen2Config`` fields) + a local tokenizer to ``path``.

    ``tokenizer``: ``"bpe"`` (400 ids) or ``"words"`` (64 ids), see :func:`build_tokenizer`;
    ``vocab_size`` must be at least its ids. Weights are initialised on ``device`` (a GPU makes a
    0.5B model in seconds) after ``torch.manual_seed(seed)`` and saved in ``dtype``. Idempotent and
    safe for concurrent callers, like :func:`build_tiny_model`.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    def write(folder: str) -> None:
        tok = build_tokenizer(tokenizer)
        if len(tok) > model_kwargs["vocab_size"]:
            raise ValueError(f"vocab_size {model_kwargs['vocab_size']} < the {tokenizer!r} tokenizer's {len(tok)} ids")
        ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
        config = Qwen2Config(**model_kwargs, **ids)
        config.architectures = ["Qwen2ForCausalLM"]
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
        model.to(device="cpu", dtype=dtype).save_pretrained(folder)
        tok.save_pretrained(folder)
        GenerationConfig(**ids).save_pretrained(folder)

    return _write_model_folder_once(path, ".tiny_qwen2_", write)


def build_peaked_model(path: str, source: str, scale: float) -> str:
    """Write ``source`` (an HF Qwen2 folder) to ``path`` with its LM head's weights multiplied by ``scale``.

    The logits are the source's times ``scale``: the same ranking of next tokens, a sharper distribution (the tiny
    model's is near-uniform: max / median p about 1.6). Tokenizer and configs are copied. Idempotent and safe for
    concurrent callers, like :func:`build_tiny_model`.
    """
    from transformers import AutoModelForCausalLM

    def write(folder: str) -> None:
        shutil.copytree(source, folder, dirs_exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if getattr(model.config, "tie_word_embeddings", False):
            raise ValueError(f"{source}: the LM head is tied to the input embeddings; scaling it would scale them too")
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
        model.save_pretrained(folder)

    return _write_model_folder_once(path, ".peaked_qwen2_", write)


def _write_model_folder_once(path: str, prefix: str, write) -> str:
    """``path``, written by ``write(folder)`` into a temporary folder beside it and renamed into place, unless it
    already holds a ``config.json``: idempotent and safe for concurrent callers (the first rename wins, the others'
    folders are removed)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        write(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.exists(os.path.join(path, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------
# Minibatches
# ---------------------------------------------------------------------------


def _lengths(gen: torch.Generator, n: int, full: int, lo: int, vary: bool) -> torch.Tensor:
    """(n,) int64 lengths in [lo, full]; all ``full`` when not ``vary``."""
    if not vary:
        return torch.full((n,), full, dtype=torch.long)
    lens = torch.randint(max(1, lo), full + 1, (n,), generator=gen)
    lens[0] = full  # keep the padded width tight
    return lens


def _grpo_advantages(gen: torch.Generator, bsz: int, resp_len: int, group_size: int, noise: float) -> torch.Tensor:
    """(bsz, resp_len) GRPO-like advantages: group-normalised per-sequence
    scores broadcast over tokens, plus ``noise`` * N(0, 1) per token."""
    g = group_size if group_size > 1 and bsz % group_size == 0 else 1
    scores = torch.randn(bsz // g, g, generator=gen)
    if g > 1:
        scores = (scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)
    return scores.reshape(bsz, 1) + noise * torch.randn(bsz, resp_len, generator=gen)


def _padded_sample(
    *, batch_size: int, prompt_len: int, response_len: int, vary_lengths: bool, seed: int, vocab_size: int,
    pad_token_id: int, group_size: int, advantage_noise: float, min_response_len: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Left-padded prompts (B, P), right-padded responses (B, R) and masks,
    position_ids (B, P+R), advantages (B, R); all from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    p_lens = _lengths(gen, batch_size, prompt_len, prompt_len // 2, vary_lengths)
    r_min = response_len // 4 if min_response_len is None else min_response_len
    r_lens = _lengths(gen, batch_size, response_len, r_min, vary_lengths)
    prompts = torch.randint(len(_SPECIAL_TOKENS), vocab_size, (batch_size, prompt_len), generator=gen)
    responses = torch.randint(len(_SPECIAL_TOKENS), vocab_size, (batch_size, response_len), generator=gen)
    cols_p, cols_r = torch.arange(prompt_len), torch.arange(response_len)
    prompt_mask = (cols_p.unsqueeze(0) >= (prompt_len - p_lens).unsqueeze(1)).long()
    response_mask = (cols_r.unsqueeze(0) < r_lens.unsqueeze(1)).long()
    prompts = prompts.masked_fill(prompt_mask == 0, pad_token_id)
    responses = responses.masked_fill(response_mask == 0, pad_token_id)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = compute_position_id_with_mask(attention_mask)
    advantages = _grpo_advantages(gen, batch_size, response_len, group_size, advantage_noise) * response_mask
    return dict(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        advantages=advantages.float(),
    )


def _log_prob_fields(
    t: dict[str, torch.Tensor], *, seed: int, log_probs: Optional[torch.Tensor], noise: float,
    with_rollout_is_weights: bool, with_ref_log_prob: bool,
) -> dict[str, torch.Tensor]:
    """old_log_probs = log_probs + N(0, noise) (B, R), optional IS weights /
    ref log-probs; masked by response_mask. Own RNG (seed + 1)."""
    mask = t["response_mask"]
    bsz, width = mask.shape
    gen = torch.Generator().manual_seed(seed + 1)
    base = torch.zeros(bsz, width) if log_probs is None else fit_width(log_probs.detach().float().cpu(), width)
    out = {"old_log_probs": (base + noise * torch.randn(bsz, width, generator=gen)) * mask}
    if with_rollout_is_weights:
        out["rollout_is_weights"] = (0.5 + torch.rand(bsz, width, generator=gen)) * mask
    if with_ref_log_prob:
        out["ref_log_prob"] = (base + noise * torch.randn(bsz, width, generator=gen)) * mask
    return out


def _legacy_td(t: dict[str, torch.Tensor], uid: np.ndarray, temperature: float) -> TensorDict:
    """Legacy trainer: DataProto -> TensorDict -> left_right_2_no_padding."""
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    from .cpu import ensure_padding_utils_without_flash_attn

    ensure_padding_utils_without_flash_attn()  # verl 0.8 imports flash-attn here; 0.9.1 has a torch fallback
    proto = DataProto.from_dict(
        tensors=t, non_tensors={"uid": uid}, meta_info={"temperature": temperature, "multi_turn": False}
    )
    return left_right_2_no_padding(proto.to_tensordict())


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _v1_td(t: dict[str, torch.Tensor], uid: np.ndarray, temperature: float) -> TensorDict:
    """v1 trainer: every per-sample field nested (jagged), as read back from
    TransferQueue; no attention_mask / max_seq_len / indices."""
    from verl.utils import tensordict_utils as tu

    am, rm = t["attention_mask"].bool(), t["response_mask"].bool()
    plen = t["prompts"].shape[1]
    rows: dict[str, Any] = {
        "prompts": _jagged([p[m] for p, m in zip(t["prompts"], am[:, :plen])]),
        "responses": _jagged([r[m] for r, m in zip(t["responses"], rm)]),
        "input_ids": _jagged([x[m] for x, m in zip(t["input_ids"], am)]),
        "position_ids": _jagged([x[m] for x, m in zip(t["position_ids"], am)]),
    }
    resp_keys = ["response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_prob"]
    for key in [k for k in resp_keys if k in t]:
        rows[key] = _jagged([x[m] for x, m in zip(t[key], rm)])
    rows["loss_mask"] = rows["response_mask"]  # agent_loop_tq: field["loss_mask"] = field["response_mask"]
    rows["uid"] = list(uid)
    return tu.get_tensordict(rows, non_tensor_dict={"temperature": temperature})


def make_minibatch(
    *,
    batch_size: int = 64,
    prompt_len: int = 16,
    response_len: int = 128,
    vary_lengths: bool = False,
    seed: int = 0,
    vocab_size: int = 512,
    layout: str = "v1",
    with_rollout_is_weights: bool = False,
    with_ref_log_prob: bool = False,
    old_log_prob_noise: float = 0.05,
    log_probs: Optional[torch.Tensor] = None,
    group_size: int = 8,
    advantage_noise: float = 0.1,
    temperature: float = 1.0,
    global_batch_size: Optional[int] = None,
    use_remove_padding: bool = False,
    use_dynamic_bsz: bool = False,
    micro_batch_size_per_gpu: int = 8,
    max_token_len_per_gpu: int = 2048,
    calculate_entropy: bool = False,
    pad_token_id: int = 0,
    min_response_len: Optional[int] = None,
    tokens: Optional[dict[str, torch.Tensor]] = None,
) -> TensorDict:
    """One actor-update minibatch (B = ``batch_size`` rows) in verl's layout.

    Tokens, lengths and advantages depend only on ``seed``; the
    ``old_log_probs`` noise uses ``seed + 1``. ``old_log_probs`` =
    ``log_probs`` (B, <=R, e.g. :func:`compute_current_log_probs` of the same
    batch; zeros when None) + N(0, ``old_log_prob_noise``).

    Per-row sizes: prompt P_i <= ``prompt_len``, response R_i <=
    ``response_len`` (all full unless ``vary_lengths``; then responses are drawn
    from [``min_response_len``, ``response_len``], default minimum ``response_len // 4``). ``layout``: "v1" or
    "legacy" (see module docstring). ``global_batch_size`` defaults to B (the
    global minibatch; keep it when sharding). The micro-batching keys are
    those ``TrainingWorker.train_batch`` injects; change them with
    :func:`set_micro_batching`.

    ``tokens``: a rollout's padded fields instead of random ids (``SampledBatch.tokens()`` of
    :mod:`.sampling`: prompts, responses, input_ids, attention_mask, position_ids, response_mask);
    ``batch_size``, ``prompt_len``, ``response_len`` and the lengths are then theirs, and the
    advantages are still the random group scores drawn from ``seed``.
    """
    from verl.utils import tensordict_utils as tu

    if layout not in ("v1", "legacy"):
        raise ValueError(f"layout must be 'v1' or 'legacy', got {layout!r}")
    if tokens is not None:
        t = dict(tokens)
        batch_size, response_len = t["responses"].shape
        gen = torch.Generator().manual_seed(seed)
        t["advantages"] = (_grpo_advantages(gen, batch_size, response_len, group_size, advantage_noise)
                           * t["response_mask"]).float()
    else:
        t = _padded_sample(
            batch_size=batch_size, prompt_len=prompt_len, response_len=response_len, vary_lengths=vary_lengths,
            seed=seed, vocab_size=vocab_size, pad_token_id=pad_token_id, group_size=group_size,
            advantage_noise=advantage_noise, min_response_len=min_response_len,
        )
    t.update(
        _log_prob_fields(
            t, seed=seed, log_probs=log_probs, noise=old_log_prob_noise,
            with_rollout_is_weights=with_rollout_is_weights, with_ref_log_prob=with_ref_log_prob,
        )
    )
    uid = np.array([f"seed{seed}-group{i // max(1, group_size)}" for i in range(batch_size)], dtype=object)
    td = _legacy_td(t, uid, temperature) if layout == "legacy" else _v1_td(t, uid, temperature)
    tu.assign_non_tensor(
        td,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=batch_size if global_batch_size is None else global_batch_size,
        compute_loss=True,
        global_token_num=NonTensorData(t["attention_mask"].sum(-1).tolist()),
        update_lr_scheduler=True,
        disable_auto_offload=True,
        use_fused_kernels=False,
    )
    return set_micro_batching(
        td, use_dynamic_bsz=use_dynamic_bsz, micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        max_token_len_per_gpu=max_token_len_per_gpu, use_remove_padding=use_remove_padding,
    )


def set_micro_batching(
    td: TensorDict,
    *,
    use_dynamic_bsz: bool,
    micro_batch_size_per_gpu: Optional[int] = None,
    max_token_len_per_gpu: Optional[int] = None,
    use_remove_padding: Optional[bool] = None,
) -> TensorDict:
    """Override the micro-batching non-tensor keys in place; returns ``td``.

    ``None`` leaves a key as it is. ``use_remove_padding`` should match the
    engine's own flag (it decides verl's model monkey patch at build time).
    """
    from verl.utils import tensordict_utils as tu

    values = dict(
        use_dynamic_bsz=use_dynamic_bsz,
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        max_token_len_per_gpu=max_token_len_per_gpu,
        use_remove_padding=use_remove_padding,
    )
    tu.assign_non_tensor(td, **{k: v for k, v in values.items() if v is not None})
    needed = "max_token_len_per_gpu" if use_dynamic_bsz else "micro_batch_size_per_gpu"
    if tu.get_non_tensor_data(td, needed, None) is None:
        raise ValueError(f"{needed} must be set when use_dynamic_bsz={use_dynamic_bsz}")
    return td


def shard_for_rank(td: TensorDict, rank: int, world_size: int) -> TensorDict:
    """Rows [rank*B/W, (rank+1)*B/W) of ``td``: the contiguous DP shard verl's
    dispatch hands rank ``rank`` (``tu.chunk_tensordict``). Non-tensor keys
    are kept unchanged (``global_batch_size``/``global_token_num`` stay global)."""
    from verl.utils import tensordict_utils as tu

    if len(td) % world_size:
        raise ValueError(f"batch of {len(td)} rows does not split over {world_size} ranks")
    return tu.chunk_tensordict(td, world_size)[rank]


def compute_current_log_probs(engine, td: TensorDict) -> torch.Tensor:
    """Current log-probs of the responses in ``td``: (B, R_pad) float32.

    Runs ``engine.infer_batch`` (no grad, eval mode) on a shallow copy with the
    batch's micro-batching keys, then ``no_padding_2_padding``; columns align
    with the padded ``response_mask`` (R_pad = padded width in legacy, max
    response length in v1). Collective when world size > 1.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    data = td.copy()
    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False)
    with engine.eval_mode():
        out = engine.infer_batch(data)
    return no_padding_2_padding(out["model_output"]["log_probs"], data).float()


# ---------------------------------------------------------------------------
# Actor config
# ---------------------------------------------------------------------------


def make_actor_config(
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    **overrides: Any,
):
    """A valid verl ``FSDPActorConfig`` for engine-level ``ppo_loss`` calls.

    The trainer builds the same class via ``omega_conf_to_dataclass(actor)``.
    Defaults: strategy "fsdp", rollout_n 1, ppo_mini_batch_size 64,
    ppo_micro_batch_size_per_gpu 8. An override that is a field of verl's ``PolicyLossConfig`` and not of the actor
    config (e.g. ``kl_cov_ratio``) goes to the ``policy_loss`` built from ``loss_mode``, with ``ppo_kl_coef`` 1.0
    (the KL-Cov paper's, not verl's 0.1) unless given; the other overrides go to ``FSDPActorConfig``. A
    ``policy_loss`` override replaces the built one.
    """
    import dataclasses

    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    actor_fields = {field.name for field in dataclasses.fields(FSDPActorConfig)}
    loss_fields = {field.name for field in dataclasses.fields(PolicyLossConfig)} - actor_fields
    policy_loss_knobs = {"ppo_kl_coef": 1.0}
    policy_loss_knobs.update({key: overrides.pop(key) for key in list(overrides) if key in loss_fields})
    kwargs: dict[str, Any] = dict(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=64,
        ppo_micro_batch_size_per_gpu=8,
        loss_agg_mode=loss_agg_mode,
        entropy_coeff=entropy_coeff,
        use_kl_loss=use_kl_loss,
        use_torch_compile=False,
    )
    kwargs.update(overrides)
    if "policy_loss" not in kwargs:
        kwargs["policy_loss"] = PolicyLossConfig(loss_mode=loss_mode, **policy_loss_knobs)
    return FSDPActorConfig(**kwargs)
