"""flashtile as a Hugging Face ``transformers`` attention backend.

Importing this module registers the backend under the name ``"flashtile"`` (again on every
:func:`register` call, harmlessly)::

    import flashtile.integrations.transformers  # noqa: F401  (registers "flashtile")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flashtile")

Two things are registered:

* an attention function (``transformers.AttentionInterface``, or the ``ALL_ATTENTION_FUNCTIONS``
  dict of transformers < 4.50) that the model's attention layers call with
  ``(batch, heads, seq, dim)`` query / key / value and get ``(batch, seq, heads, dim)`` back;
* on transformers >= 4.53, a mask builder (``transformers.masking_utils.AttentionMaskInterface``).
  Without one, transformers hands a custom backend *no mask at all* -- a padded batch would be
  silently wrong -- so the builder gives the attention function the cheapest exact description
  of the mask: ``None`` (plain causal / bidirectional attention), a 2-D ``(batch, keys)``
  boolean padding mask (the model's own causal or sliding-window pattern applies on top), or,
  for any pattern it does not recognise (packed sequences, image-token overlays, chunked
  attention, ...), transformers' own 4-D boolean mask.

What the attention function does with each (bottom-right alignment is right for a KV cache:
the queries are always the last positions of the keys):

=============================  ===============================================================
mask                           path
=============================  ===============================================================
``None``                       :func:`flashtile.flash_attn_func` on transposed views (no copy);
                               causal from ``module.is_causal``, window from ``sliding_window``
``None`` + ``cu_seq_lens_q/k``  :func:`flashtile.flash_attn_varlen_func` on the packed batch
and ``max_length_q/k`` kwargs  (padding-free training, as transformers' flash-attention path)
2-D padding mask               real tokens packed with :func:`flashtile.unpad_input`, then the
                               variable-length kernels, then :func:`flashtile.pad_input`
                               (padded query rows give zeros)
4-D mask (transformers < 4.53  if it is exactly "causal and key padding": the 2-D path above;
gives one to every custom      otherwise :func:`flashtile.scaled_dot_product_attention` with the
backend; additive float masks  boolean mask (itself exact, the slow path for general masks), or,
with ``finfo.min`` are read    with ``softcap`` / ``position_bias`` / a real float bias, plain
as boolean)                    PyTorch math in float32
=============================  ===============================================================

Under ``torch.compile`` nothing may read a mask's values on the host, so a padding or 4-D
mask takes the PyTorch-math path there; without a mask the kernels are traced as custom ops
(no graph break).  GQA needs no ``repeat_kv``: the kernels read ``nheads_k`` dividing
``nheads`` directly.  ``output_attentions`` gives ``None`` weights (they are never formed);
attention sinks (``s_aux``) and ``head_mask`` raise ``NotImplementedError``.
"""

from __future__ import annotations

import logging

import torch

try:
    import transformers
except ImportError as exc:  # pragma: no cover - exercised only without the optional extra
    raise ImportError(
        "flashtile.integrations.transformers needs the `transformers` package (>= 4.48): "
        "pip install 'flashtile[hf]'"
    ) from exc

try:  # transformers >= 4.53 builds masks through a per-backend interface
    from transformers import masking_utils as _masking_utils
except ImportError:
    _masking_utils = None

from flashtile.interface import flash_attn_func, flash_attn_varlen_func
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.masking import mask_array
from flashtile.padding import pad_input, unpad_input
from flashtile.sdpa import scaled_dot_product_attention
from flashtile.validation.transformers import (
    check_sliding_window,
    check_transformers_inputs,
    check_transformers_mask,
    check_transformers_padding,
)

__all__ = ["ATTENTION_NAME", "flashtile_attention_forward", "flashtile_mask", "register"]

ATTENTION_NAME = "flashtile"

_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _log.warning(message)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# --------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------


