"""What the plugin keeps of verl's own log-prob pass, per engine, and the index that finds a row in it.

verl's trainers run the actor's ``compute_log_prob`` on the whole batch (with ``calculate_entropy=True``) before
``update_actor``, on the same contiguous DP shards. Inside a :func:`log_prob_pass` block (opened by PATCH
``log_prob_pass_context`` for an actor whose loss is a global mode, :mod:`.patches`), PATCH ``log_prob_pass_keep``
hands every ``BaseEngine.infer_batch`` output of that engine to :func:`after_infer_batch`, which keeps it on this
rank as a :class:`KeptPass`:

* on the host, per response token, the log-prob and, where asked, the entropy and Lp-Reg's proxy log-prob
  (:mod:`.proxy`), rows one after another; per row one offset;
* an index from each row's content digest (:func:`row_digests`: a 128-bit BLAKE2b digest of the whole sequence's
  ``input_ids`` and ``position_ids``, the prompt/response split and the row's temperature) to the row's first
  occurrence in the pass, and the set of digests whose copies got statistics that differ in any bit
  (:attr:`KeptPass.ambiguous`). A look-up decides what such rows mean (:class:`.reuse.Ambiguity`);
* the pass's forward settings (:func:`pass_settings`), which a reuse look-up compares with the prepass's;
* the engine's weights version at the pass (:mod:`.weights`). A *held* pass (``prepass_layout=old``'s entropy,
  Lp-Reg's proxy) outlives the weights bump of the update's first optimizer step; any other is freed by it.

A batch with multi-modal inputs is never kept (the digest does not cover them). Whatever goes wrong while keeping
costs a prepass later (or, for a held pass, a clear error at the update), never verl's pass. Cost: 4 bytes per
response token and kept statistic (fp32), 16 + 8 bytes per row and a Python dict entry; the next pass replaces it.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from tensordict import TensorDict

from .proxy import PROXY_OUTPUT_KEY
from .weights import tracked_state

__all__ = ["KeptPass", "after_infer_batch", "disabled", "forward_settings", "has_media", "is_disabled", "keep",
           "log_prob_pass", "non_tensor", "pass_settings", "row_digests", "split_lengths"]


@dataclass
class KeptPass:
    """What one log-prob pass computed on this rank: per row, the response tokens' statistics (host).

    ``index`` maps a row digest to the row's first occurrence in the pass; ``ambiguous`` holds the digests seen more
    than once whose copies' statistics (any kept field) differ in some bit."""

    version: int
    settings: tuple
    index: dict  # row digest (bytes) -> first row of the pass with that content
    ambiguous: frozenset  # digests of equal rows whose kept statistics differ
    offsets: torch.Tensor  # (rows + 1,) int64: row i's tokens are log_probs[offsets[i]:offsets[i + 1]]
    log_probs: torch.Tensor  # (tokens,) the response tokens' log-probs, rows one after another
    entropy: Optional[torch.Tensor]  # (tokens,) or None
    held: bool = False  # kept for the whole update: a weights bump does not free it
    proxy: Optional[torch.Tensor] = None  # (tokens,) Lp-Reg's log pi_proxy (engine/proxy.py), or None

    @property
    def nbytes(self) -> int:
        tensors = [self.offsets, self.log_probs] + [t for t in (self.entropy, self.proxy) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + 16 * len(self.index)

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


@dataclass(frozen=True)
class _Pass:
    engine: Any
    keep_entropy: bool
    hold: bool = False
    keep: bool = True  # keep the per-token statistics (reuse, held entropy)
    batch_entropy: bool = False  # record the batch-entropy sums (engine/batch_entropy.py)
    keep_proxy: bool = False  # keep Lp-Reg's proxy log-probs (engine/proxy.py); implies hold


_PASS: contextvars.ContextVar[Optional[_Pass]] = contextvars.ContextVar("verl_klcov_global_log_prob_pass",
                                                                         default=None)
_DISABLED = [False]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """No keeping and no reuse inside this block (tests and benchmarks: the prepass every step). Set it on every
    rank alike: the reuse decision's all-reduce is skipped inside. Lp-Reg's proxy is still kept: it has no other
    source."""
    before = _DISABLED[0]
    _DISABLED[0] = True
    try:
        yield
    finally:
        _DISABLED[0] = before


def is_disabled() -> bool:
    """Inside a :func:`disabled` block."""
    return _DISABLED[0]


@contextlib.contextmanager
def log_prob_pass(engine, *, keep_entropy: bool, hold: bool = False, keep: bool = True,
                  batch_entropy: bool = False, keep_proxy: bool = False) -> Iterator[None]:
    """Inside this block, a call of ``engine.infer_batch`` is verl's log-prob pass to keep (:func:`after_infer_batch`).

    ``keep=False``: no per-token statistics are kept; ``batch_entropy``: the pass's batch-entropy sums are recorded
    for a mode with a once-per-trainer-step rule (:mod:`.batch_entropy`, in every ``prepass_layout`` and also inside
    :func:`disabled`, which switches reuse off, not the rule's input).

    ``hold``: keep it for the whole update, until the next pass replaces it (``prepass_layout=old``, whose every
    optimizer step reads pi_old's entropy: :func:`.reuse.held_entropy`); reuse (:func:`.reuse.take`) still needs the
    weights version of the pass, so a held pass is never handed to a step after the first weights bump.

    ``keep_proxy``: the pass also computes Lp-Reg's proxy log-probs (:mod:`.proxy`; the caller sets
    :data:`.proxy.PROXY_REQUEST_KEY` on the batch) and they are kept and held with it (:func:`.reuse.held_proxy`)."""
    token = _PASS.set(_Pass(engine, keep_entropy, hold or keep_proxy, keep or keep_proxy, batch_entropy, keep_proxy))
    try:
        yield
    finally:
        _PASS.reset(token)


def after_infer_batch(engine, data: TensorDict, outputs: Any) -> None:
    """Called by PATCH ``log_prob_pass_keep`` after every ``BaseEngine.infer_batch``: keeps the outputs of a
    log-prob pass opened by :func:`log_prob_pass` for this engine; anything else (the prepass's own forwards,
    other engines, other calls) is left alone. Lp-Reg's proxy key is removed from every output (never verl's)."""
    current = _PASS.get()
    model_output = outputs.get("model_output") if isinstance(outputs, dict) else None
    proxy = model_output.pop(PROXY_OUTPUT_KEY, None) if isinstance(model_output, dict) else None
    if current is None or current.engine is not engine:
        return
    if current.batch_entropy:
        from . import batch_entropy

        batch_entropy.record_pass(engine, data, outputs)  # never raises
    if not current.keep or (_DISABLED[0] and not current.keep_proxy):  # the proxy has no other source
        return
    state = None
    try:  # whatever goes wrong here costs a prepass later, never verl's pass
        state = tracked_state(engine)
        if state is None:
            return
        state.kept = None  # a new pass replaces the previous one, whatever happens below
        state.kept, state.missing = keep(state.version, data, outputs, current.keep_entropy, current.hold,
                                         proxy if current.keep_proxy else None, current.keep_proxy)
    except Exception as error:  # e.g. a layout this code does not know
        if state is not None:
            state.kept = None
            state.missing = f"verl's log-prob pass could not be kept ({type(error).__name__}: {error})"


def keep(version: int, data: TensorDict, outputs: Any, keep_entropy: bool, hold: bool = False,
         proxy: Optional[torch.Tensor] = None, keep_proxy: bool = False) -> tuple[Optional[KeptPass], str]:
    """A :class:`KeptPass` of ``outputs`` (what ``infer_batch`` returned for ``data``), or ``(None, why not)``."""
    from verl.workers.utils.padding import no_padding_2_padding

    model_output = outputs.get("model_output") if isinstance(outputs, dict) else None
    if not model_output or "log_probs" not in model_output:
        return None, "verl's log-prob pass returned no log-probs"
    if has_media(data):
        return None, "verl's log-prob pass had multi-modal inputs (not covered by the row digest)"
    digests = row_digests(data)
    if digests is None:
        return None, "verl's log-prob pass had no nested input_ids/position_ids or no prompts/responses"
    _, response_lens = split_lengths(data)
    response_lens = response_lens.to("cpu", torch.int64)
    values = [no_padding_2_padding(model_output["log_probs"], data)]
    if keep_entropy:
        if "entropy" not in model_output:
            return None, "verl's log-prob pass computed no entropy (calculate_entropy=False)"
        values.append(no_padding_2_padding(model_output["entropy"], data))
    if keep_proxy:
        if proxy is None:
            return None, ("verl's log-prob pass computed no Lp-Reg proxy (PATCH proxy_log_prob_in_pass did not run: "
                          "is the actor verl's FSDP engine?)")
        values.append(no_padding_2_padding(proxy, data))
    inside = torch.arange(values[0].shape[1]).unsqueeze(0) < response_lens.unsqueeze(1)
    flat = [v.detach().to("cpu")[inside] for v in values]
    offsets = torch.zeros(len(digests) + 1, dtype=torch.int64)
    offsets[1:] = response_lens.cumsum(0)
    index, ambiguous = _index(digests, offsets, flat)
    kept = KeptPass(version=version, settings=pass_settings(data), index=index, ambiguous=ambiguous, offsets=offsets,
                    log_probs=flat[0], entropy=flat[1] if keep_entropy else None, held=hold,
                    proxy=flat[-1] if keep_proxy else None)
    return kept, "kept"


def _index(digests: list[bytes], offsets: torch.Tensor, flat: list[torch.Tensor]) -> tuple[dict, frozenset]:
    """Each digest's first row, and the digests whose later copies differ from the first in any kept value."""
    index: dict = {}
    ambiguous = set()
    for row, digest in enumerate(digests):
        first = index.setdefault(digest, row)
        if first != row and digest not in ambiguous and not all(
                torch.equal(f[offsets[row]:offsets[row + 1]], f[offsets[first]:offsets[first + 1]]) for f in flat):
            ambiguous.add(digest)
    return index, frozenset(ambiguous)


# ---------------------------------------------------------------------------------------------
# Rows and forward settings


def non_tensor(data: TensorDict, key: str, default: Any) -> Any:
    """A non-tensor key of ``data`` (verl's ``tensordict_utils.get_non_tensor_data``)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def forward_settings(data: TensorDict) -> tuple:
    """The settings of ``data``'s forward that decide its numerics, micro-batching apart."""
    temperature = data["temperature"] if "temperature" in data.keys() else None
    scalar = None if isinstance(temperature, torch.Tensor) else temperature
    return (("use_remove_padding", bool(non_tensor(data, "use_remove_padding", True))),
            ("use_fused_kernels", bool(non_tensor(data, "use_fused_kernels", False))),
            ("pad_mode", _pad_mode(data)),
            ("temperature", None if scalar is None else float(scalar)))


def _pad_mode(data: TensorDict) -> str:
    value = non_tensor(data, "pad_mode", None)  # verl's DatasetPadMode (a str enum), default NO_PADDING
    return str(getattr(value, "value", value) or "no_padding")


def pass_settings(data: TensorDict) -> tuple:
    """The forward settings of verl's log-prob pass (its batch, with TrainingWorker's keys injected)."""
    dynamic = bool(non_tensor(data, "use_dynamic_bsz", True))
    budget = non_tensor(data, "max_token_len_per_gpu" if dynamic else "micro_batch_size_per_gpu", None)
    return forward_settings(data) + (("use_dynamic_bsz", dynamic), ("budget", budget))


def has_media(data: TensorDict) -> bool:
    """``data`` carries multi-modal inputs (which the row digest does not cover)."""
    if "multi_modal_inputs" not in data.keys():
        return False
    value = data["multi_modal_inputs"]
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    return any(bool(item) for item in items)


def split_lengths(data: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) length of every row, as verl's ``no_padding_2_padding`` reads them."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    attention_mask = data["attention_mask"]
    return (attention_mask[:, : prompts.shape[1]].sum(dim=1), attention_mask[:, prompts.shape[1]:].sum(dim=1))


def _rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.unbind()) if tensor.is_nested else list(tensor)


