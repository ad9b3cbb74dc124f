"""Q2_K, Q3_K and IQ4_XS super-blocks of given float32 weights, which gguf-py
cannot quantize into: one pass of the simplest choice of scales (no search
for better ones, as llama.cpp's quantizers make), so the weights come back
near, not as near as llama-quantize's. Any valid blocks do for the tests,
whose oracle is gguf-py's dequantization of these bytes."""
from __future__ import annotations

import gguf
import numpy as np

IQ4_NL_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


def _half(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 bytes [..., 2], the float32 values they hold)."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(*values.shape[:-1], 2), half.astype(np.float32)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is."""
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator != 0)


def _signed_scales(largest: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sub-block step `largest / -levels` (the largest |w| at q = -levels), as
    d (float16 bytes, its float32 value) [..., 1] times a 6-bit sc - 32 [..., sub-blocks]."""
    steps = largest / -levels
    d_bytes, d = _half(np.abs(steps).max(axis=-1, keepdims=True) / 32)
    sc = np.clip(np.round(_ratio(steps, np.broadcast_to(d, steps.shape))), -32, 31)
    return d_bytes, d, sc


def _largest(sub_blocks: np.ndarray) -> np.ndarray:
    """The value of largest |w| of each sub-block (its last axis)."""
    return np.take_along_axis(sub_blocks, np.abs(sub_blocks).argmax(axis=-1, keepdims=True), axis=-1)[..., 0]


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """[..., 256] values of 2 bits -> [..., 64] bytes: weight 128 h + 32 s + l in bits 2s of byte 32 h + l."""
    planes = q.reshape(*q.shape[:-1], 2, 4, 32).astype(np.uint8) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    return np.bitwise_or.reduce(planes, axis=-2).reshape(*q.shape[:-1], 64)


def q2_k_blocks(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] -> Q2_K blocks [rows, bytes]: per 16 weights a
    4-bit min m (w's most negative) and scale sc (its range over 3), q in 0..3."""
    rows, columns = weights.shape
    sub = weights.reshape(rows, columns // 256, 16, 16)
    offset = np.maximum(-sub.min(axis=-1), 0)
    step = (sub.max(axis=-1) + offset) / 3
    d_bytes, d = _half(step.max(axis=-1, keepdims=True) / 15)
    dmin_bytes, dmin = _half(offset.max(axis=-1, keepdims=True) / 15)
    sc = np.clip(np.round(_ratio(step, np.broadcast_to(d, step.shape))), 0, 15)
    m = np.clip(np.round(_ratio(offset, np.broadcast_to(dmin, offset.shape))), 0, 15)
    q = np.clip(np.round(_ratio(sub + (dmin * m)[..., None], np.broadcast_to((d * sc)[..., None], sub.shape))), 0, 3)
    scales = (sc.astype(np.uint8) | m.astype(np.uint8) << 4)
    parts = [scales, _two_bit_planes(q.reshape(rows, -1, 256)), d_bytes, dmin_bytes]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def q3_k_blocks(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] -> Q3_K blocks [rows, bytes]: per 16 weights a
    step that puts the largest |w| at q = -4, q in -4..3."""
    rows, columns = weights.shape
    sub = weights.reshape(rows, columns // 256, 16, 16)
    d_bytes, d, sc = _signed_scales(_largest(sub), 4)
    q = np.clip(np.round(_ratio(sub, np.broadcast_to((d * sc)[..., None], sub.shape))), -4, 3)
    stored = (q + 4).astype(np.uint8).reshape(rows, -1, 256)  # low 2 bits, and the high bit that says q >= 0
    high = (stored >> 2).reshape(rows, -1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
    hmask = np.bitwise_or.reduce(high, axis=-2)  # bit b of byte l: weight 32 b + l
    u = (sc + 32).astype(np.uint8)  # [rows, blocks, 16]
    low = u[..., :8] & 0xF | (u[..., 8:] & 0xF) << 4
    top = (u >> 4).reshape(rows, -1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    packed = np.concatenate([low, np.bitwise_or.reduce(top, axis=-2)], axis=-1)
    return np.concatenate([hmask, _two_bit_planes(stored & 3), packed, d_bytes], axis=-1).reshape(rows, -1)


def iq4_xs_blocks(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] -> IQ4_XS blocks [rows, bytes]: per 32 weights a
    step that puts the largest |w| at IQ4_NL's -127, each weight its nearest entry."""
    rows, columns = weights.shape
    sub = weights.reshape(rows, columns // 256, 8, 32)
    d_bytes, d, sc = _signed_scales(_largest(sub), 127)
    step = (d * sc)[..., None, None]
    n = np.abs(sub[..., None] - step * IQ4_NL_VALUES).argmin(axis=-1).astype(np.uint8)
    u = (sc + 32).astype(np.uint8)  # [rows, blocks, 8]
    low = u[..., 0::2] & 0xF | (u[..., 1::2] & 0xF) << 4
    high = np.bitwise_or.reduce((u >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16)), axis=-1)
    nibbles = (n[..., :16] | n[..., 16:] << 4).reshape(rows, -1, 128)  # byte l: weight l low, l + 16 high
    parts = [d_bytes, high[..., None].view(np.uint8), low, nibbles]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


QUANTIZERS = {gguf.GGMLQuantizationType.Q2_K: q2_k_blocks, gguf.GGMLQuantizationType.Q3_K: q3_k_blocks,
              gguf.GGMLQuantizationType.IQ4_XS: iq4_xs_blocks}
"""GGUF type -> its quantizer here."""