def flashtile_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol, computed by flashtile.

    Args:
        module: the calling attention layer (its ``is_causal`` is read).
        query: ``(batch, heads, seq_q, dim)``; key, value: ``(batch, heads_kv, seq_k, dim)``.
        attention_mask: ``None``, a 2-D ``(batch, keys)`` padding mask (from :func:`flashtile_mask`),
            or a 4-D boolean / additive mask ``(batch or 1, 1 or heads, seq_q, seq_k)``.
        scaling: score scale (default ``dim ** -0.5``); dropout: attention dropout probability
            (transformers passes 0 outside training); sliding_window: the layer's window size in
            tokens (causal: query ``i`` sees keys ``i - sliding_window < j <= i``; bidirectional:
            ``|i - j| < sliding_window``, as transformers' flash-attention path); softcap: tanh cap of
            the scores; is_causal: overrides ``module.is_causal``.
        kwargs: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``
            (packed batch), ``position_bias`` (an additive score bias), the rest is ignored.

    Returns:
        ``(attn_output (batch, seq_q, heads, dim), None)``.
    """
    check_transformers_inputs(query, key, value, kwargs)
    if kwargs.get("output_attentions", False):
        _warn_once("the flashtile attention backend never forms the attention weights: output_attentions gives None")

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scale = None if scaling is None else float(scaling)
    dropout = float(dropout or 0.0)
    softcap = float(softcap or 0.0)
    window = _window(causal, sliding_window)
    position_bias = kwargs.get("position_bias")
    options = {"scale": scale, "dropout": dropout, "softcap": softcap}

    if position_bias is not None:
        # An additive bias per (head, query, key): only the materialising path can add it.
        keep, bias = _dense_mask(attention_mask, query.shape[2], key.shape[2], causal, window, query.device)
        bias = position_bias if bias is None else bias + position_bias
        return _math_attention(query, key, value, keep, bias, **options), None

    if attention_mask is None:
        packed = _packed_kwargs(kwargs)
        if packed is not None:
            return _attend_packed(query, key, value, packed, causal, window, **options), None
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        out = flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scale, causal=causal, window_size=window,
                              softcap=softcap)
        return out, None

    check_transformers_mask(attention_mask)
    if attention_mask.dim() == 2:
        return _attend_padded(query, key, value, attention_mask.bool(), causal, window, **options), None
    return _attend_4d(query, key, value, attention_mask, causal, window, **options), None


def _window(causal: bool, sliding_window) -> tuple[int, int]:
    """transformers' ``sliding_window`` (a size in tokens) as flashtile's ``(left, right)`` window."""
    size = check_sliding_window(sliding_window)
    if size is None:
        return (-1, -1)
    # transformers' attention-function convention (its flash-attention path): the window spans
    # size - 1 keys on each side it opens, i.e. causal i - size < j <= i, bidirectional
    # |i - j| < size.  Models whose bidirectional mask is |i - j| <= w pass size = w + 1.
    return (size - 1, 0) if causal else (size - 1, size - 1)


def _band(seqlen_q: int, seqlen_k: int, window, device) -> torch.Tensor:
    """``(seqlen_q, seqlen_k)`` bottom-right aligned causal / window visibility."""
    left, right = window
    return mask_array(seqlen_q, seqlen_k, left, max(right, 0), xp=torch, device=device)


def _packed_kwargs(kwargs):
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    values = [kwargs.get(n) for n in names]
    return None if any(v is None for v in values) else values


def _attend_packed(query, key, value, packed, causal, window, scale, dropout, softcap):
    """A padding-free batch (sequences concatenated along seq, batch 1) described by cu_seqlens."""
    cu_q, cu_k, max_q, max_k = packed
    batch, heads, seqlen_q, dim = query.shape
    q = query.transpose(1, 2).reshape(-1, heads, dim)
    k = key.transpose(1, 2).reshape(-1, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(-1, value.shape[1], dim)
    out = flash_attn_varlen_func(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k),
                                 dropout_p=dropout, softmax_scale=scale, causal=causal, window_size=window,
                                 softcap=softcap)
    return out.reshape(batch, seqlen_q, heads, dim)


def _attend_padded(query, key, value, key_keep, causal, window, scale, dropout, softcap):
    """2-D ``(batch, n)`` padding mask over the first ``n`` keys (``n`` < seq_k: the rest lie after
    the last query, e.g. the unwritten slots of a static cache, and are never visible)."""
    batch, heads, seqlen_q, dim = query.shape
    seqlen_k = key.shape[2]
    visible = key_keep.shape[1]
    check_transformers_padding(key_keep, batch, seqlen_q, seqlen_k, causal)
    key, value = key[:, :, :visible], value[:, :, :visible]
    # A bidirectional window depends on where each real key sits, which packing loses (the packed
    # call aligns queries to the real keys from the bottom right): materialise the mask instead.
    if _compiling() or (not causal and window != (-1, -1)):
        # Packing needs data-dependent shapes; materialise the mask instead (exact, slower).
        keep, _ = _dense_mask(key_keep, seqlen_q, visible, causal, window, query.device)
        return _math_attention(query, key, value, keep, None, scale, dropout, softcap)

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    packed_k, kept_k, cu_k, max_k = unpad_input(k, key_keep)
    packed_v = v.reshape(-1, *v.shape[2:])[kept_k]
    if causal:
        # The queries are the last seq_q of these key positions: a padded query is dropped too,
        # and the bottom-right alignment then matches each real query with its own key.
        packed_q, kept_q, cu_q, max_q = unpad_input(q, key_keep[:, visible - seqlen_q:])
    else:
        # Without causality every query row (padding or not) attends to the real keys, as eager does.
        packed_q = q.reshape(batch * seqlen_q, heads, dim)
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        max_q = seqlen_q
    out = flash_attn_varlen_func(packed_q, packed_k, packed_v, cu_q, cu_k, max_q, max_k, dropout_p=dropout,
                                 softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    if causal:
        return pad_input(out, kept_q, batch, seqlen_q)
    return out.reshape(batch, seqlen_q, heads, dim)


def _dense_mask(attention_mask, seqlen_q, seqlen_k, causal, window, device):
    """Any mask this backend receives as ``(keep, bias)`` over all ``seqlen_k`` keys, broadcastable
    to ``(batch, heads, seqlen_q, seqlen_k)``, for the materialising path (either may be None)."""
    banded = causal or window != (-1, -1)
    if attention_mask is None:
        return (_band(seqlen_q, seqlen_k, window, device)[None, None] if banded else None), None
    if attention_mask.dim() == 4:
        mask = _as_keep_or_bias(attention_mask, seqlen_k)
        return (mask, None) if mask.dtype == torch.bool else (None, mask)
    key_keep = attention_mask.bool()  # 2-D padding over the first n keys; the rest are never visible
    visible = key_keep.shape[1]
    keep = key_keep[:, None, None, :]
    if banded:
        keep = keep & _band(seqlen_q, visible, window, device)
    if visible < seqlen_k:
        keep = torch.nn.functional.pad(keep, (0, seqlen_k - visible), value=False)
    return keep, None


def _as_keep_or_bias(mask: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """A 4-D mask, cut to the keys, as booleans (True = may attend) when it is 0 / "minus infinity"
    valued -- transformers' additive masks use ``finfo(dtype).min`` -- else as the float bias it is."""
    mask = mask[..., :seqlen_k]
    if mask.dtype == torch.bool or _compiling():
        return mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if bool((blocked | (mask == 0)).all()):
        return ~blocked
    return mask


def _attend_4d(query, key, value, mask, causal, window, scale, dropout, softcap):
    """A 4-D mask already holds the whole pattern (causal, window, padding, ...)."""
    mask = _as_keep_or_bias(mask, key.shape[2])
    if mask.dtype != torch.bool or _compiling():
        return _math_attention(query, key, value, mask if mask.dtype == torch.bool else None,
                               None if mask.dtype == torch.bool else mask, scale, dropout, softcap)
    if causal:
        key_keep = _causal_key_padding(mask, query.shape[2], key.shape[2], window)
        if key_keep is not None:
            if key_keep.shape[1] == key.shape[2] and bool(key_keep.all()):
                return _attention_dense(query, key, value, True, window, scale, dropout, softcap)
            return _attend_padded(query, key, value, key_keep, True, window, scale, dropout, softcap)
    if softcap:
        return _math_attention(query, key, value, mask, None, scale, dropout, softcap)
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                       enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _attention_dense(query, key, value, causal, window, scale, dropout, softcap):
    return flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout,
                           softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)