def row_digests(data: TensorDict) -> Optional[list[bytes]]:
    """One 16-byte BLAKE2b digest per row of its forward's inputs, or None when the layout is not known."""
    keys = data.keys()
    if not all(key in keys for key in ("input_ids", "position_ids", "prompts", "responses")):
        return None
    input_ids, position_ids = data["input_ids"], data["position_ids"]
    if not (input_ids.is_nested and position_ids.is_nested):
        return None
    prompt_lens, response_lens = (t.to("cpu", torch.int64) for t in split_lengths(data))
    temperature = data["temperature"] if "temperature" in keys else None
    per_row_temperature = isinstance(temperature, torch.Tensor) and temperature.numel() == len(prompt_lens)
    ids_rows, position_rows = _rows(input_ids.to("cpu")), _rows(position_ids.to("cpu"))
    if not (len(ids_rows) == len(position_rows) == len(prompt_lens)):
        return None
    temperatures = temperature.reshape(-1).to("cpu", torch.float64) if per_row_temperature else None
    digests = []
    for row, (ids, positions) in enumerate(zip(ids_rows, position_rows)):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(torch.tensor([int(prompt_lens[row]), int(response_lens[row])]).numpy().tobytes())
        for tensor in (ids, positions):
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().numpy())  # the buffer itself, no copy
        if temperatures is not None:
            digest.update(temperatures[row].numpy().tobytes())
        digests.append(digest.digest())
    return digests