def _causal_key_padding(keep: torch.Tensor, seqlen_q: int, seqlen_k: int, window) -> torch.Tensor | None:
    """``(batch, n)`` key padding over the first ``n`` keys if ``keep`` is exactly "bottom-right
    causal and key padding" there (nothing visible past key ``n``), else None.

    Keys that no query sees at the end (a static cache's unwritten slots) are cut off first,
    so that the last key is the last query's own position.  The last query then sees every
    real key, so its row *is* the key padding; the whole mask is compared with the pattern
    that padding implies, except rows with nothing visible (padding queries, which the
    packed path drops).  One pass over the mask and one host sync -- what transformers
    < 4.53 gives every custom backend, made fast.
    """
    if keep.shape[1] != 1 or window[0] >= 0:
        return None
    rows = keep[:, 0].expand(keep.shape[0], seqlen_q, seqlen_k)
    seen = rows.any(dim=1).any(dim=0).nonzero()
    visible = int(seen[-1]) + 1 if seen.numel() else 0
    if visible < seqlen_q:
        return None
    rows = rows[..., :visible]
    key_keep = rows[:, -1, :]
    expected = _band(seqlen_q, visible, window, keep.device) & key_keep[:, None, :]
    empty = ~rows.any(dim=-1, keepdim=True)
    if not bool(((rows == expected) | empty).all()):
        return None
    return key_keep


def _group_heads(x: torch.Tensor, heads_kv: int, group: int) -> torch.Tensor:
    """(B', H' in {1, heads}, ...) -> (B', heads_kv or 1, group or 1, ...) to meet grouped scores."""
    if x.shape[1] == 1:
        return x.unsqueeze(2)
    return x.reshape(x.shape[0], heads_kv, group, *x.shape[2:])


def _math_attention(query, key, value, keep, bias, scale, dropout, softcap):
    """The exact slow path: scores materialised in float32, in the order docs/semantics.md gives
    (scale, softcap, bias, mask, softmax, dropout).  GQA by broadcasting, not copying.
    A query with no visible key gives zeros.  Returns ``(batch, seq_q, heads, dim)``."""
    batch, heads, seqlen_q, dim = query.shape
    heads_kv = key.shape[1]
    group = heads // heads_kv
    scale = dim ** -0.5 if scale is None else scale
    q = query.float().reshape(batch, heads_kv, group, seqlen_q, dim)
    k = key.float().unsqueeze(2)
    v = value.float().unsqueeze(2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        bias = bias.float()
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        scores = scores + _group_heads(bias, heads_kv, group)
    if keep is not None:
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        scores = scores.masked_fill(~_group_heads(keep, heads_kv, group), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total == 0, torch.ones_like(total), total)
    if dropout > 0:
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    out = torch.matmul(weights, v).reshape(batch, heads, seqlen_q, dim)
    return out.transpose(1, 2).to(query.dtype)


# --------------------------------------------------------------------------------------
# The mask builder (transformers >= 4.53)
# --------------------------------------------------------------------------------------


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}


def _recognise(mask_function) -> str | None:
    """``"causal"``, ``"bidirectional"`` or None for transformers' mask-pattern function.

    Only the exact plain patterns are recognised -- transformers' own causal and bidirectional
    functions, and ``and_masks(sliding_window_overlay(w), causal)`` (its sliding-window causal
    mask, whose window the layer passes to the attention function as ``sliding_window``).
    Anything else (packed sequences, overlays, chunks, user functions) is unrecognised and
    gets transformers' full 4-D mask: slower, never wrong.
    """
    # (Module-level imports only: this runs inside torch.compile'd model code, where an import
    # statement is not traceable on every torch version.)
    causal_fn = getattr(_masking_utils, "causal_mask_function", None)
    if mask_function is causal_fn:
        return "causal"
    if mask_function is getattr(_masking_utils, "bidirectional_mask_function", None):
        return "bidirectional"
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = tuple(_closure(mask_function).get("mask_functions", ()))
        if (len(parts) == 2 and parts[1] is causal_fn
                and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"):
            return "sliding_causal"
    return None


def _transformers_mask(**kwargs):
    """transformers' own 4-D boolean mask (its SDPA builder), never skipped for ``is_causal``:
    a skipped causal mask means *top-left* alignment to SDPA, which a ``None`` here would not."""
    kwargs["allow_is_causal_skip"] = False
    return _masking_utils.AttentionMaskInterface._global_mapping["sdpa"](**kwargs)


def flashtile_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, cache_position=None, **kwargs):
    """transformers' mask-builder protocol for the flashtile backend (see the module docstring).

    Returns ``None``, a ``(batch, n)`` boolean padding mask over the first ``n <= kv_length``
    keys, or transformers' 4-D boolean mask for unrecognised patterns.
    """
    everything = dict(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                      attention_mask=attention_mask, **kwargs)
    if cache_position is not None:  # transformers < 4.55 describes the queries by their positions
        everything["cache_position"] = cache_position
        q_length = cache_position.shape[0]
        last_query = cache_position[-1]
    else:
        everything.update(q_length=q_length, q_offset=q_offset)
        last_query = q_offset + q_length - 1

    pattern = _recognise(mask_function) if mask_function is not None else "causal"
    if pattern is None or kwargs.get("use_vmap", False):
        return _transformers_mask(**everything)
    compiling = _compiling()
    if pattern == "bidirectional":
        visible = kv_length
    else:
        # Keys after the last query are never visible (e.g. a static cache's unwritten slots):
        # cut them off, so that the last visible key is the last query's own position.
        visible = last_query + 1 - kv_offset
        if isinstance(visible, torch.Tensor):
            if compiling:
                return _transformers_mask(**everything)
            visible = int(visible)
        if not q_length <= visible <= kv_length:
            return _transformers_mask(**everything)

    if attention_mask is None:
        if visible == kv_length:
            return None
        return torch.ones(batch_size, visible, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    padding = attention_mask.bool()[:, kv_offset:kv_offset + visible]
    if padding.shape[1] < visible:  # the 2-D mask may stop at the last written position
        padding = torch.nn.functional.pad(padding, (0, visible - padding.shape[1]), value=False)
    if compiling:
        return padding
    if pattern == "sliding_causal" and _has_holes(padding):
        # The window counts positions; packing the real keys counts only real ones. The two
        # agree when each row's real tokens are contiguous (left or right padding), not otherwise.
        return _transformers_mask(**everything)
    if visible == kv_length and bool(padding.all()):
        return None
    return padding


def _has_holes(keep: torch.Tensor) -> bool:
    """True if some row's True entries are not one contiguous run."""
    starts = (keep[:, 1:] & ~keep[:, :-1]).sum(dim=1) + keep[:, 0].long()
    return bool((starts > 1).any())


# --------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------


def register() -> str:
    """Register the ``"flashtile"`` attention backend with transformers (idempotent); returns its name.

    Works with transformers >= 4.48: ``AttentionInterface`` (>= 4.50) or the plain
    ``ALL_ATTENTION_FUNCTIONS`` dict before it; the mask builder only where
    ``AttentionMaskInterface`` exists (>= 4.53; older versions give every custom backend a
    4-D additive mask, which :func:`flashtile_attention_forward` reads).
    """
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is not None:
        interface.register(ATTENTION_NAME, flashtile_attention_forward)
    else:
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError as exc:
            raise ImportError(
                f"the flashtile backend needs transformers >= 4.48 (attention interface), found {transformers.__version__}"
            ) from exc
        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = flashtile_attention_forward
    mask_interface = getattr(_masking_utils, "AttentionMaskInterface", None)
    if mask_interface is not None:  # (transformers < 4.53: models build 4-D masks themselves)
        mask_interface.register(ATTENTION_NAME, flashtile_mask)
    _teach_flash_loader()
    return ATTENTION_NAME


def _flash_attn_api():
    """flashtile's flash-attn-compatible functions, in the order transformers' loader returns them."""
    return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input


def _teach_flash_loader() -> None:
    """Let transformers >= 5 load "flashtile" as the flash-attention flavour its name says it is.

    transformers 5 treats every implementation name containing "flash" as flash-attention
    (``utils.generic.is_flash_attention_requested``) and, when a model is built, preloads that
    flavour's functions through ``modeling_flash_attention_utils._lazy_imports`` -- which knows
    only flash-attn's own packages and Hub kernels, and so rejects "flashtile".  flashtile has
    flash-attn's API, so the loader is wrapped to answer for this one name with flashtile's
    functions (every other name goes to the original).  The model's attention layers still call
    :func:`flashtile_attention_forward`; model code that branches on flash-attention (vision
    encoders passing ``cu_seq_lens_*``) gets the variable-length path it expects.
    """
    try:
        from transformers import modeling_flash_attention_utils as flash_utils
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return  # transformers < 5: no name-based flash-attention detection
    try:
        treated_as_flash = is_flash_attention_requested(requested_attention_implementation=ATTENTION_NAME)
    except TypeError:
        return
    loader = getattr(flash_utils, "_lazy_imports", None)
    if not treated_as_flash or loader is None or getattr(loader, "_flashtile_wrapper", False):
        return

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation == ATTENTION_NAME:
            return _flash_attn_api()
        return loader(implementation, *args, **kwargs)

    _lazy_imports._flashtile_wrapper = True
    _lazy_imports.__doc__ = loader.__doc__
    flash_utils._lazy_imports = _lazy_imports


register()
